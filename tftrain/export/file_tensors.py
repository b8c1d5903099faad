"""What a converted file holds, by Keras layer: the tensors a TFLite file computes, read
with every intermediate kept (`tflite_tensors`), each the output of the last layer its
name mentions (`layer_of_tensor`; a fused op's output names every op fused into it, e.g.
`model/quant_relu_0/Relu;model/quant_conv_0/BiasAdd`), the values an 8-bit tensor can
hold (`grid`), and the ops a file computes in float (`float_ops`, `label`).
`export.fidelity` compares them with the model."""
from __future__ import annotations

import numpy as np

from tftrain.core import internals


def layer_of_tensor(name: str, order: dict[str, int]) -> str | None:
    """The Keras layer a TFLite tensor is the output of: of the layers its name mentions
    (each `;`-separated op name is a `/`-separated path, and a layer's name may hold `/`
    itself: Keras Applications' `Conv/BatchNorm`, `expanded_conv/depthwise`), the last in
    model order. A path inside a longer one that names a layer is not a name of its own:
    `expanded_conv_10/squeeze_excite/Conv_1/BiasAdd` is that block's squeeze-excite
    convolution, not MobileNetV3's last convolution `Conv_1`."""
    found = layers_of_tensor(name, order)
    return max(found, key=order.get) if found else None


def layers_of_tensor(name: str, order: dict[str, int]) -> set[str]:
    """Every layer a tensor's name mentions (`layer_of_tensor`): what an op the converter
    fused computes (a convolution, its batch norm and its ReLU)."""
    found = set()
    for op in name.split(";"):
        parts = op.split("/")
        spans = [(i, j) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)
                 if "/".join(parts[i:j]) in order]
        found.update("/".join(parts[i:j]) for i, j in spans
                     if not any(a <= i and j <= b and (a, b) != (i, j) for a, b in spans))
    return found


def computed_in(name: str, order: dict[str, int]) -> set[str]:
    """The layers whose computation a tensor's name mentions: not the ones only its
    quantization does (a RESHAPE after a ReLU carries the ReLU's fake-quant in its name)."""
    return {layer for op in name.split(";") if "Quantize" not in op and "FakeQuant" not in op
            for layer in layers_of_tensor(op, order)}


