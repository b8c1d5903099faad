"""Batch norms no convolution precedes (pre-activation networks) through QAT and int8."""
import numpy as np
import pytest

from tftrain.compress import qat_norms, quantization
from tftrain.compress.unquantizable import FOLDED_INTO
from tftrain.config import load_config
from tftrain.core.keras import keras


@pytest.mark.parametrize("center, scale", [(True, True), (False, True), (True, False)])
def test_the_affine_form_computes_what_the_batch_norm_computes_at_inference(center, scale):
    """scale = gamma / sqrt(variance + epsilon), offset = beta - mean * scale, from the
    batch norm's weights in their order, whichever of gamma and beta it has."""
    rng = np.random.default_rng(0)
    norm = keras.layers.BatchNormalization(center=center, scale=scale, epsilon=1e-3, name="bn")
    norm.build((None, 4, 4, 6))
    norm.set_weights([rng.uniform(0.5, 2.0, 6).astype("float32") if "variance" in w.name
                      else rng.normal(size=6).astype("float32") for w in norm.weights])
    affine = qat_norms.ChannelAffine.of(norm)
    affine.build((None, 4, 4, 6))
    affine.adopt([w.numpy() for w in norm.weights])
    x = rng.normal(size=(3, 4, 4, 6)).astype("float32") * 3
    expected = norm(x, training=False).numpy()
    product = x * affine.scale.numpy()
    assert affine.name == "bn"
    np.testing.assert_allclose(product + affine.offset.numpy(), expected, rtol=1e-5, atol=1e-5)


