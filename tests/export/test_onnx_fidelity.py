"""An int8 ONNX model's tensors read back by Keras layer, in NHWC order (the comparison
with the TFLite file's is in test_fidelity.py, beside its helpers)."""
from tftrain.export import onnx_fidelity


def test_axis_orders_follow_transposes_convolutions_and_elementwise_ops():
    from onnx import helper
    nodes = [helper.make_node("Transpose", ["inputs"], ["t"], perm=[0, 3, 1, 2]),
             helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("Transpose", ["r"], ["back"], perm=[0, 2, 3, 1]),
             helper.make_node("QuantizeLinear", ["back", "s", "z"], ["q"]),
             helper.make_node("Conv", ["q", "w"], ["c"]),
             helper.make_node("Add", ["c", "q"], ["a"]),
             helper.make_node("Reshape", ["a", "shape"], ["flat"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("inputs", 1, None)], [])
    orders = onnx_fidelity.axis_orders(graph)
    assert orders == {"inputs": "NHWC", "t": "NCHW", "r": "NCHW", "back": "NHWC",
                      "q": "NHWC", "c": "NCHW", "a": "NCHW"}        # a Reshape's: none
