"""Int8 fallback within a budget: float kernels for the layers an int8 file gets wrong.

When the int8 TFLite file of a quantization-aware trained model is further than
`export.max_accuracy_drop` from the model (a converter that quantized one layer unlike
QAT, tfmot #368), `export.int8_fallback: auto` converts it again with the kernels of its
noisiest layer float (the layer the fidelity report names by the noise it adds, not the
ones downstream that carry it), then the next, until the file is within budget or
`export.int8_fallback_layers` layers were tried (one conversion, with every
candidate's kernel float, serves every try: `splicer`). A fallen-back layer runs in float
between a dequantize and the quantize of its output range, which QAT learned, so the
layers around it stay int8. The converter cannot write that file itself: a kernel
without fake-quant it quantizes on its own (post-training) when the tensors around it
are quantized, and in strict QDQ mode, which keeps such an op float, it writes uint8
per-channel kernels everywhere else, which no runtime runs. So the layer's float op (its
float kernel, batch norm folded as the converter folds it) is taken from a strict-QDQ
conversion with that kernel's fake-quant left out, and spliced into the int8 file in
place of its int8 op (`spliced`). TFLite's int16x8 mode is a
whole-model mode in the converter (no per-layer choice for a QAT model), so the fallback
is float. The report lists the layers, and what the fallback cost in size and latency.
"""
from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tftrain.core import console
from tftrain.core import internals
from tftrain.export.fidelity import worst

fb = internals.tflite_schema()       # the TFLite flatbuffer schema (object API)


def weighted_layer(model, name: str):
    """The QAT wrapper holding the kernel behind the layer `name` reports: that layer,
    or for a layer without a kernel (a ReLU or batch norm TFLite fused into the
    convolution before it), the nearest single producer that has one; None if none."""
    layer = model.get_layer(name)
    for _ in range(3):
        if internals.qat_weights(layer):
            return layer
        # distinct producers (a layer shared with another model has a node there too)
        parents = {id(p): p for node in layer.inbound_nodes
                   for p in tf.nest.flatten(node.inbound_layers)}
        if len(parents) != 1:
            return None
        layer, = parents.values()
    return None


def candidates(model, rows: list[dict], most: int) -> list[tuple]:
    """The layers a fallback tries, in order: the QAT wrapper holding the kernel behind
    each layer the fidelity report `rows` names, worst first, each once, at most `most`;
    (wrapper, its row) pairs."""
    picked: list[tuple] = []
    for row in worst(rows, len(rows)):
        wrapper = weighted_layer(model, row["layer"])
        if len(picked) < most and wrapper is not None and \
                all(wrapper is not w for w, _ in picked):
            picked.append((wrapper, row))
    return picked


def owner(op_name: str, wrappers: list):
    """The one wrapper among `wrappers` a TFLite op's name (fused: `model/<layer>/<op>`
    parts joined by ";") is made from, else None."""
    parts = {segment for piece in op_name.split(";") for segment in piece.split("/")}
    found = [w for w in wrappers if w.name in parts]
    return found[0] if len(found) == 1 else None


def fall_back(picked: list[tuple], accuracy_of: Callable[[bytes], float],
              convert: Callable[[list], bytes], reference: float,
              budget: float) -> tuple[bytes | None, dict]:
    """Fall back the layers `candidates` picked (`picked`) one more at a time:
    `convert(wrappers)` makes an int8 file with those wrappers' kernels float,
    `accuracy_of(blob)` evaluates it. Returns (the first file within `budget` of
    `reference`, or the best tried; its record)."""
    wrappers = [w for w, _ in picked]
    tried, best = [], (None, -1.0, 0)     # (file, accuracy, layers in it)
    for count, (wrapper, row) in enumerate(picked, 1):
        blob = convert(wrappers[:count])
        accuracy = accuracy_of(blob)
        tried.append({"layer": wrapper.name, "named_as": row["layer"],
                      "local_sqnr_db": row["local_sqnr_db"], "accuracy": accuracy})
        if accuracy > best[1]:
            best = (blob, accuracy, count)
        if reference - accuracy <= budget + 1e-9:
            break
    within = bool(tried) and reference - best[1] <= budget + 1e-9
    return best[0], {"layers": [w.name for w in wrappers[:best[2]]], "tried": tried,
                     "within_budget": within}