def _preactivation_net():
    """A DenseNet block and a ResNetV2 unit: batch norms on a concatenation, on a residual
    sum and after a convolution that also feeds the concatenation; one batch norm a
    convolution alone feeds (folded by tfmot)."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
    b = keras.layers.ReLU(name="relu_0")(keras.layers.BatchNormalization(name="bn_shared")(h))
    b = keras.layers.Conv2D(8, 3, padding="same", name="conv_0")(b)
    h = keras.layers.Concatenate(name="concat")([h, b])
    r = keras.layers.ReLU(name="relu_1")(keras.layers.BatchNormalization(name="bn_concat")(h))
    r = keras.layers.Conv2D(16, 1, name="conv_1", use_bias=False)(r)
    r = keras.layers.BatchNormalization(name="bn_folded")(r)
    s = keras.layers.Add(name="add")([r, keras.layers.Conv2D(16, 1, name="shortcut")(h)])
    s = keras.layers.ReLU(name="relu_2")(keras.layers.BatchNormalization(name="bn_sum")(s))
    s = keras.layers.GlobalAveragePooling2D(name="pool")(s)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(s))


def test_the_batch_norms_tfmot_cannot_fold_are_found_from_the_graph():
    net = _preactivation_net()
    assert qat_norms.standalone_norms(net, FOLDED_INTO) == {"bn_shared", "bn_concat", "bn_sum"}
    inputs = keras.Input((3, 8, 8))       # channels first: no per-channel affine on the last axis
    first = keras.layers.BatchNormalization(axis=1, name="bn_axis_1")(inputs)
    assert qat_norms.standalone_norms(keras.Model(inputs, first), FOLDED_INTO) == set()


@pytest.mark.slow
def test_a_preactivation_network_quantizes_to_int8_ops_xnnpack_runs(tmp_path):
    """The standalone batch norms become int8 MUL and ADD (no float op between the input's
    QUANTIZE and the output's DEQUANTIZE), XNNPack runs every op, the file computes what
    the QAT model does (SQNR of the logits at least 25 dB), and the QAT model before any
    update computes what the float model does up to 8-bit rounding."""
    from ai_edge_litert.interpreter import Interpreter

    from tftrain.export import artifacts, fidelity, onnx_export, onnx_fidelity, speed
    keras.utils.set_random_seed(0)
    net = _preactivation_net()
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (64, 8, 8, 3)).astype("float32")
    for layer in net.layers:             # statistics away from the identity
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(size=n).astype("float32") * 0.1)
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n).astype("float32"))
    q = quantization.quantize_model(net, load_config(None, []).compression.quantization, False)
    kinds = {layer.name: type(getattr(layer, "layer", layer)).__name__ for layer in q.layers}
    assert {kinds[f"quant_{n}"] for n in ("bn_shared", "bn_concat", "bn_sum")} == {"ChannelAffine"}
    assert quantization.calibrate_ranges(q, [x[:32], x[32:]]) == 2
    product = q.get_layer("quant_bn_sum").layer._range       # the product's own range, calibrated
    assert -6.0 < float(product["min_var"]) < 0.0 < float(product["max_var"]) != 6.0
    floats, quantized = net(x, training=False).numpy(), q(x, training=False).numpy()

    def sqnr(expected, got):
        return 10 * np.log10(np.sum(expected ** 2) / np.sum((got - expected) ** 2))
    assert sqnr(floats, quantized) >= 20, sqnr(floats, quantized)
    blob = artifacts.convert_tflite(artifacts.save_saved_model(q, tmp_path / "sm"), "int8", x, qat=True)
    interpreter = Interpreter(model_content=blob)
    interpreter.allocate_tensors()
    ops = [op["op_name"] for op in interpreter._get_ops_details() if op["op_name"] != "DELEGATE"]
    assert ops[0] == "QUANTIZE" and ops[-1] == "DEQUANTIZE"
    assert ops.count("MUL") == 3 and not {"DEQUANTIZE"} & set(ops[1:-1]), ops
    assert speed.xnnpack(blob)["fallback"] == []
    logits, _ = artifacts.tflite_logits(blob, x)
    assert sqnr(quantized, logits) >= 25, sqnr(quantized, logits)
    # layer by layer, each batch norm's output is its ADD (fused with the ReLU after it),
    # not the product inside it: no layer is compared at a MUL, none departs by 15 dB
    rows = fidelity.tflite_report(blob, q, x)
    assert "MUL" not in {row["op"] for row in rows}
    assert min(row["local_sqnr_db"] for row in rows) >= 15, rows
    # the int8 ONNX file made from it (tensor names kept) is compared the same way
    rows = onnx_fidelity.report(onnx_export.int8_onnx(blob, "U8S8"), q, x)
    assert {f"quant_{n}" for n in ("bn_shared", "bn_concat", "bn_sum")}.isdisjoint(
        row["layer"] for row in rows)
    assert min(row["local_sqnr_db"] for row in rows) >= 15, rows


@pytest.mark.slow
def test_a_densenet_converts_to_int8_with_each_pool_sharing_its_input_scale(tmp_path):
    """A small tf_keras DenseNet (one layer a dense block) after QAT calibration: every
    transition's average pooling keeps its input's range, since TFLite's int8
    AVERAGE_POOL_2D needs one scale in and out (a range of its own failed every
    DenseNet's conversion after QAT: "violate the same scale constraint"), and the file
    converts with its pools' input and output at one scale."""
    from ai_edge_litert.interpreter import Interpreter
    from tf_keras.src.applications import densenet

    from tftrain.export import artifacts
    keras.utils.set_random_seed(0)
    backbone = densenet.DenseNet([1, 1, 1, 1], include_top=False, weights=None,
                                 input_shape=(32, 32, 3), pooling="avg")
    net = keras.Model(backbone.input, keras.layers.Dense(10, name="logits")(backbone.output))
    x = np.random.default_rng(0).uniform(0, 1, (32, 32, 32, 3)).astype("float32")
    q = quantization.quantize_model(net, load_config(None, []).compression.quantization, True)
    quantization.calibrate_ranges(q, [x])
    q.compile(keras.optimizers.SGD(0.01),                     # the ranges move as in QAT
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    q.fit(x, np.arange(32) % 10, batch_size=8, epochs=1, verbose=0)
    blob = artifacts.convert_tflite(artifacts.save_saved_model(q, tmp_path / "sm"), "int8", x, qat=True)
    interpreter = Interpreter(model_content=blob)
    interpreter.allocate_tensors()
    pools = [op for op in interpreter._get_ops_details() if op["op_name"] == "AVERAGE_POOL_2D"]
    assert len(pools) == 3
    for pool in pools:
        scales = [interpreter._get_tensor_details(int(i), 0)["quantization"][0]
                  for i in (pool["inputs"][0], pool["outputs"][0])]
        assert scales[0] == scales[1] != 0, scales