def tflite_tensors(blob: bytes, layer_names: list[str], x: np.ndarray,
                   outputs: tuple[str, ...] = ()) -> dict[str, dict]:
    """By Keras layer: the dequantized value of the last tensor the TFLite model computes
    for it on each example of `x` (stacked), its dtype, the op that wrote it, and the
    layers its name mentions (`covers`: what the op computes, fused). `outputs`: the
    layers giving the model's outputs, matched to the file's outputs where no tensor
    names them (the converter names a model's output after its signature)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interp = Interpreter(model_content=blob, experimental_preserve_all_tensors=True,
                         experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    inp = interp.get_input_details()[0]
    interp.resize_tensor_input(inp["index"], [1, *x.shape[1:]])
    interp.allocate_tensors()
    order = {name: i for i, name in enumerate(layer_names)}
    chosen: dict[str, tuple[int, str]] = {}        # layer -> (tensor index, op name)
    every: dict[str, list[int]] = {}               # layer -> all its 8-bit tensors
    computed = {inp["index"]}      # tensors the input reaches: not a weight DEQUANTIZEd
    writers: dict[int, dict] = {}                  # tensor -> the op that wrote it
    for op in internals.ops_details(interp):          # in execution order: the last one wins
        if not computed & {int(i) for i in op["inputs"]}:
            continue              # a float16 file's weights (a kernel can match a map's size)
        computed.update(int(i) for i in op["outputs"])
        for index in op["outputs"]:
            writers[int(index)] = op
            detail = internals.tensor_details(interp, index)
            layer = layer_of_tensor(detail["name"], order)
            for fused in computed_in(detail["name"], order) - {layer}:
                # an earlier layer's last step is inside this op (a batch norm's ADD with
                # the ReLU after it): what was chosen for it was a step inside the layer
                chosen.pop(fused, None)
            if layer is not None:
                chosen[layer] = (index, op["op_name"])
                if detail["dtype"] in (np.int8, np.uint8):
                    every.setdefault(layer, []).append(index)
    for layer, out_detail in zip(outputs, interp.get_output_details()):
        index, op = int(out_detail["index"]), writers.get(int(out_detail["index"]))
        if layer in chosen or op is None:
            continue
        if op["op_name"] == "DEQUANTIZE":          # an int8 file's: its int8 values before
            index, op = int(op["inputs"][0]), writers.get(int(op["inputs"][0]), op)
        chosen[layer] = (index, op["op_name"])
    values: dict[str, list] = {layer: [] for layer in chosen}
    ends = {layer: [0, 0] for layer in every}     # codes clipped, codes read
    clipping = {index: _clipping_codes(internals.tensor_details(interp, index))
                for indices in every.values() for index in indices}
    for row in x:
        set_example(interp, inp, row)
        interp.invoke()
        for layer, (index, _) in chosen.items():
            values[layer].append(_dequantized(interp, index))
        for layer, indices in every.items():
            for index in indices:
                codes = interp.get_tensor(index)
                ends[layer][0] += int(np.sum(np.isin(codes, clipping[index])))
                ends[layer][1] += codes.size
    out = {}
    for layer, (index, op) in chosen.items():
        detail = internals.tensor_details(interp, index)
        params = detail["quantization_parameters"]
        out[layer] = {"value": np.concatenate(values[layer]), "op": op,
                      "covers": layers_of_tensor(detail["name"], order) | {layer},
                      **grid(detail["dtype"], params["scales"], params["zero_points"])}
        if layer in ends:       # the share of its 8-bit values clipped at a range's end
            out[layer]["saturated"] = ends[layer][0] / max(1, ends[layer][1])
            out[layer]["tensors"] = len(every[layer])
    return out


def grid(dtype, scales, zeros) -> dict:
    """A tensor's `dtype` and, when it is 8-bit with one scale, the values it can hold:
    `step` apart, from `low` to `high`."""
    dtype = np.dtype(dtype)
    found = {"dtype": dtype.name}
    if dtype in (np.int8, np.uint8) and np.size(scales) == 1:
        step, zero, info = float(np.ravel(scales)[0]), int(np.ravel(zeros)[0]), np.iinfo(dtype)
        found.update(step=step, low=(info.min - zero) * step, high=(info.max - zero) * step)
    return found


# values an activation's range ends at by design (ReLU's 0, ReLU6's 6, a gate's 1): a
# code there is a value, not one clipped
BOUNDS = (0.0, 1.0, 6.0)


def bounded(found: dict) -> bool:
    """Whether a tensor's range is an activation's own ([0, 1], [0, 6]: a gate, a ReLU6),
    not one calibrated on values."""
    near = lambda value, bound: abs(value - bound) <= found["step"]    # noqa: E731
    return near(found["low"], 0.0) and (near(found["high"], 1.0) or near(found["high"], 6.0))


def _clipping_codes(detail: dict) -> list[int]:
    """The codes of an 8-bit tensor at which a value was clipped: its range's ends, but
    for an end an activation reaches by design (`BOUNDS`)."""
    info = np.iinfo(detail["dtype"])
    scale, zero = detail["quantization"]
    return [code for code in (info.min, info.max)
            if not any(abs((code - zero) * scale - bound) <= scale / 2 for bound in BOUNDS)]


def set_example(interp, inp: dict, row: np.ndarray, batch: bool = False) -> None:
    """Give a LiteRT interpreter's input `inp` one example (`batch`: a batch of them),
    quantized if it is int8."""
    scale, zero = inp["quantization"]
    value = row if batch else row[None]
    if scale:
        value = np.round(value / scale + zero)
    interp.set_tensor(inp["index"], value.astype(inp["dtype"]))


def _dequantized(interp, index: int) -> np.ndarray:
    detail = internals.tensor_details(interp, index)
    value = interp.get_tensor(index).astype(np.float32)
    params = detail["quantization_parameters"]
    if detail["dtype"] in (np.int8, np.uint8, np.int16) and len(params["scales"]):
        value = (value - params["zero_points"][0]) * params["scales"][0]
    return value


# ops that only convert between float and int8 at the model's edges
_CONVERSIONS = {"QUANTIZE", "DEQUANTIZE"}


# ops that move or reshape values and compute nothing (an embedding's GATHER computes)
_LAYOUT = {"RESHAPE", "SQUEEZE", "EXPAND_DIMS", "TRANSPOSE", "CONCATENATION", "PACK",
           "UNPACK", "SLICE", "STRIDED_SLICE", "SHAPE", "PAD", "SPLIT"}


def float_ops(blob: bytes) -> list[str]:
    """The compute ops of a TFLite model that take or give float values (each as
    `OP (layer)`), quantize/dequantize at the edges and constant folding aside: what is
    not int8 in an "int8" file."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=blob)
    found = []
    for op in internals.ops_details(interp):
        if op["op_name"] in _CONVERSIONS | _LAYOUT or op["op_name"] == "DELEGATE":
            continue
        tensors = [internals.tensor_details(interp, i) for i in (*op["inputs"], *op["outputs"])
                   if i >= 0]
        if any(t["dtype"] in (np.float32, np.float16) for t in tensors):
            out = internals.tensor_details(interp, op["outputs"][0])["name"].split(";")[0]
            found.append(f"{op['op_name']} ({out})")
    return found


def label(float_ops_found: list[str]) -> str:
    """What an int8 artifact is: `int8` only when every compute op is."""
    n = len(float_ops_found)
    return "int8" if not n else f"int8 with {n} float op{'s' if n > 1 else ''}"
