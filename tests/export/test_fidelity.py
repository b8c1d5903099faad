"""Per-layer fidelity of int8 artifacts: SQNR, the layer a bad range is in, honest labels."""
import numpy as np
import pytest
import tensorflow_model_optimization as tfmot

from tftrain.compress import quantization
from tftrain.config import load_config
from tftrain.core.keras import keras
from tftrain.export import artifacts, fidelity, file_tensors, layer_noise, onnx_fidelity

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_sqnr_is_signal_over_noise_power_in_db():
    reference = np.array([3.0, -4.0])                         # power 25
    assert fidelity.sqnr_db(reference, reference + [0.5, 0.0]) == pytest.approx(20.0)  # 0.25
    assert fidelity.sqnr_db(reference, reference) == fidelity.CAP_DB
    assert fidelity.sqnr_db(np.zeros(2), np.ones(2)) == -fidelity.CAP_DB


def test_onnx_maps_come_in_the_tflite_files_order_where_channels_height_and_width_are_equal(
        qat_cnn, tmp_path):
    # the CNN's first maps are 8x8 with 8 channels: ONNX holds them as NCHW and the
    # shape cannot tell (MobileNetV2's 8x8x8 maps read as NHWC once scored -3 dB)
    from tftrain.export import onnx_export
    q, x, _, _ = qat_cnn
    blob = converted(q, tmp_path / "m")
    names = [layer.name for layer in q.layers]
    lite = file_tensors.tflite_tensors(blob, names, x[:32])
    onnx = onnx_fidelity.onnx_tensors(onnx_export.int8_onnx(blob, "U8U8"), names, x[:32])
    square = [n for n, t in onnx.items() if t["value"].ndim == 4 and
              len(set(t["value"].shape[1:])) == 1]
    assert "quant_relu_0" in square
    for name in sorted(set(lite) & set(onnx), key=lambda n: n not in square):   # square first
        step = np.min(np.abs(np.diff(np.unique(lite[name]["value"])))) if \
            np.unique(lite[name]["value"]).size > 1 else 1.0
        assert onnx[name]["value"].shape == lite[name]["value"].shape, name
        # ONNX Runtime's int8 kernels round as LiteRT's do, to one step at most
        assert np.max(np.abs(onnx[name]["value"] - lite[name]["value"])) <= step * 1.001, name
    rows = {r["layer"]: r for r in onnx_fidelity.report(onnx_export.int8_onnx(blob, "U8U8"), q,
                                                       x[:32])}
    assert rows["quant_relu_0"]["local_sqnr_db"] > 30


def test_layers_whose_names_hold_a_slash_are_each_compared(tmp_path):
    """Keras Applications name layers as paths (MobileNetV3's `Conv`, `Conv/BatchNorm`,
    `expanded_conv/depthwise`): TFLite's tensor names are paths too, so the convolution's
    tensor (batch norm folded in) belongs to `Conv/BatchNorm`, not `Conv`. Read part by
    part, it was compared with `Conv`'s output before the batch norm (-5.9 dB in a QAT
    MobileNetV3Small) and every `expanded_conv/...` layer was left out (37 of 103)."""
    order = {"quant_Conv": 1, "quant_Conv/BatchNorm": 2, "quant_expanded_conv/depthwise": 3}
    assert file_tensors.layer_of_tensor("functional/quant_Conv/BatchNorm/FusedBatchNormV3;"
                                    "functional/quant_Conv/Conv2D", order) == "quant_Conv/BatchNorm"
    assert file_tensors.layer_of_tensor("functional/quant_expanded_conv/depthwise/depthwise",
                                    order) == "quant_expanded_conv/depthwise"
    # a layer's name inside a longer layer name is not that layer (MobileNetV3Small's last
    # convolution `Conv_1` and each block's `expanded_conv_10/squeeze_excite/Conv_1`: the
    # squeeze-excite tensor was compared with `Conv_1`'s output, -5.4 dB)
    order = {"expanded_conv_10/squeeze_excite/Conv_1": 1, "Conv_1": 2}
    assert file_tensors.layer_of_tensor("m/expanded_conv_10/squeeze_excite/Conv_1/BiasAdd",
                                    order) == "expanded_conv_10/squeeze_excite/Conv_1"
    assert file_tensors.layer_of_tensor("m/Conv_1/Conv2D", order) == "Conv_1"
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, use_bias=False, name="Conv")(inputs)
    h = keras.layers.BatchNormalization(name="Conv/BatchNorm")(h)
    h = keras.layers.ReLU(name="Conv/relu")(h)
    h = keras.layers.DepthwiseConv2D(3, use_bias=False, name="expanded_conv/depthwise")(h)
    h = keras.layers.BatchNormalization(name="expanded_conv/depthwise/BatchNorm")(h)
    h = keras.layers.ReLU(name="expanded_conv/depthwise/relu")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(
        keras.layers.Flatten(name="flatten")(h)))
    x = np.random.default_rng(0).uniform(0, 1, (64, 8, 8, 1)).astype(np.float32)
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    quantization.calibrate_ranges(q, [x])
    rows = fidelity.tflite_report(converted(q, tmp_path / "m"), q, x[:32])
    assert [r["layer"] for r in rows] == [q.layers[1].name, "quant_Conv/relu",
                                          "quant_expanded_conv/depthwise/relu", "quant_flatten",
                                          "quant_logits"]
    assert min(r["local_sqnr_db"] for r in rows) > 30, rows


