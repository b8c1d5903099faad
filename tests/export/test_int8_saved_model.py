"""The int8 SavedModel: codes from QAT ranges (the int8 TFLite file's), batch norms
folded exactly, post-training weight-only codes, loading with TensorFlow alone."""
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tftrain.compress import quantization
from tftrain.export import artifacts, exports
from tftrain.export.context import ExportFlags
from tftrain.core.keras import keras
from tftrain.config import load_config
from tftrain.data import load_source
from tftrain.export.int8_saved_model import (ActivationRanges, fold_batch_norm, qat_codes,
                                             quantized_model, weight_only_codes)
from tftrain.models import MODELS

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def digits():
    source = load_source(load_config().data, 0)
    x, y = (np.concatenate(p) for p in zip(*source.val.batch(512).as_numpy_iterator()))
    return source, x, y


def trained(model, source, epochs):
    keras.utils.set_random_seed(0)
    model.compile(keras.optimizers.Adam(0.003), LOSS, metrics=["accuracy"])
    model.fit(source.calibration(source.num_train).batch(64), epochs=epochs, verbose=0)
    return model


def qat(model, source, preserve_sparsity=False):
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    return trained(quantization.quantize_model(artifacts.inference_model(model), cfg,
                                              preserve_sparsity), source, 1)


@pytest.fixture(scope="module")
def pqat_cnn(digits):
    """A CNN with half of every kernel zeroed (smallest magnitudes), then prune-preserving
    QAT: (float model, QAT model)."""
    source = digits[0]
    keras.utils.set_random_seed(0)     # weights not decided by the tests run before it
    net = trained(MODELS.get("cnn")(source.spec, filters=[16, 32], dense=[64]), source, 6)
    for layer in net.layers:
        if hasattr(layer, "kernel"):
            kernel = layer.kernel.numpy()
            kernel[np.abs(kernel) < np.median(np.abs(kernel))] = 0
            layer.kernel.assign(kernel)
    return net, qat(net, source, preserve_sparsity=True)


@pytest.fixture(scope="module")
def qat_resnet(digits):
    source = digits[0]
    keras.utils.set_random_seed(1)     # weights not decided by the tests run before it
    return qat(trained(MODELS.get("resnet")(source.spec, depth=8, width=8), source, 2), source)


def kernel_quantizers(model):
    for layer in model.layers:
        for weight, quantizer, variables in getattr(layer, "_weight_vars", []):
            yield layer.layer, weight, quantizer, variables


def test_codes_times_scale_are_the_fake_quantized_kernel_and_keep_zeros(pqat_cnn):
    layers = list(kernel_quantizers(pqat_cnn[1]))
    assert [layer.name for layer, *_ in layers] == ["conv_0", "conv_1", "dense_0", "logits"]
    for layer, weight, quantizer, variables in layers:
        codes = qat_codes(weight, quantizer, variables, type(layer).__name__)
        masked = weight * variables["sparsity_mask"]
        fake = quantizer(masked, training=False, weights=variables).numpy()
        assert codes.values.dtype == np.int8 and np.max(np.abs(codes.values)) <= 127
        np.testing.assert_allclose(codes.dequantized(), fake, rtol=1e-6, atol=1e-9)
        assert codes.scale.shape == (weight.shape[-1],)
        pruned = variables["sparsity_mask"].numpy() == 0
        assert pruned.mean() >= 0.45 and np.all(codes.values[pruned] == 0), layer.name


