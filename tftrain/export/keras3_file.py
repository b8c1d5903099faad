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

from pathlib import Path

import numpy as np

NAME = "keras3_file"


def write(net, out: Path, source, data_cfg, export_cfg) -> dict:
    """Write `out / "model.keras"` from `net` (tf_keras, float) and return its entry; the
    model's own logit noise is measured only when the file's logits are further apart
    than `export.max_logit_diff` allows (two more passes), as for the other float files."""
    import tensorflow as tf

    from tftrain.core.keras import keras3
    from tftrain.data import BatchPlan, val_dataset
    from tftrain.export.artifacts import NOISE_EXAMPLES, inference_model
    from tftrain.export import verification
    from tftrain.export.measures import (accuracy, against, input_kind, layer_rounding_noise,
                                         rounding_noise, sizes)
    from tftrain.models.keras3 import to_keras3

    plain = inference_model(net)
    x, y = (np.concatenate(parts) for parts in zip(
        *val_dataset(source, BatchPlan(1024, 1, 1), data_cfg).as_numpy_iterator()))
    reference = np.concatenate([tf.cast(plain(x[i:i + 256], training=False), tf.float32).numpy()
                                for i in range(0, len(x), 256)])
    path = out / "model.keras"
    out.mkdir(parents=True, exist_ok=True)
    to_keras3(plain).save(str(path))
    loaded = keras3().saving.load_model(str(path), compile=False)
    logits = np.concatenate([np.asarray(loaded(x[i:i + 256], training=False), np.float32)
                             for i in range(0, len(x), 256)])
    entry = {**sizes(path.read_bytes()), "accuracy": accuracy(logits, y),
             **against(logits, reference), "input": input_kind(plain, None),
             "form": "Keras 3 .keras (the float model before any QAT)"}
    if not verification.logits_within(entry, export_cfg):
        entry["logit_noise"] = max(rounding_noise(lambda v: plain(v, training=False), x, reference),
                                   layer_rounding_noise(plain, x[:NOISE_EXAMPLES], reference))
    return entry