def converted(model, path, widened: str | None = None, scale: float = 8.0) -> bytes:
    """The int8 TFLite file of a QAT `model`; with `widened`, of a copy whose range at the
    output of that layer is `scale` times as wide (a converter that got one range wrong:
    8x wider, or 1/8, narrower)."""
    if widened is not None:
        with tfmot.quantization.keras.quantize_scope():
            copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
        for variable in quantization.range_variables(copy.get_layer(widened)):
            variable.assign(variable * scale)
        model = copy
    return artifacts.convert_tflite(artifacts.save_saved_model(model, path), "int8",
                                    np.zeros((0,)), qat=True)


def test_every_layer_of_the_int8_file_is_compared_and_a_widened_range_is_named_worst(
        qat_cnn, tmp_path):
    q, x, _, _ = qat_cnn
    clean = fidelity.tflite_report(converted(q, tmp_path / "clean"), q, x[:64])
    assert [r["layer"] for r in clean] == [q.layers[1].name, "quant_relu_0", "quant_pool_0",
                                           "quant_relu_1", "quant_pool_1", "quant_flatten",
                                           "quant_dense_0", "quant_logits"]
    assert q.layers[1].name.startswith("quantize_layer")         # tfmot's input quantizer
    assert all(r["dtype"] == "int8" for r in clean)
    # the int8 file computes what QAT simulated: 8-bit rounding only, well above 30 dB
    assert min(r["sqnr_db"] for r in clean) > 30 and min(r["local_sqnr_db"] for r in clean) > 40
    # each layer's noise is its output's 8-bit rounding: within 6 dB of what its step gives
    assert all(r["local_sqnr_db"] >= r["rounding_sqnr_db"] - 6 for r in clean
               if r["local_sqnr_db"] < 99), clean
    assert sum("rounding_sqnr_db" in r for r in clean) == len(clean)
    bad = fidelity.tflite_report(converted(q, tmp_path / "bad", widened="quant_dense_0"), q,
                                 x[:64])
    by_layer = {r["layer"]: r for r in bad}
    assert fidelity.worst(bad)[0]["layer"] == "quant_dense_0"
    # 8x the step: about 18 dB more noise where the range is, and carried downstream
    clean_dense = next(r for r in clean if r["layer"] == "quant_dense_0")
    assert clean_dense["local_sqnr_db"] - by_layer["quant_dense_0"]["local_sqnr_db"] > 12
    assert by_layer["quant_logits"]["sqnr_db"] < by_layer["quant_dense_0"]["sqnr_db"] + 3
    assert by_layer["quant_logits"]["local_sqnr_db"] > 40          # the next layer adds little
    # the values fill a calibrated range; an 8x range about an eighth of it
    assert clean_dense["range_fill"] >= layer_noise.RANGE_FILL
    assert by_layer["quant_dense_0"]["range_fill"] < 0.2


