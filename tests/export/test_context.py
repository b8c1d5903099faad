"""What the export kinds share (`ExportContext`)."""
import numpy as np
import tensorflow as tf

from tftrain.config import load_config
from tftrain.core.keras import keras
from tftrain.data import load_source
from tftrain.export.context import ExportContext, ExportFlags
from tftrain.export.measures import accuracy


class EagerOnlyVote(keras.layers.Layer):
    """Adds 100 to class 0's logit when called eagerly, nothing when traced: a model whose
    eager and traced predictions differ (as a fake-quant value on a rounding edge moves a
    step in one and not the other), by more than any budget."""

    def call(self, x):
        return x + (100.0 * tf.one_hot(0, 10) if tf.executing_eagerly() else 0.0)


def test_a_qat_models_files_are_held_to_its_accuracy_as_traced_another_to_the_eager(tmp_path):
    """`reference_accuracy`: a quantization-aware trained model's is the model traced as a
    function (what its stage logged and its SavedModel serves), another model's the model
    called eagerly batch by batch."""
    cfg = load_config(None, ["export.tflite=none"])
    source = load_source(cfg.data, 0)
    keras.utils.set_random_seed(0)
    inputs = keras.Input(source.spec.shape)
    logits = keras.layers.Dense(10)(keras.layers.Flatten()(inputs))
    model = keras.Model(inputs, EagerOnlyVote()(logits))
    qat = ExportContext(model, cfg, tmp_path, source, ExportFlags(qat=True))
    plain = ExportContext(model, cfg, tmp_path, source, ExportFlags())
    # eagerly every example is class 0's; traced, the dense layer's own argmax
    assert plain.reference_accuracy == np.mean(qat.y == 0)
    traced = qat.traced
    assert not np.all(np.argmax(traced, -1) == 0)
    assert qat.reference_accuracy == accuracy(traced, qat.y) != plain.reference_accuracy
    np.testing.assert_allclose(traced, model.predict(qat.x, verbose=0), rtol=1e-5, atol=1e-5)
