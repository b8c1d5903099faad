"""Inception-ResNet's scaled residual sum under QAT (`tftrain.compress.qat_residual`)."""
import numpy as np
import pytest
from tf_keras.src.applications.inception_resnet_v2 import CustomScaleLayer

from tftrain.compress import qat_configs, quantization
from tftrain.compress.qat_residual import ScaledSum
from tftrain.compress.unquantizable import unquantizable
from tftrain.config import load_config
from tftrain.core.keras import keras


def _inception_resnet_blocks():
    """Two Inception-ResNet units as Keras Applications writes them: a branch convolution
    added to the unit's input scaled by a constant (`CustomScaleLayer`), then a ReLU."""
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="stem")(inputs)
    for i, scale in enumerate((0.17, 0.1)):
        branch = keras.layers.Conv2D(8, 1, activation="relu", name=f"branch_{i}")(x)
        up = keras.layers.Conv2D(8, 3, padding="same", name=f"up_{i}")(branch)
        x = CustomScaleLayer(scale, name=f"block_{i}")([x, up])
        x = keras.layers.Activation("relu", name=f"block_{i}_ac")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x))


def test_the_quantizable_form_adds_the_scaled_branch_rounded_to_its_range():
    x = np.random.default_rng(0).uniform(-1, 1, (2, 4, 4, 3)).astype("float32")
    y = np.random.default_rng(1).uniform(-2, 2, (2, 4, 4, 3)).astype("float32")
    original = CustomScaleLayer(0.17, name="block")
    form = qat_configs.quantizable_form(original)
    assert type(form) is ScaledSum and form.name == "block" and form.scale == 0.17
    expected = original([x, y]).numpy()
    got = form([x, y]).numpy()                   # the product rounded to 8 bits of [-6, 6]
    assert not np.array_equal(got, expected)
    assert np.max(np.abs(got - expected)) <= 12 / 255 / 2 + 1e-6
    assert qat_configs.supported(original) and qat_configs.supported(form)
    assert ScaledSum.from_config(form.get_config()).scale == 0.17


@pytest.mark.slow
def test_inception_resnet_units_quantize_to_int8_ops_xnnpack_runs(tmp_path):
    """No longer refused: each scaled sum becomes an int8 MUL and an int8 ADD (no float op
    between the input's QUANTIZE and the output's DEQUANTIZE), XNNPack runs every op, and
    the file computes what the QAT model does (SQNR of the logits at least 25 dB, each
    layer at least 15 dB)."""
    from ai_edge_litert.interpreter import Interpreter

    from tftrain.export import artifacts, fidelity, speed
    keras.utils.set_random_seed(0)
    net = _inception_resnet_blocks()
    cfg = load_config(None, []).compression.quantization
    assert unquantizable(net, cfg) == []
    x = np.random.default_rng(0).uniform(0, 1, (64, 8, 8, 3)).astype("float32")
    q = quantization.quantize_model(net, cfg, False)
    assert {type(q.get_layer(f"quant_block_{i}").layer) for i in (0, 1)} == {ScaledSum}
    assert quantization.calibrate_ranges(q, [x[:32], x[32:]]) == 2
    product = q.get_layer("quant_block_0").layer._range        # calibrated, not [-6, 6]
    assert float(product["min_var"]) <= 0.0 < float(product["max_var"]) < 6.0
    floats, quantized = net(x, training=False).numpy(), q(x, training=False).numpy()

    def sqnr(expected, got):
        return 10 * np.log10(np.sum(expected ** 2) / np.sum((got - expected) ** 2))
    assert sqnr(floats, quantized) >= 20, sqnr(floats, quantized)
    blob = artifacts.convert_tflite(artifacts.save_saved_model(q, tmp_path / "sm"), "int8", x,
                                    qat=True)
    interpreter = Interpreter(model_content=blob)
    interpreter.allocate_tensors()
    ops = [op["op_name"] for op in interpreter._get_ops_details() if op["op_name"] != "DELEGATE"]
    assert ops[0] == "QUANTIZE" and ops[-1] == "DEQUANTIZE"
    assert ops.count("MUL") == 2 and ops.count("ADD") == 2, ops
    assert not {"DEQUANTIZE", "QUANTIZE"} & set(ops[1:-1]), ops
    assert speed.xnnpack(blob)["fallback"] == []
    logits, _ = artifacts.tflite_logits(blob, x)
    assert sqnr(quantized, logits) >= 25, sqnr(quantized, logits)
    rows = fidelity.tflite_report(blob, q, x)
    assert min(row["local_sqnr_db"] for row in rows) >= 15, rows