def test_a_range_too_narrow_for_a_trained_layers_values_fails_the_layer(qat_cnn, tmp_path):
    """A range 1/8 of a trained layer's values clips them: the layer fails its check,
    named with the share it clips, however far its inputs already are from the model's."""
    q, x, _, _ = qat_cnn
    cfg = load_config(None, []).export
    floor = layer_noise.floor("int8", cfg)
    clean = fidelity.tflite_report(converted(q, tmp_path / "clean"), q, x[:64])
    assert not any(layer_noise.too_noisy(r, floor) for r in clean), clean
    assert all(r.get("saturated", 0.0) < layer_noise.SATURATED for r in clean), clean
    rows = fidelity.tflite_report(converted(q, tmp_path / "narrow", widened="quant_dense_0",
                                            scale=1 / 8), q, x[:64])
    narrow = next(r for r in rows if r["layer"] == "quant_dense_0")
    assert narrow["saturated"] >= layer_noise.SATURATED, narrow
    assert layer_noise.too_noisy(narrow, floor), narrow
    assert f"its 8-bit ranges clip {narrow['saturated']:.1%} of its values" in \
        layer_noise.why_noisy(narrow, floor)
    assert fidelity.worst(rows)[0]["layer"] == "quant_dense_0"


def test_an_int8_file_with_float_compute_says_so(qat_cnn, tmp_path):
    q, x, _, _ = qat_cnn
    assert file_tensors.float_ops(converted(q, tmp_path / "int8")) == []
    assert file_tensors.label([]) == "int8"
    # a layer with no int8 kernel in TFLite (layer norm: float between a dequantize and
    # the quantize of its output range) makes float ops in the file
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(
        keras.layers.Flatten(name="flatten")(h)))
    cfg = load_config(None, ["compression.quantization={enabled: true, skip_unsupported: true}"])
    mixed = quantization.quantize_model(net, cfg.compression.quantization, False)
    quantization.calibrate_ranges(mixed, [x[:32]])
    ops = file_tensors.float_ops(converted(mixed, tmp_path / "mixed"))
    assert ops and any("norm" in op for op in ops), ops
    assert file_tensors.label(ops) == f"int8 with {len(ops)} float op{'s' if len(ops) > 1 else ''}"


