"""ONNX export: float model within 1e-4 of the SavedModel, int8 QDQ model equal to the
int8 TFLite model and run with ONNX Runtime's int8 kernels, the activation rewrite and
the uint8 layouts exact."""

import numpy as np
import onnx
import pytest
import tensorflow as tf
from onnx import TensorProto, helper

from tftrain.export import onnx_export
from tftrain.config import load_config
from tftrain.data import load_source
from tftrain.export.exports import export_all
from tftrain.models import MODELS
from tftrain.training.train_step import TrainModel


@pytest.fixture(scope="module")
def cnn():
    tf.keras.utils.set_random_seed(0)
    source = load_source(load_config().data, 0)
    model = TrainModel.wrap(MODELS.get("cnn")(source.spec, filters=[8, 16], dense=[32]))
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(source.calibration(source.num_train).batch(32), epochs=10, verbose=0)
    return model, source


def test_float_onnx_gives_the_saved_model_logits(tmp_path, cnn):
    model, source = cnn
    cfg = load_config(None, ["export.onnx=true", "export.tflite=none"])
    report = export_all(model, cfg, tmp_path, source)
    entry = report["onnx"]
    assert entry["max_abs_diff_vs_saved_model"] < 1e-4 and entry["max_abs_logit_diff"] < 1e-4
    assert entry["accuracy"] == report["saved_model"]["accuracy"] and entry["verified"]
    assert "onnx_int8" not in report              # no int8 TFLite model, no int8 ONNX
    proto = onnx.load(str(tmp_path / "model.onnx"))
    assert [i.name for i in proto.graph.input] == ["inputs"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert (tmp_path / "model.onnx").stat().st_size == entry["size_bytes"]
    x = np.random.default_rng(0).random((5, 8, 8, 1), np.float32)
    sess = onnx_export.session((tmp_path / "model.onnx").read_bytes())
    np.testing.assert_allclose(onnx_export.logits(sess, x), model.predict(x, verbose=0), atol=1e-4)


def test_int8_onnx_equals_the_int8_tflite_model_and_runs_int8_kernels(tmp_path, cnn):
    model, source = cnn
    cfg = load_config(None, ["export.onnx=true", "export.tflite=int8"])
    report = export_all(model, cfg, tmp_path, source)
    entry, lite = report["onnx_int8"], report["tflite_int8"]
    assert entry["max_abs_diff_vs_tflite_int8"] <= 1e-5
    assert report["onnx"]["accuracy"] > 0.9                 # a trained model, not noise
    assert entry["accuracy"] == lite["accuracy"] and entry["verified"] and lite["verified"]
    # both convolutions and both dense layers (MatMul + bias) run as int8 kernels
    assert entry["int8_kernels"] == {"QLinearConv": 2, "QGemm": 2}
    assert report["onnx"]["max_abs_diff_vs_saved_model"] < 1e-4       # and the float one
    kinds = {n.op_type for n in onnx.load(str(tmp_path / "model_int8.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= kinds
    assert entry["layout"] == onnx_export.int8_format()
    assert entry["float_ops"] == []                       # no float island between them


def test_int8_layouts_hold_the_same_values_and_auto_picks_by_the_cpu(tmp_path, cnn):
    """S8S8 (the TFLite file's codes), U8S8 and U8U8 compute the TFLite file's logits
    exactly as ONNX defines them (graph optimizations off); with ONNX Runtime's fused
    int8 kernels S8S8 and U8U8 stay exact, while U8S8's kernels saturate on CPUs without
    VNNI, so `auto` picks it only with VNNI. Activations are uint8 in both U layouts,
    weights int8 in U8S8 and uint8 (zero points 128) in U8U8."""
    import onnxruntime as ort
    from onnx import numpy_helper

    from tftrain.export.artifacts import convert_tflite, save_saved_model, tflite_logits
    model, source = cnn
    x = np.concatenate([b for b, _ in source.calibration(64).batch(64).as_numpy_iterator()])
    blob = convert_tflite(save_saved_model(model, tmp_path / "sm"), "int8", x)
    reference = tflite_logits(blob, x)[0]
    for layout in ("S8S8", "U8S8", "U8U8"):
        proto = onnx.load_from_string(onnx_export.int8_onnx(blob, layout))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        plain = ort.InferenceSession(proto.SerializeToString(), options,
                                     providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(onnx_export.logits(plain, x), reference, rtol=0, atol=1e-5)
        fused = onnx_export.session(proto.SerializeToString(), int8=True)
        if layout != "U8S8" or onnx_export.int8_format() == "U8S8":
            np.testing.assert_allclose(onnx_export.logits(fused, x), reference, rtol=0, atol=1e-5)
        inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        # every initializer read: ONNX Runtime warns about each unused one per session
        assert set(inits) <= {name for n in proto.graph.node for name in n.input}, layout
        activations = {inits[n.input[2]].dtype for n in proto.graph.node
                       if n.op_type == "QuantizeLinear"}
        weights = {inits[n.input[0]].dtype for n in proto.graph.node
                   if n.op_type == "DequantizeLinear" and n.input[0] in inits
                   and inits[n.input[0]].ndim == 4}                     # the conv kernels
        assert activations == {np.dtype(np.int8 if layout == "S8S8" else np.uint8)}, layout
        assert weights == {np.dtype(np.uint8 if layout == "U8U8" else np.int8)}, layout
        assert onnx_export.int8_kernels(onnx_export.optimized_graph(proto.SerializeToString())) \
            == {"QLinearConv": 2, "QGemm": 2}
    assert onnx_export.int8_format("flags : fpu avx2 avx512_vnni") == "U8S8"
    assert onnx_export.int8_format("flags : fpu avx2 fma") == "U8U8"


def _relu_then_quantize(rewrite: bool) -> bytes:
    """x -> Relu -> Q -> DQ, int8 with zero point -3 (Relu not absorbed by the range)."""
    nodes = [helper.make_node("Relu", ["inputs"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["logits"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("inputs", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
         helper.make_tensor("z", TensorProto.INT8, [], [-3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if rewrite:
        assert onnx_export._quantize_before_activations(proto.graph) == 1
        assert [n.op_type for n in proto.graph.node] == [
            "QuantizeLinear", "DequantizeLinear", "Relu", "QuantizeLinear", "DequantizeLinear"]
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def test_unused_initializers_are_dropped_and_subgraph_reads_kept():
    inner = helper.make_graph([helper.make_node("Identity", ["k"], ["o"])], "body", [],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])])
    nodes = [helper.make_node("Relu", ["inputs"], ["logits"]),
             helper.make_node("If", ["c"], ["unused_out"], then_branch=inner, else_branch=inner)]
    tensors = [helper.make_tensor(n, TensorProto.FLOAT, [1], [1.0]) for n in ("k", "z", "w")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("inputs", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1])],
        tensors + [helper.make_tensor("c", TensorProto.BOOL, [], [True])])
    assert onnx_export.drop_unused(graph) == 2
    assert sorted(i.name for i in graph.initializer) == ["c", "k"]


def test_quantizing_before_an_activation_changes_no_value():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(0, 3, (2000, 4)),        # beyond the range both ways
                        np.arange(-40, 40).reshape(-1, 4) * 0.025]).astype(np.float32)  # ties
    before, after = (onnx_export.logits(onnx_export.session(_relu_then_quantize(r)), x)
                     for r in (False, True))
    np.testing.assert_array_equal(before, after)
    assert before.min() == 0.0 and before.max() == pytest.approx(0.05 * 130)


def test_a_mixed_precision_model_exports_a_float32_onnx_model():
    from tftrain.runtime import precision
    from tftrain.export.artifacts import inference_model
    precision.apply_policy("mixed_bfloat16")
    source = load_source(load_config().data, 0)
    model = precision.float32_outputs(MODELS.get("cnn")(source.spec, filters=[4], dense=[8]))
    plain = inference_model(model)                 # float32 copies (tensorflow#45441)
    proto = onnx.load_from_string(onnx_export.float_onnx(plain))
    assert proto.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert proto.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert not {"Cast"} & {n.op_type for n in proto.graph.node}    # no bfloat16 inside
    x = np.random.default_rng(2).random((4, 8, 8, 1), np.float32)
    sess = onnx_export.session(proto.SerializeToString())
    np.testing.assert_allclose(onnx_export.logits(sess, x), plain.predict(x, verbose=0), atol=1e-5)