def splicer(int8: bytes, wrappers: list,
            convert: Callable[[list], bytes]) -> Callable[[list], bytes]:
    """`chosen -> the int8 file with their kernels float` for `fall_back`, `chosen`
    among `wrappers`. One strict-QDQ conversion with every wrapper's kernel float serves
    each try (each layer's float op, batch norm folded, is the same whichever others are
    float): its float ops are spliced in for the wrappers chosen, told apart by their
    names (`owner`); if a name is not one wrapper's alone, each try converts its own."""
    def each(chosen):
        return spliced(int8, convert(chosen))[0]

    if not wrappers:
        return each
    every = convert(wrappers)
    owners = {name: owner(name, wrappers) for name in spliced(int8, every)[1]}
    if not all(owners.values()):
        return each
    return lambda chosen: spliced(int8, every, lambda name: any(
        owners.get(name) is w for w in chosen))[0]


def within_budget(model, int8: bytes, entry: dict, convert: Callable[[list], bytes],
                  accuracy_of: Callable[[bytes], float], entry_of: Callable[[bytes], dict],
                  reference: float, cfg) -> tuple[bytes, dict]:
    """The int8 file `int8` (report entry `entry`) with layers fallen back until within
    `export.max_accuracy_drop` of `reference`: `convert(wrappers)` writes a strict-QDQ
    file with those wrappers' kernels float, whose float ops are `spliced` into `int8`
    (`splicer`); `entry_of` makes the new file's entry, which records the layers, each
    try, and the accuracy, size and latency before. If no try comes closer, `int8` is
    kept."""
    picked = candidates(model, entry["layers"], cfg.int8_fallback_layers)
    splice = splicer(int8, [w for w, _ in picked], convert)
    found, record = fall_back(picked, accuracy_of, splice, reference, cfg.max_accuracy_drop)
    if found is None or max(t["accuracy"] for t in record["tried"]) <= entry["accuracy"]:
        console.warn(f"tflite_int8: no fallback of {len(record['tried'])} "
                     "layer(s) brought it closer to the model; kept all-int8")
        return int8, {**entry, "fallback": {**record, "layers": [], "kept": "int8"}}
    new = entry_of(found)
    new["fallback"] = {**record, "accuracy_before": entry["accuracy"],
                       "size_bytes_before": entry["size_bytes"],
                       "latency_ms_before": entry["latency_ms"]}
    print(f"tftrain: tflite_int8 fell back {len(record['layers'])} layer(s) to float kernels "
          f"({', '.join(record['layers'])}): accuracy {entry['accuracy']:.4f} -> "
          f"{new['accuracy']:.4f}, {entry['size_bytes']} -> {new['size_bytes']} B, "
          f"{entry['latency_ms']:.3f} -> {new['latency_ms']:.3f} ms/example", flush=True)
    return found, new


# kernel ops a fallback puts back in float
_KERNEL_OPS = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL")