def test_a_channel_pruning_emptied_keeps_its_bias_in_the_int8_file(tmp_path):
    """A convolution channel whose every weight was pruned computes relu(bias). QAT gives
    it the range [0, 0]; TFLite then quantizes its bias at a scale of about 1e-11 and the
    int32 overflows: a wrong constant. `fit_empty_channels` gives it an ordinary range:
    the QAT model computes exactly the same and the int8 file matches it again."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, name="conv")(inputs)
    h = keras.layers.ReLU(name="relu")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(
        keras.layers.Flatten(name="flatten")(h)))
    conv = net.get_layer("conv")
    kernel = conv.kernel.numpy()
    kernel[..., [2, 5]] = 0                                     # two channels pruned away
    conv.kernel.assign(kernel)
    conv.bias.assign(np.linspace(0.1, 0.5, 8).astype(np.float32))
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=True)
    x = np.random.default_rng(0).uniform(0, 1, (64, 8, 8, 1)).astype(np.float32)
    quantization.calibrate_ranges(q, [x])
    q.compile(keras.optimizers.SGD(0.0), LOSS)         # one update sets the kernels' ranges
    q.fit(x, np.zeros(64), batch_size=64, epochs=1, verbose=0)
    local = {r["layer"]: r["local_sqnr_db"]
             for r in fidelity.tflite_report(converted(q, tmp_path / "before"), q, x)}
    assert local["quant_relu"] < 30                            # the empty channels' constant
    before = q.predict(x, verbose=0)
    assert quantization.fit_empty_channels(q) == 2
    np.testing.assert_array_equal(q.predict(x, verbose=0), before)
    local = {r["layer"]: r["local_sqnr_db"]
             for r in fidelity.tflite_report(converted(q, tmp_path / "after"), q, x)}
    assert local["quant_relu"] > 40


def test_layers_below_the_floor_are_one_warning_naming_the_noisiest(capsys):
    """Twelve noisy layers of a large model: one warning line, the noisiest first with
    its SQNR, three more named, and the count; every layer stays in the entry."""
    from tftrain.config import load_config
    cfg = load_config(None, []).export
    rows = [{"layer": f"conv_{i}", "op": "CONV_2D", "local_sqnr_db": 10.0 + i, "sqnr_db": 5.0}
            for i in range(12)] + [{"layer": "logits", "op": "FULLY_CONNECTED",
                                    "local_sqnr_db": 45.0, "sqnr_db": 30.0}]
    entry = fidelity.entries("tflite_int8", rows[::-1], cfg)
    printed = capsys.readouterr().out
    assert printed.count("tftrain: warning") == 1 and len(entry["layers"]) == 13
    text = " ".join(printed.split())           # the warning wrapped at 120 columns, joined
    assert text.startswith("tftrain: warning: tflite_int8: layer conv_0, adds noise 10.0 dB below "
                           "its values < export.min_layer_sqnr 20 (CONV_2D; its values are 5.0 dB "
                           "from the model's): its 8-bit range or kernel does not fit its values")
    assert text.endswith("; 9 more layers below it (conv_1, conv_2, conv_3, ...; summary.json lists "
                         "every layer)")


def test_a_layer_is_held_to_what_its_own_8_bit_steps_allow(qat_cnn, tmp_path):
    """Post-training int8 of a float CNN: each layer adds about the noise its inputs' and
    output's 8-bit steps allow (`allowed_sqnr_db`, within `LEEWAY_MEASURED_DB`). Held
    against a model whose second convolution's kernel is 5% larger (a kernel the file
    got wrong by 5%), that layer adds noise about 26 dB down, above
    `export.min_layer_sqnr`, yet far beyond what its steps allow: too noisy. The layers
    after it are judged on the file's own values, and pass."""
    from tftrain.models import MODELS
    _, x, _, source = qat_cnn
    keras.utils.set_random_seed(0)
    net = MODELS.get("cnn")(source.spec, filters=[8, 16], dense=[32])
    net.compile(keras.optimizers.Adam(0.003), LOSS)
    net.fit(source.calibration(source.num_train).batch(64), epochs=1, verbose=0)
    blob = artifacts.convert_tflite(artifacts.save_saved_model(net, tmp_path / "sm"), "int8",
                                    x[:128])
    floor = load_config(None, []).export.min_layer_sqnr
    clean = {r["layer"]: r for r in fidelity.tflite_report(blob, net, x[:64])}
    assert {"relu_0", "relu_1", "dense_0"} <= set(clean)
    for row in clean.values():
        assert row["local_sqnr_db"] >= row["allowed_sqnr_db"] - layer_noise.LEEWAY_MEASURED_DB, row
        assert not layer_noise.too_noisy(row, floor)
    off = keras.models.clone_model(net)
    off.set_weights(net.get_weights())
    kernel = off.get_layer("conv_1").kernel      # the file holds it fused into relu_1
    kernel.assign(kernel * 1.05)
    rows = {r["layer"]: r for r in fidelity.tflite_report(blob, off, x[:64])}
    conv = rows["relu_1"]
    assert floor < conv["local_sqnr_db"] < conv["allowed_sqnr_db"] - layer_noise.LEEWAY_DB, conv
    assert layer_noise.too_noisy(conv, floor)
    assert "beyond 10 dB of the" in layer_noise.why_noisy(conv, floor)
    assert [name for name, row in rows.items() if layer_noise.too_noisy(row, floor)] == ["relu_1"]


def test_a_float16_files_weights_are_never_taken_for_a_layers_output(tmp_path):
    """A float16 file DEQUANTIZEs its weights at run time, into tensors named after their
    layer; a 1x1 convolution from 16 to 96 channels on a 4x4 map has a kernel of as many
    values as its output map (96 x 16 = 4 x 4 x 96). Only tensors the input reaches are
    compared: every layer within float16 rounding (it was -16 dB, the kernel compared with
    MobileNetV2's expand batch norm)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 16))
    h = keras.layers.Conv2D(96, 1, use_bias=False, name="expand")(inputs)
    h = keras.layers.ReLU(6.0, name="expand_relu")(keras.layers.BatchNormalization(name="expand_BN")(h))
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(
        keras.layers.GlobalAveragePooling2D(name="pool")(h)))
    x = np.random.default_rng(0).normal(size=(16, 4, 4, 16)).astype(np.float32)
    blob = artifacts.convert_tflite(artifacts.save_saved_model(net, tmp_path / "sm"), "float16", None)
    rows = {r["layer"]: r for r in fidelity.tflite_report(blob, net, x)}
    assert "expand_relu" in rows and "expand_BN" not in rows, rows
    assert min(r["local_sqnr_db"] for r in rows.values()) >= layer_noise.FLOAT16_FLOOR_DB, rows


def _shared():
    """x -> shared -> (a, b) -> add -> logits: `shared` is read twice, `a` once."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    shared = keras.layers.Dense(8, activation="relu", name="shared")(inputs)
    a = keras.layers.Dense(8, name="a")(shared)
    b = keras.layers.Dense(8, name="b")(shared)
    added = keras.layers.Add(name="add")([a, b])
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(added))


