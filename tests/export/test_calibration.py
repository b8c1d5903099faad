"""Post-training int8 calibration: every tensor on its own range."""

import numpy as np
import pytest
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter

from tftrain.core.keras import keras
from tftrain.export.calibration import own_ranges


def squeeze_excite(size: int):
    """Features (size x size x 32, up to about 33) times a hard-sigmoid gate in [0, 1]
    computed from their mean: at 1 x 1 the gate has the features' shape."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, 16))
    f = keras.layers.ReLU()(keras.layers.Conv2D(32, 1)(inputs))
    g = keras.layers.Conv2D(32, 1)(keras.layers.GlobalAveragePooling2D(keepdims=True)(f))
    g = keras.layers.Lambda(lambda x: tf.nn.relu6(x + 3.0) * (1.0 / 6.0), name="gate")(g)
    h = keras.layers.Flatten()(keras.layers.Multiply(name="excite")([f, g]))
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def int8(model, size: int) -> bytes:
    x = np.random.RandomState(0).rand(100, size, size, 16).astype(np.float32) * 20
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([row[None]] for row in x)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    return converter.convert()


def scales(blob: bytes) -> dict[str, float]:
    interp = Interpreter(model_content=blob)
    return {d["name"]: d["quantization"][0] for d in interp.get_tensor_details()}


def gate_and_product(blob: bytes) -> tuple[float, float]:
    found = scales(blob)
    gate = next(v for k, v in found.items() if k.endswith("gate/mul"))
    product = next(v for k, v in found.items() if k.endswith("excite/mul"))
    return gate, product


def test_a_gate_of_the_features_shape_keeps_its_own_range():
    """The converter alone records the 1 x 1 gate's range as the product's (its result is
    written over the gate): 255 steps of about 0.13 for values in [0, 1]. Calibrated on
    its own values it gets [0, 1]: a step of 1/255."""
    model = squeeze_excite(1)
    gate, product = gate_and_product(int8(model, 1))
    assert gate == pytest.approx(product) and gate > 0.1, (gate, product)
    with own_ranges():
        gate, product = gate_and_product(int8(model, 1))
    assert gate == pytest.approx(1 / 255, rel=1e-6) and product > 0.1, (gate, product)


def test_a_file_the_memory_plan_did_not_touch_is_the_converters_own_byte_for_byte():
    """At 2 x 2 the gate broadcasts (no result written over it): every range measured
    again equals the calibrator's, and the file is the converter's own."""
    model = squeeze_excite(2)
    plain = int8(model, 2)
    with own_ranges():
        mine = int8(model, 2)
    assert mine == plain
    assert gate_and_product(mine)[0] == pytest.approx(1 / 255, rel=1e-6)


def test_the_converter_is_restored_after_the_block():
    from tensorflow.lite.python.optimize import calibrator
    original = calibrator.Calibrator.calibrate
    with pytest.raises(RuntimeError), own_ranges():
        assert calibrator.Calibrator.calibrate is not original
        raise RuntimeError
    assert calibrator.Calibrator.calibrate is original