def spliced(int8_blob: bytes, float_blob: bytes,
            only: Callable[[str], bool] | None = None) -> tuple[bytes, list[str]]:
    """`int8_blob` with each of its kernel ops that `float_blob` computes in float (the
    same output tensor name; with `only`, those whose name it accepts) replaced by
    DEQUANTIZE -> that float op (its float kernel and bias, batch norm folded as the
    converter folded it) -> QUANTIZE to the int8 op's output, so the ops around it are
    unchanged; returns it and the replaced tensors'
    names. `float_blob` is a strict-QDQ conversion with those layers' kernels float: the
    converter writes it with uint8 per-channel kernels elsewhere, which no runtime runs,
    so only its float ops are taken."""

    def op_name(model, op):
        code = model.operatorCodes[op.opcodeIndex]
        builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
        return next(k for k, v in vars(fb.BuiltinOperator).items() if v == builtin)

    target, source = _unpacked(int8_blob), _unpacked(float_blob)
    graph, other = target.subgraphs[0], source.subgraphs[0]
    by_output = {graph.tensors[op.outputs[0]].name: i for i, op in enumerate(graph.operators)}

    def code_index(builtin: int, version: int = 1) -> int:
        for i, code in enumerate(target.operatorCodes):
            if max(code.builtinCode, code.deprecatedBuiltinCode) == builtin and \
                    code.version == version:
                return i
        code = fb.OperatorCodeT()
        code.builtinCode, code.deprecatedBuiltinCode = builtin, min(builtin, 127)
        code.version = version
        target.operatorCodes.append(code)
        return len(target.operatorCodes) - 1

    def tensor(like, dtype, data=None, name_suffix="_float") -> int:
        new = fb.TensorT()
        new.shape, new.shapeSignature = like.shape, like.shapeSignature
        new.type, new.name = dtype, (like.name or b"") + name_suffix.encode()
        buffer = fb.BufferT()
        buffer.data = data
        target.buffers.append(buffer)
        new.buffer = len(target.buffers) - 1
        graph.tensors.append(new)
        return len(graph.tensors) - 1

    replaced, operators = [], list(graph.operators)
    for op in other.operators:
        out = other.tensors[op.outputs[0]]
        if op_name(source, op) not in _KERNEL_OPS or out.type != fb.TensorType.FLOAT32 \
                or out.name not in by_output or \
                (only is not None and not only(out.name.decode())):
            continue
        old = graph.operators[by_output[out.name]]
        if graph.tensors[old.outputs[0]].type == fb.TensorType.FLOAT32:
            continue                                       # already float here
        x_int8, y_int8 = old.inputs[0], old.outputs[0]
        x_float = tensor(graph.tensors[x_int8], fb.TensorType.FLOAT32)
        y_float = tensor(graph.tensors[y_int8], fb.TensorType.FLOAT32)
        inputs = [x_float]
        for index in op.inputs[1:]:                        # kernel, bias: float constants
            if index < 0:
                inputs.append(index)
                continue
            constant = other.tensors[index]
            inputs.append(tensor(constant, constant.type, source.buffers[constant.buffer].data,
                                 ""))
        for index in old.inputs[1:]:                       # the int8 kernel is not used
            if index >= 0 and target.buffers[graph.tensors[index].buffer].data is not None:
                target.buffers[graph.tensors[index].buffer].data = None
        dequantize, compute, quantize = fb.OperatorT(), fb.OperatorT(), fb.OperatorT()
        dequantize.opcodeIndex = code_index(fb.BuiltinOperator.DEQUANTIZE)
        dequantize.inputs, dequantize.outputs = [x_int8], [x_float]
        code = source.operatorCodes[op.opcodeIndex]
        compute.opcodeIndex = code_index(max(code.builtinCode, code.deprecatedBuiltinCode),
                                         code.version)
        compute.builtinOptionsType, compute.builtinOptions = op.builtinOptionsType, \
            op.builtinOptions
        compute.inputs, compute.outputs = inputs, [y_float]
        quantize.opcodeIndex = code_index(fb.BuiltinOperator.QUANTIZE)
        quantize.inputs, quantize.outputs = [y_float], [y_int8]
        at = operators.index(old)
        operators[at:at + 1] = [dequantize, compute, quantize]
        replaced.append(out.name.decode())
    graph.operators = operators
    return _packed(target, len(int8_blob)), replaced


def with_kernel_scales(blob: bytes, layer: str, factor: float) -> bytes:
    """`blob` with the quantization scales of every int8 constant whose tensor name
    mentions `layer` (its kernel) times `factor`: a converter that quantized that layer
    unlike QAT, for the tests and the benchmark of the fallback. A file in which the
    layer's kernel is float is returned as it is."""

    model = _unpacked(blob)
    for tensor in model.subgraphs[0].tensors:
        data = model.buffers[tensor.buffer].data
        if (layer in tensor.name.decode() and tensor.type == fb.TensorType.INT8
                and data is not None and len(data) and tensor.quantization is not None):
            tensor.quantization.scale = [s * factor for s in tensor.quantization.scale]
    return _packed(model, len(blob))


def _unpacked(blob: bytes):
    """A TFLite flatbuffer as the schema's object tree (editable)."""
    return fb.ModelT.InitFromObj(fb.Model.GetRootAsModel(blob, 0))


def _packed(model, size_hint: int) -> bytes:
    """The flatbuffer of an object tree from `_unpacked`."""
    import flatbuffers
    builder = flatbuffers.Builder(size_hint)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())