def test_a_layer_with_weights_the_file_has_no_tensor_of_is_named_uncompared(tmp_path):
    """Every layer with a kernel is compared in a real int8 file, the model's output
    layer too (the converter names the output after the signature). Without `shared`'s
    tensor (read by two layers, so never fused away) it is uncompared; without `a`'s
    (read by `add` alone) `add`'s row holds it, as a fused op's does."""
    net = _shared()
    x = np.random.default_rng(0).normal(size=(32, 6)).astype(np.float32)
    source = artifacts.write_saved_model(net, tmp_path / "m")
    blob = artifacts.convert_tflite(source, "int8", x)
    rows, missing = fidelity.tflite_compared(blob, net, x)
    assert missing == [] and rows[-1]["layer"] == "logits" and rows[-1]["op"] == "FULLY_CONNECTED"
    names = [layer.name for layer in net.layers]
    artifact = file_tensors.tflite_tensors(blob, names, x, ("logits",))
    assert fidelity.uncompared(net, artifact, fidelity.compare(net, artifact, x)) == []
    for dropped, expected in (("shared", ["shared"]), ("a", []), ("logits", ["logits"])):
        partial = {k: v for k, v in artifact.items() if k != dropped}
        assert fidelity.uncompared(net, partial, fidelity.compare(net, partial, x)) == expected
    # what the comparison found missing is what the entry reports; nothing, no key
    partial = {k: v for k, v in artifact.items() if k != "shared"}
    found = fidelity.uncompared(net, partial, fidelity.compare(net, partial, x))
    cfg = load_config(None, []).export
    assert fidelity.entries("tflite_int8", rows, cfg, missing=found)["uncompared"] == ["shared"]
    assert "uncompared" not in fidelity.entries("tflite_int8", rows, cfg, missing=[])


def test_a_layer_read_by_one_layer_in_two_models_is_held_by_that_readers_row(tmp_path):
    """`a` (read by `add` alone) stays held by `add`'s row after a second model is built
    on the same layers (each call adds a node: `add` reads `a` twice in node count, once
    in fact); the pruned speech model of a matrix row named its convolutions uncompared."""
    net = _shared()
    x = np.random.default_rng(0).normal(size=(32, 6)).astype(np.float32)
    source = artifacts.write_saved_model(net, tmp_path / "m")
    blob = artifacts.convert_tflite(source, "int8", x)
    names = [layer.name for layer in net.layers]
    artifact = file_tensors.tflite_tensors(blob, names, x, ("logits",))
    partial = {k: v for k, v in artifact.items() if k != "a"}
    again = keras.Input((6,))
    rebuilt = net.get_layer("add")([net.get_layer("a")(net.get_layer("shared")(again)),
                                    net.get_layer("b")(net.get_layer("shared")(again))])
    keras.Model(again, rebuilt)
    assert fidelity.uncompared(net, partial, fidelity.compare(net, partial, x)) == []


def test_layers_whose_weights_are_in_sublayers_are_named_uncompared_too():
    """Attention (its kernels are its projections') and a nested model (its layers') are
    named when nothing of them is compared; with everything compared, nothing is."""
    from tftrain.core.keras import keras
    inputs = keras.Input((4, 8))
    inner = keras.Sequential([keras.Input((4, 8)), keras.layers.Dense(8)], name="nested")
    x = keras.layers.MultiHeadAttention(2, 4, name="attention")(inputs, inputs)
    x = keras.layers.LayerNormalization(name="norm")(inner(x))
    net = keras.Model(inputs, keras.layers.Dense(3, name="logits")(keras.layers.Flatten()(x)))
    assert fidelity.uncompared(net, {}, []) == ["attention", "nested", "logits"]
    every = [{"layer": name} for name in ("attention", "nested", "logits")]
    assert fidelity.uncompared(net, {}, every) == []
