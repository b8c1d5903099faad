import numpy as np
import pytest

from tftrain.compress import qat_scheme, quantization, unquantizable
from tftrain.config import load_config
from tftrain.core.keras import keras


def separable_net(rng):
    """Conv2D -> SeparableConv2D -> BatchNormalization -> ReLU -> pool -> Dense, the
    pointwise kernel of the SeparableConv2D pruned to half (Xception's block)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv")(inputs)
    h = keras.layers.SeparableConv2D(16, 3, padding="same", use_bias=False, name="sep")(h)
    bn = keras.layers.BatchNormalization(name="sep_bn")
    h = keras.layers.ReLU(name="relu")(bn(h))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    net(np.zeros((1, 8, 8, 3), np.float32))
    bn.gamma.assign(rng.uniform(0.5, 2, 16)), bn.beta.assign(rng.normal(size=16))
    kernel = net.get_layer("sep").pointwise_kernel
    values = kernel.numpy()
    values[np.abs(values) < np.median(np.abs(values))] = 0
    kernel.assign(values)
    return net, values == 0


def test_a_separable_conv_is_split_in_two_named_parts_that_keep_its_pruned_zeros(tmp_path):
    """tfmot splits a SeparableConv2D into a DepthwiseConv2D and a 1x1 Conv2D with an
    8-bit range between them; the parts are named after it, the 1x1 part keeps the
    pointwise kernel's pruned zeros through QAT updates, and the int8 TFLite file runs
    both as int8 ops with those zeros, the batch norm folded into the 1x1 convolution."""
    from tftrain.export import artifacts, fidelity
    rng = np.random.default_rng(0)
    net, zeros = separable_net(rng)
    assert unquantizable.quantizable(net.get_layer("sep"), ["Conv2D"])
    cfg = load_config(None, []).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=True)
    names = [layer.layer.name for layer in q.layers if hasattr(layer, "layer")]
    assert {"sep_depthwise", "sep_pointwise"} <= set(names) and "sep" not in names
    assert qat_scheme.split_names("sep") == ("sep_depthwise", "sep_pointwise")
    x = rng.normal(size=(256, 8, 8, 3)).astype(np.float32)
    quantization.calibrate_ranges(q, [x[:64], x[64:128]])
    q.compile(keras.optimizers.Adam(0.01),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    q.fit(x, rng.integers(0, 10, 256), batch_size=32, epochs=1, verbose=0)   # 8 updates
    pointwise = quantization.quantized_kernels(q)["sep_pointwise"]
    assert np.array_equal(pointwise == 0, zeros) and float(np.mean(zeros)) == 0.5
    saved = artifacts.save_saved_model(q, tmp_path / "saved_model")
    blob = artifacts.convert_tflite(saved, "int8", x[:64], qat=True)
    kernels = {name: w for name, w in artifacts.tflite_weights(blob).items()
               if w.ndim == 4 and w.dtype == np.int8}
    assert len(kernels) == 3            # the first conv, the depthwise and the 1x1 parts
    one_by_one, = [w for w in kernels.values() if w.shape[1:3] == (1, 1)]
    assert float(np.mean(one_by_one == 0)) == 0.5
    rows = {r["layer"]: r for r in fidelity.tflite_report(blob, q, x[:64])}
    assert rows["quant_sep_depthwise"]["op"] == "DEPTHWISE_CONV_2D"
    assert rows["quant_relu"]["op"] == "CONV_2D" and rows["quant_relu"]["local_sqnr_db"] > 30


def test_the_pruned_weight_of_a_split_part_is_found_on_the_separable_conv():
    net, _ = separable_net(np.random.default_rng(1))
    sep = net.get_layer("sep")
    assert qat_scheme.split_source(net, "sep_pointwise", "kernel") == (sep, "pointwise_kernel")
    assert qat_scheme.split_source(net, "sep_depthwise", "depthwise_kernel") == \
        (sep, "depthwise_kernel")
    assert qat_scheme.split_source(net, "conv", "kernel") == (net.get_layer("conv"), "kernel")
    with pytest.raises(ValueError):
        qat_scheme.split_source(net, "nothing_pointwise", "kernel")
