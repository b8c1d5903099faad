"""An int8 ONNX model compared with its Keras model layer by layer (`fidelity.compare`):
each QuantizeLinear's output read back as NHWC maps, its layer found from its name as
in a TFLite file (`file_tensors.layer_of_tensor`)."""
from __future__ import annotations

import numpy as np

from tftrain.core import internals
from tftrain.export import onnx_export
from tftrain.export.fidelity import EXAMPLES, compare, entries, uncompared
from tftrain.export.file_tensors import computed_in, grid, label, layer_of_tensor, layers_of_tensor


# ONNX ops whose 4-D output is NCHW whatever order their input had
_CHANNELS_FIRST = ("Conv", "QLinearConv", "ConvInteger", "ConvTranspose", "MaxPool",
                   "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
                   "BatchNormalization", "InstanceNormalization", "LRN", "DepthToSpace",
                   "SpaceToDepth", "QLinearAveragePool", "QLinearGlobalAveragePool")
# ops whose output has the axis order of their (first ordered) input
_KEEPS_ORDER = ("QuantizeLinear", "DequantizeLinear", "Relu", "Clip", "LeakyRelu", "Sigmoid",
                "Tanh", "HardSigmoid", "HardSwish", "Elu", "Erf", "Add", "Sub", "Mul", "Div",
                "Max", "Min", "Pow", "Sqrt", "Neg", "Abs", "Exp", "Identity", "Cast", "Pad",
                "Slice", "Concat", "Split", "QLinearAdd", "QLinearMul", "Where")


def axis_orders(graph, input_order: str = "NHWC") -> dict[str, str]:
    """The axis order of each 4-D tensor of an ONNX graph converted from a TFLite
    (NHWC) model: tf2onnx turns maps to NCHW for convolutions with Transposes, which its
    optimizer then moves across elementwise ops, so a tensor's order is followed from the
    input through each node (a Transpose permutes it, a convolution or pool makes NCHW,
    an elementwise op keeps its input's). Tensors it cannot follow (a Reshape's) have
    none."""
    orders = {i.name: input_order for i in graph.input}
    for node in graph.node:
        known = [orders[i] for i in node.input if i in orders]
        if node.op_type == "Transpose" and known:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if perm is not None and len(perm) == 4:
                orders[node.output[0]] = "".join(known[0][i] for i in perm)
        elif node.op_type in _CHANNELS_FIRST:
            orders[node.output[0]] = "NCHW"
        elif node.op_type in _KEEPS_ORDER and known:
            for out in node.output:
                orders[out] = known[0]
    return orders


def onnx_tensors(blob: bytes, layer_names: list[str], x: np.ndarray, batch: int = 64,
                 outputs: tuple[str, ...] = ()) -> dict:
    """By Keras layer: the dequantized value of the last QuantizeLinear output an int8
    ONNX model (converted from the TFLite file, tensor names kept) computes for it, run by
    ONNX Runtime with its int8 kernels on `x`; maps in Keras' NHWC (`axis_orders`: ONNX
    holds convolutions' as NCHW, which the shape cannot tell where C == H == W). As for
    TFLite (`file_tensors.tflite_tensors`), `covers` names the layers the tensor computes and
    `outputs` (the layers giving the model's outputs) match the model's outputs."""
    import onnx
    from onnx import helper, numpy_helper


    model = onnx.load_from_string(blob)
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            constants[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    order = {name: i for i, name in enumerate(layer_names)}
    chosen = {}                       # layer -> (tensor, scale, zero point)
    writers = {out: node for node in model.graph.node for out in node.output}

    def quantized(node) -> bool:
        return node is not None and node.op_type == "QuantizeLinear" and \
            node.input[1] in constants and node.input[2] in constants
    for node in model.graph.node:
        layer = layer_of_tensor(node.output[0], order) if quantized(node) else None
        if layer is not None:
            for fused in computed_in(node.output[0], order) - {layer}:
                chosen.pop(fused, None)          # (as in `file_tensors.tflite_tensors`)
            chosen[layer] = (node.output[0], constants[node.input[1]], constants[node.input[2]])
    for layer, graph_output in zip(outputs, model.graph.output):
        last = writers.get(graph_output.name)     # a model's output: DequantizeLinear(q)
        if layer not in chosen and last is not None and last.op_type == "DequantizeLinear" \
                and quantized(writers.get(last.input[0])):
            node = writers[last.input[0]]
            chosen[layer] = (node.output[0], constants[node.input[1]], constants[node.input[2]])
    present = {o.name for o in model.graph.output}
    for tensor, _, zero in chosen.values():
        if tensor not in present:
            model.graph.output.append(helper.make_tensor_value_info(
                tensor, helper.np_dtype_to_tensor_dtype(zero.dtype), None))
    orders = axis_orders(model.graph)
    sess = onnx_export.session(model.SerializeToString(), int8=True)
    names = [tensor for tensor, _, _ in chosen.values()]
    runs = [sess.run(names, {"inputs": x[i:i + batch]}) for i in range(0, len(x), batch)]
    out = {}
    for k, (layer, (tensor, scale, zero)) in enumerate(chosen.items()):
        value = (np.concatenate([r[k] for r in runs]).astype(np.float32) - zero) * scale
        if value.ndim == 4 and orders.get(tensor, "NHWC") != "NHWC":
            value = value.transpose([orders[tensor].index(axis) for axis in "NHWC"])
        out[layer] = {"value": value, "op": "QuantizeLinear",
                      "covers": layers_of_tensor(tensor, order) | {layer},
                      **grid(zero.dtype, scale, zero)}
    return out


def report(blob: bytes, model, x: np.ndarray) -> list[dict]:
    """`fidelity.compare` for an int8 ONNX model converted from `model`'s int8 TFLite file."""
    return compared(blob, model, x)[0]


def compared(blob: bytes, model, x: np.ndarray) -> tuple[list[dict], list[str]]:
    """(`report`'s rows, the layers it could not compare: `fidelity.uncompared`)."""
    names = [layer.name for layer in model.layers]
    outputs = tuple(internals.history(t)[0].name for t in model.outputs)
    artifact = onnx_tensors(blob, names, x, outputs=outputs)
    rows = compare(model, artifact, x)
    return rows, uncompared(model, artifact, rows)


def entry(blob: bytes, floating: list[str], plain, calibration: np.ndarray, cfg) -> dict:
    """The int8 ONNX model's `label` (its float ops as ONNX Runtime runs it) and layers."""
    rows, missing = compared(blob, plain, calibration[:EXAMPLES])
    return {"label": label(floating), "float_ops": floating,
            **entries("onnx_int8", rows, cfg, missing=missing)}