def tflite_int8_kernels(blob):
    """TFLite's constant int8 tensors of rank >= 2: (values, per-channel scales)."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=blob)
    interp.allocate_tensors()
    found = []
    for detail in interp.get_tensor_details():
        if detail["dtype"] == np.int8 and len(detail["shape"]) >= 2:
            try:
                found.append((interp.get_tensor(detail["index"]).copy(),
                              detail["quantization_parameters"]["scales"]))
            except ValueError:
                continue
    return found


def test_codes_and_scales_are_the_int8_tflite_files(pqat_cnn, tmp_path):
    float_net, qat_net = pqat_cnn
    saved = artifacts.save_saved_model(qat_net, tmp_path / "saved")
    lite = tflite_int8_kernels(artifacts.convert_tflite(saved, "int8", np.zeros((0,)), qat=True))
    model, _ = quantized_model(qat_net, qat=True)
    for name in ("conv_0", "conv_1", "dense_0", "logits"):
        layer = model.get_layer(name)
        layer = layer.layer if isinstance(layer, ActivationRanges) else layer
        codes = layer.kernel_int8.numpy()
        # TFLite's layouts: convolutions [out, h, w, in], fully connected [out, in]
        codes = np.transpose(codes, (3, 0, 1, 2)) if codes.ndim == 4 else codes.T
        same = [scales for values, scales in lite if values.shape == codes.shape
                and np.array_equal(values, codes)]
        assert len(same) == 1, name
        # a channel whose every code is 0 has no scale to agree on (TFLite gives it ~4e-9)
        used = np.any(codes.reshape(codes.shape[0], -1) != 0, axis=1) if codes.ndim == 4 \
            else np.any(codes != 0, axis=1)
        np.testing.assert_allclose(np.broadcast_to(same[0], layer.kernel_scale.shape)[used],
                                   layer.kernel_scale.numpy()[used], rtol=1e-6)


def test_the_int8_model_computes_what_the_qat_model_does(pqat_cnn, digits):
    _, qat_net = pqat_cnn
    model, layers = quantized_model(qat_net, qat=True)
    x = digits[1]
    np.testing.assert_allclose(model.predict(x, verbose=0), qat_net.predict(x, verbose=0),
                               atol=1e-5)
    assert set(layers) == {"conv_0", "conv_1", "dense_0", "logits"}
    assert all(0.45 <= e["zero_fraction"] <= 0.55 for e in layers.values())
    kernels = [w for w in model.weights if "kernel" in w.name]
    assert sorted(w.dtype.name for w in kernels) == ["float32"] * 4 + ["int8"] * 4   # + scales
    assert all("scale" in w.name for w in kernels if w.dtype != tf.int8)


def test_batch_norm_folds_exactly_with_negative_multipliers():
    rng = np.random.default_rng(0)
    inputs = keras.Input((6, 6, 3))
    conv = keras.layers.Conv2D(4, 3, use_bias=True)
    bn = keras.layers.BatchNormalization(epsilon=1e-3)
    model = keras.Model(inputs, bn(conv(inputs)))
    bn.set_weights([np.array([1.5, -0.7, 0.2, -2.0], np.float32), rng.normal(size=4).astype(np.float32),
                    rng.normal(size=4).astype(np.float32), rng.uniform(0.1, 2, 4).astype(np.float32)])
    codes = weight_only_codes(conv.kernel.numpy(), "Conv2D")
    conv.kernel.assign(codes.dequantized())
    x = rng.normal(size=(5, 6, 6, 3)).astype(np.float32)
    expected = model(x, training=False).numpy()
    folded, bias = fold_batch_norm(codes, conv.bias.numpy(), bn)
    assert np.all(folded.scale > 0) and np.array_equal(np.abs(folded.values), np.abs(codes.values))
    assert np.array_equal(folded.values[..., 1], -codes.values[..., 1])
    got = tf.nn.conv2d(x, folded.dequantized(), 1, "VALID") + bias
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-4)


def layer_by_layer(model, qat_model, x) -> dict:
    """Each layer of the int8 `model` run on what the QAT model computed before it where
    the QAT model quantized it (the input, a layer with activation ranges), on its own
    values elsewhere (a folded convolution, a batch norm before its ReLU's quantizer): for
    each layer with activation ranges, |int8 - QAT| in steps of its range, value by value."""
    qat_values = keras.Model(qat_model.inputs, [layer.output for layer in qat_model.layers[1:]])
    reference = dict(zip((layer.name for layer in model.layers),   # clone_model keeps order
                         [x, *qat_values.predict(x, verbose=0)]))
    own, steps = {model.layers[0].name: x}, {}
    for layer in model.layers[1:]:
        parents = tf.nest.flatten(layer.inbound_nodes[0].inbound_layers)
        inputs = [reference[p.name] if isinstance(p, ActivationRanges) or p is model.layers[0]
                  else own[p.name] for p in parents]
        own[layer.name] = layer(inputs[0] if len(inputs) == 1 else inputs).numpy()
        if isinstance(layer, ActivationRanges):
            step = max((high.numpy() - low.numpy()) / 255 for low, high in layer.ranges.values())
            steps[layer.name] = np.abs(own[layer.name] - reference[layer.name]) / step
    return steps


@pytest.mark.slow
def test_resnet_folds_every_batch_norm_and_loads_with_tensorflow_alone(qat_resnet, digits,
                                                                       tmp_path):
    source = digits[0]
    cfg = load_config(None, ["export.saved_model_int8=true", "export.saved_model=false",
                             "export.tflite=none"])
    report = exports.export_all(qat_resnet, cfg, tmp_path, source, ExportFlags(qat=True))["saved_model_int8"]
    assert report["folded_batch_norms"] == 9 and report["int8_layers"] == 10
    assert report["verified"]
    # Folding changes float rounding (a folded batch norm's output moves by about 1e-6), so
    # a value that lies on the edge of two 8-bit levels of the next quantizer may round
    # the other way: fed what the QAT model quantized before it, each quantized layer gives
    # the QAT layer's values, or one step of its range away on a few of them; and a logit
    # differs only in an example where such a step happened (it propagates from there).
    model, _ = quantized_model(qat_resnet, qat=True)
    x = digits[1]
    steps = layer_by_layer(model, qat_resnet, x)
    assert len(steps) == 15
    stepped = np.zeros(len(x), bool)
    for name, d in steps.items():
        assert np.all((d < 1e-3) | (np.abs(d - 1) < 1e-3)), (name, np.max(d))
        assert np.mean(d > 0.5) < 1e-3, name
        stepped |= np.any((d > 0.5).reshape(len(x), -1), axis=1)
    diff = np.abs(model.predict(x, verbose=0) - qat_resnet.predict(x, verbose=0))
    assert not np.any(np.any(diff > 1e-5, axis=1) & ~stepped)
    assert np.mean(np.any(diff > 1e-5, axis=1)) <= np.mean(stepped) < 0.02
    assert report["max_abs_logit_diff"] == pytest.approx(np.max(diff), abs=1e-6)
    path = tmp_path / "saved_model_int8"
    reader = tf.train.load_checkpoint(str(path / "variables" / "variables"))
    dtypes = reader.get_variable_to_dtype_map()
    assert not [k for k in dtypes if "moving_mean" in k or "gamma" in k]
    assert sum(d == tf.int8 for d in dtypes.values()) == 10
    x = digits[1][:4]
    np.save(tmp_path / "x.npy", x)
    script = (
        "import sys, numpy as np, tensorflow as tf\n"
        f"f = tf.saved_model.load({str(path)!r}).signatures['serving_default']\n"
        f"print(np.round(f(inputs=tf.constant(np.load({str(tmp_path / 'x.npy')!r})))"
        "['logits'].numpy(), 3).tolist())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tftrain', 'tensorflow_model_optimization')))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logits, modules = proc.stdout.strip().splitlines()[-2:]
    assert modules == "[]"
    np.testing.assert_allclose(eval(logits), model.predict(x, verbose=0), atol=2e-3)


def test_weight_only_int8_of_a_float_model(pqat_cnn, digits, tmp_path):
    float_net, _ = pqat_cnn
    source, x, y = digits
    model, layers = quantized_model(float_net, qat=False)
    for name in layers:
        layer = model.get_layer(name)
        codes = getattr(layer, "layer", layer).kernel_int8.numpy()
        per_channel = np.max(np.abs(codes.reshape(-1, codes.shape[-1])), axis=0)
        # symmetric, one scale per channel (a channel of zeros stays zeros)
        assert np.all((per_channel == 127) | (per_channel == 0)) and np.any(per_channel), name
    cfg = load_config(None, ["export.saved_model_int8=true", "export.tflite=none"])
    report = exports.export_all(float_net, cfg, tmp_path, source)["saved_model_int8"]
    assert "post-training weight-only" in report["kernels"]
    # Example by example: every logit within 0.5 of the float model's, so only examples
    # whose two best float logits are within 2 x 0.5 can change class, and accuracy can
    # move by at most their share (this half-zeroed model has many such near-ties).
    assert 0 < report["max_abs_logit_diff"] < 0.5 and report["verified"]
    logits = float_net.predict(x, verbose=0)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    near_ties = np.mean(top2[:, 1] - top2[:, 0] < 2 * 0.5)
    reference = np.mean(np.argmax(logits, -1) == y)
    assert abs(report["accuracy"] - reference) <= near_ties
    assert report["int8_zero_fraction"] >= 0.45                    # the zeroed half stays zero


def test_a_conv1d_through_qat_becomes_a_keras_conv1d(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((20, 4))
    h = keras.layers.Conv1D(8, 3, padding="same", name="conv")(inputs)
    h = keras.layers.ReLU(name="relu")(h)
    outputs = keras.layers.Dense(3, name="logits")(keras.layers.GlobalAveragePooling1D(name="pool")(h))
    net = keras.Model(inputs, outputs)
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    x = np.random.default_rng(0).normal(size=(64, 20, 4)).astype(np.float32)
    q.compile("adam", LOSS)
    q.fit(x, np.arange(64) % 3, epochs=1, verbose=0)
    model, layers = quantized_model(q, qat=True)
    conv = model.get_layer("conv")
    conv = getattr(conv, "layer", conv)               # inside its activation ranges
    assert isinstance(conv, keras.layers.Conv1D) and conv.kernel_int8.shape == (3, 4, 8)
    np.testing.assert_allclose(model.predict(x, verbose=0), q.predict(x, verbose=0), atol=1e-5)


def test_a_qat_transformer_becomes_int8_attention_and_computes_the_qat_model():
    """Attention's four projections, the sequence Dense layers, the token and position
    tables are int8 codes in the int8 SavedModel; attention's inner ranges and biases
    come along, so it computes what the QAT model computes."""
    from tftrain.data import InputSpec
    keras.utils.set_random_seed(3)
    net = MODELS.get("transformer")(InputSpec((8,), "int32", 4, 50), embed_dim=16, num_heads=2,
                                    num_layers=1, mlp_dim=32)
    for weight in net.weights:                        # trained-looking biases, not zeros
        if "bias" in weight.name:
            weight.assign(np.random.default_rng(0).normal(0, 0.2, weight.shape))
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    x = np.random.default_rng(1).integers(0, 50, (128, 8)).astype(np.int32)
    quantization.calibrate_ranges(q, [x])
    model, layers = quantized_model(q, qat=True)
    assert set(layers) == {"tokens", "positions", "b0_attn", "b0_mlp1", "b0_mlp2", "logits"}
    attention = model.get_layer("b0_attn")
    attention = getattr(attention, "layer", attention)
    for name in ("query", "key", "value", "output"):
        assert getattr(attention, f"{name}_kernel_int8").dtype == tf.int8
        assert float(np.max(np.abs(getattr(attention, f"{name}_bias").numpy()))) > 0
    assert not [w.name for w in model.weights if w.dtype == tf.float32 and "kernel:" in w.name]
    np.testing.assert_allclose(model.predict(x, verbose=0), q.predict(x, verbose=0), atol=1e-5)


def test_weight_only_int8_of_a_mixed_precision_model_computes_in_float32(digits):
    from tftrain.runtime import precision
    precision.apply_policy("mixed_bfloat16")
    net = precision.float32_outputs(MODELS.get("cnn")(digits[0].spec, filters=[4], dense=[8]))
    plain = artifacts.inference_model(net)
    model, layers = quantized_model(plain, qat=False)
    assert set(layers) == {"conv_0", "dense_0", "logits"}
    assert all(layer.compute_dtype in (None, "float32") for layer in model.layers)
    x = digits[1][:64]
    np.testing.assert_allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0), atol=0.05)
