"""Int8 fallback: a layer the converter got wrong is named, then falls back alone."""
import numpy as np
import pytest

from tftrain.config import load_config
from tftrain.export import artifacts, exports, fallback
from tftrain.export.context import ExportFlags


def corrupting(layer: str, factor: float = 8.0):
    """A `convert_tflite` whose int8 file has the kernel scales of `layer` times `factor`
    (`fallback.with_kernel_scales`)."""
    convert = artifacts.convert_tflite
    return lambda *args, **kwargs: fallback.with_kernel_scales(convert(*args, **kwargs),
                                                                layer, factor)


def export(q, source, out, fallback_setting):
    cfg = load_config(None, ["compression.quantization.enabled=true", "export.saved_model=false",
                             *([f"export.int8_fallback={fallback_setting}"]
                               if fallback_setting is not None else [])])
    return exports.export_all(q, cfg, out, source, ExportFlags(qat=True))


@pytest.mark.slow
def test_a_layer_the_converter_got_wrong_is_named_worst_and_falls_back_alone(
        qat_cnn, tmp_path, monkeypatch):
    """quant_dense_0's kernel scales x8 in the int8 file: off, the file fails its check
    with that layer named as the worst; auto, that layer alone falls back to a float
    kernel, the file is within export.max_accuracy_drop, and the report says what it
    cost."""
    q, x, y, source = qat_cnn
    reference = float(np.mean(np.argmax(q.predict(x, verbose=0), -1) == y))
    monkeypatch.setattr(artifacts, "convert_tflite", corrupting("quant_dense_0"))
    off = export(q, source, tmp_path / "off", "off")["tflite_int8"]
    assert off["worst_layers"][0] == "quant_dense_0"
    assert reference - off["accuracy"] > 0.01 and not off["verified"]
    assert "fallback" not in off
    auto = export(q, source, tmp_path / "auto", "auto")["tflite_int8"]
    record = auto["fallback"]
    assert record["layers"] == ["quant_dense_0"] and record["within_budget"]
    assert record["tried"][0]["named_as"] == "quant_dense_0"
    assert record["accuracy_before"] == pytest.approx(off["accuracy"])
    assert auto["verified"] and reference - auto["accuracy"] <= 0.01
    assert auto["label"].startswith("int8 with") and all("dense_0" in op
                                                          for op in auto["float_ops"])
    assert auto["size_bytes"] > record["size_bytes_before"]        # a float kernel is larger
    assert (tmp_path / "auto" / "model.tflite").read_bytes() != \
        (tmp_path / "off" / "model.tflite").read_bytes()
    # unset, a QAT run's int8 file falls back as with auto
    unset = export(q, source, tmp_path / "unset", None)["tflite_int8"]
    assert unset["fallback"]["layers"] == ["quant_dense_0"] and unset["verified"]


def test_a_relu_reported_layer_falls_back_through_its_convolution(qat_cnn):
    """TFLite fuses a convolution into the ReLU after it, so the report names the ReLU;
    the kernel to fall back is the convolution's."""
    q = qat_cnn[0]
    assert fallback.weighted_layer(q, "quant_relu_0").name == "quant_conv_0"
    assert fallback.weighted_layer(q, "quant_dense_0").name == "quant_dense_0"
    assert fallback.weighted_layer(q, q.layers[1].name) is None     # the input quantizer


def test_one_conversion_serves_every_try_with_the_file_that_try_would_convert(
        qat_cnn, tmp_path):
    """The fallback converts once, with every candidate's kernel float, and splices each
    try's layers from that file: byte for byte the file each try converted on its own
    gave (one conversion instead of one a try)."""
    from tftrain.compress import quantization
    q = qat_cnn[0]
    artifacts.write_saved_model(q, tmp_path / "qat")
    int8 = artifacts.convert_tflite(tmp_path / "qat", "int8", None, qat=True)
    calls = []

    def convert(wrappers):
        calls.append([w.name for w in wrappers])
        return artifacts.converted_within(quantization.kernels_unquantized(wrappers), q,
                                          tmp_path / "strict", "int8", None, qat=True,
                                          strict=True)

    rows = [{"layer": name, "local_sqnr_db": db} for name, db in
            [("quant_relu_1", 20.0), ("quant_logits", 30.0), ("quant_relu_0", 25.0)]]
    order = [w.name for w, _ in fallback.candidates(q, rows, 3)]
    assert order == ["quant_conv_1", "quant_conv_0", "quant_logits"]   # worst first, kernels
    wrappers = [q.get_layer(name) for name in order]
    splice = fallback.splicer(int8, wrappers, convert)
    assert calls == [order]
    for count in (1, 2, 3):
        alone = fallback.spliced(int8, convert(wrappers[:count]))
        assert splice(wrappers[:count]) == alone[0] and len(alone[1]) == count
    assert fallback.owner("cnn/quant_relu_0/Relu;cnn/quant_conv_0/Conv2D1", wrappers) \
        is wrappers[1]
    assert fallback.owner("cnn/quant_dense_0/MatMul", wrappers) is None
