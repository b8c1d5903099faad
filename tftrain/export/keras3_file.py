"""The trained float model handed back as a Keras 3 `.keras` file, for a model that came
in as Keras 3 (a Keras 3 file, or a builder that returned a Keras 3 model).

tftrain trains and compresses the tf_keras form of such a model (tfmot needs it); its
SavedModels and TFLite files load with TensorFlow alone as always. Beside them,
`export/model.keras` is the float model the last float stage finished with (before QAT,
whose fake-quant wrappers have no Keras 3 form), rebuilt as Keras 3 layer by layer
(`models.keras3.to_keras3`) and saved by Keras 3, then loaded back by Keras 3 and checked
like every float artifact: its logits within `export.max_logit_diff` of the model's.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tftrain.core.keras import keras3
from tftrain.export.artifacts import inference_model
from tftrain.export.measures import (NOISE_EXAMPLES, accuracy, against, input_kind,
                                         layer_rounding_noise, rounding_noise, signature_logits,
                                         sizes)
from tftrain.models.keras3 import to_keras3



def write(ctx) -> dict:
    """Write `model.keras` from the export's float model (tf_keras, before any QAT) and
    return its entry; the model's own logit noise is measured only when the file's logits
    are further apart than `export.max_logit_diff` allows (two more passes), as for the
    other float files."""

    x = ctx.x
    if ctx.float_model is ctx.model:         # no QAT: the export's own model and logits
        plain, reference = ctx.plain, ctx.reference
    else:
        plain = inference_model(ctx.float_model)
        reference = signature_logits(lambda inputs: {"logits": tf.cast(
            plain(inputs, training=False), tf.float32)}, x)
    path = ctx.out / "model.keras"
    to_keras3(plain).save(str(path))
    loaded = keras3().saving.load_model(str(path), compile=False)
    logits = np.concatenate([np.asarray(loaded(x[i:i + 256], training=False), np.float32)
                             for i in range(0, len(x), 256)])
    entry = {**sizes(path.read_bytes()), "accuracy": accuracy(logits, ctx.y),
             **against(logits, reference), "input": input_kind(plain, None),
             "form": "Keras 3 .keras (the float model before any QAT)"}
    if not ctx.logits_within(entry):
        entry["logit_noise"] = max(rounding_noise(lambda v: plain(v, training=False), x, reference),
                                   layer_rounding_noise(plain, x[:NOISE_EXAMPLES], reference))
    return entry
