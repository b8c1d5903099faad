"""ONNX artifacts, converted with tf2onnx and run with ONNX Runtime (extra `[onnx]`).

- `model.onnx`: the float32 serving computation (the model's own input, as TFLite takes:
  token ids for text) converted from a `tf.function`, the portable route to GPU serving
  (ONNX Runtime's CUDA/TensorRT providers) now that TF-TRT is gone.
- `model_int8.onnx`: a QDQ model converted from the int8 TFLite flatbuffer, so it carries
  exactly its int8 kernels, per-channel scales and activation ranges (a QAT model's
  learned ranges, or post-training calibration). An activation (Relu, Clip) between a
  quantized op and its QuantizeLinear gets a QuantizeLinear/DequantizeLinear pair in
  front of it with the same parameters (exact: the activation of a quantized value is
  quantized the same way), so that ONNX Runtime fuses `DQ -> Conv/MatMul -> Q` into its
  int8 kernels (QLinearConv, QGemm). Verified with ONNX Runtime's int8 path enabled
  (`session.qdqisint8allowed`), counting the int8 kernels of the optimized graph.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

OPSET = 17
INT8_SESSION_CONFIG = {"session.qdqisint8allowed": "1"}   # int8 activations on x86 too
_INT8_KERNELS = ("QLinear", "QGemm", "ConvInteger", "MatMulInteger", "DynamicQuantize")
_ACTIVATIONS = ("Relu", "Clip")


_HANDLERS: list = []


def _register_handlers() -> None:
    """tf2onnx handlers for ops it has no ONNX form for at this opset, each written with
    ONNX ops it has (registered once, before the first conversion), and for one it
    refuses without cause (ComplexAbs of an unknown batch), or converts wrong (ScatterNd
    with repeated indices, `ScatterNdSummed`): TensorFlow's `Erfc`
    (Keras' exact GELU is 0.5 x erfc(-x/sqrt 2)) as 1 - Erf, and TFLite's GELU (in an int8
    file, between a dequantize and a quantize) as 0.5 x (1 + erf(x/sqrt 2)), or its tanh
    form when the file's GELU is the approximate one."""
    if _HANDLERS:
        return
    from tf2onnx import utils
    from tf2onnx.handler import tf_op, tfl_op

    @tfl_op("TFL_GELU")
    class TflGelu:
        @classmethod
        def version_9(cls, ctx, node, **kwargs):
            x, out = node.input[0], node.output[0]
            shape, dtype = ctx.get_shape(out), ctx.get_dtype(out)

            def const(value):
                return ctx.make_const(utils.make_name(f"{node.name}_c"),
                                      np.array(value, np.float32)).output[0]

            def op(kind, *inputs):
                return ctx.make_node(kind, list(inputs), name=utils.make_name(node.name)).output[0]
            if node.get_attr_value("approximate", 0):
                cube = op("Mul", op("Mul", x, x), x)
                inner = op("Mul", op("Add", x, op("Mul", cube, const(0.044715))),
                           const(np.sqrt(2 / np.pi)))
                plus = op("Add", op("Tanh", inner), const(1.0))
            else:
                plus = op("Add", op("Erf", op("Mul", x, const(1 / np.sqrt(2)))), const(1.0))
            result = op("Mul", op("Mul", x, const(0.5)), plus)
            ctx.remove_node(node.name)
            ctx.replace_all_inputs(out, result)
            ctx.set_shape(result, shape)
            ctx.set_dtype(result, dtype)
    _HANDLERS.append(TflGelu)

    @tf_op("Erfc")
    class Erfc:
        @classmethod
        def version_9(cls, ctx, node, **kwargs):
            dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.input[0]))
            one = ctx.make_const(utils.make_name(f"{node.name}_one"), np.array(1, dtype))
            node.type = "Erf"
            minus = ctx.insert_new_node_on_output("Sub", node.output[0],
                                                  name=utils.make_name(f"{node.name}_erfc"))
            ctx.replace_inputs(minus, [one.output[0], node.output[0]])
            ctx.copy_shape(node.output[0], minus.output[0])
            ctx.set_dtype(minus.output[0], ctx.get_dtype(node.output[0]))
    _HANDLERS.append(Erfc)

    from tf2onnx.onnx_opset.signal import ComplexAbsOp

    @tf_op("ComplexAbs")
    class ComplexAbsOfUnknownBatch:
        """tf2onnx's ComplexAbs after its RFFT (a complex tensor as real and imaginary
        parts stacked first), whose shape check reads an unknown first dimension (-1, a
        TFLite file's batch) as not 2: it is 2, said so first."""
        @classmethod
        def version_1(cls, ctx, node, **kwargs):
            cls._known(ctx, node)
            ComplexAbsOp.version_1(ctx, node, **kwargs)

        @classmethod
        def version_13(cls, ctx, node, **kwargs):
            cls._known(ctx, node)
            ComplexAbsOp.version_13(ctx, node, **kwargs)

        @staticmethod
        def _known(ctx, node):
            shape = ctx.get_shape(node.input[0])
            if shape and shape[0] == -1:
                ctx.set_shape(node.input[0], [2, *shape[1:]])
    _HANDLERS.append(ComplexAbsOfUnknownBatch)

    from tf2onnx.onnx_opset.tensor import ScatterND

    @tf_op("ScatterNd", onnx_op="ScatterND")      # TFLite's SCATTER_ND comes here too
    class ScatterNdSummed:
        """TensorFlow's `scatter_nd` sums the updates of repeated indices (a bag of token
        ids counting them: `TermWeights`); tf2onnx's ScatterND on zeros keeps one of
        them. From opset 16 ONNX's ScatterND sums them with `reduction: add`."""
        @classmethod
        def version_16(cls, ctx, node, **kwargs):
            ScatterND.version_11(ctx, node, **kwargs)
            node.set_attr("reduction", "add")
    _HANDLERS.append(ScatterNdSummed)


def float_onnx(plain) -> bytes:
    """The float32 model `plain` (its own input) as an ONNX model with input `inputs`
    and output `logits`."""
    import tensorflow as tf
    import tf2onnx

    _register_handlers()
    spec = tf.TensorSpec([None, *plain.input_shape[1:]], plain.inputs[0].dtype, name="inputs")

    @tf.function(input_signature=[spec])
    def serve(inputs):
        return tf.cast(plain(inputs, training=False), tf.float32)

    proto, _ = tf2onnx.convert.from_function(serve, input_signature=[spec], opset=OPSET)
    return _renamed(proto).SerializeToString()


def int8_onnx(tflite: bytes, layout: str = "S8S8") -> bytes:
    """The int8 TFLite flatbuffer `tflite` as an ONNX QDQ model (`inputs` -> `logits`),
    its codes in `layout` (`requantize`; see `int8_format`)."""
    import tf2onnx

    _register_handlers()
    with tempfile.TemporaryDirectory(prefix="tftrain-onnx-") as tmp:
        path = Path(tmp) / "model.tflite"
        path.write_bytes(tflite)
        proto, _ = tf2onnx.convert.from_tflite(str(path), opset=OPSET)
    _quantize_before_activations(proto.graph)
    requantize(proto.graph, layout)
    return _renamed(proto).SerializeToString()


# ops through which a quantized tensor passes with its type and quantization unchanged
_PASS_THROUGH = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity",
                 "MaxPool", "GlobalMaxPool", "Slice", "Split", "Concat", "Expand", "Pad")


def int8_format(cpu_flags: str | None = None) -> str:
    """The int8 layout ONNX Runtime runs fastest and exactly on this CPU: `U8S8` (uint8
    activations, int8 weights) where the CPU has VNNI; without VNNI, ONNX Runtime's U8S8
    kernels (vpmaddubsw) saturate int16 pair sums, which moved logits by up to 0.9 on the
    digits CNN, so `U8U8` (weights uint8 around 128), which runs as fast there and
    exactly (0.035 vs 0.034 ms per example; S8S8 0.111 ms). S8S8 (the TFLite file's own layout) takes ONNX Runtime's slow path on x86."""
    if cpu_flags is None:
        from tftrain.core.cpu import cpu_flags as read
        cpu_flags = read()
    return "U8S8" if any(f" {f}" in cpu_flags for f in ("avx512_vnni", "avx_vnni")) \
        else "U8U8"


def requantize(graph, layout: str) -> int:
    """The QDQ `graph` (int8 activations and weights, as converted from TFLite) in
    `layout` (`U8S8`, `U8U8` or `S8S8`): an int8 code q is the uint8 code q + 128 with its
    zero point z + 128 at the same scale, so the model computes the same values. Weights
    (int8 initializers and views of them) move only for U8U8; embedding tables (rows
    gathered, then dequantized: no int8 kernel reads them) and int32 biases never.
    Returns the zero points moved."""
    from onnx import TensorProto, numpy_helper

    if layout == "S8S8":
        return 0
    initializers = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}

    def origin(name: str) -> tuple[str | None, bool]:
        """(the initializer `name` holds codes of, through gathers and views, or None;
        whether rows of it were gathered: an embedding table, which stays int8)."""
        gathered = False
        while name not in initializers:
            node = producer.get(name)
            if node is None or node.op_type not in (*_PASS_THROUGH, "Gather"):
                return None, gathered
            gathered |= node.op_type == "Gather"
            name = node.input[0]
        return name, gathered

    moved: dict[str, str] = {}

    def shifted(name: str, in_place: bool = False) -> str:
        """`name`'s int8 initializer as uint8 (+128): a new one (zero points may be shared
        by activations and weights), or in place (weights, read by their name)."""
        if name in moved:
            return moved[name]
        values = numpy_helper.to_array(initializers[name])
        if values.dtype != np.int8:
            return name
        new = numpy_helper.from_array((values.astype(np.int16) + 128).astype(np.uint8),
                                      name if in_place else f"{name}/u8")
        if in_place:
            initializers[name].CopyFrom(new)
        else:
            graph.initializer.append(new)
            initializers[new.name] = new
        moved[name] = new.name
        return new.name

    changed = 0
    weights = layout == "U8U8"
    for node in graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(node.input) < 3:
            continue
        source, gathered = origin(node.input[0]) if node.op_type == "DequantizeLinear" \
            else (None, False)
        if source is not None:
            if not weights or gathered or \
                    numpy_helper.to_array(initializers[source]).dtype != np.int8:
                continue
            shifted(source, in_place=True)
        zero = shifted(node.input[2])
        changed += zero != node.input[2]
        node.input[2] = zero
    for value in graph.value_info:            # intermediate types tf2onnx recorded
        source, gathered = origin(value.name)
        if value.type.tensor_type.elem_type == TensorProto.INT8 and \
                (source is None or (weights and not gathered)):
            value.type.tensor_type.elem_type = TensorProto.UINT8
    drop_unused(graph)              # the int8 zero points every reader moved away from
    return changed


def drop_unused(graph) -> int:
    """Remove the initializers no node reads (in `graph` or a subgraph of it) and that
    are not outputs: ONNX Runtime warns about each one in every session it opens.
    Returns how many went."""
    read = {o.name for o in graph.output}

    def walk(g):
        for node in g.node:
            read.update(node.input)
            for attribute in node.attribute:
                for sub in ([attribute.g] if attribute.HasField("g") else []) + \
                        list(attribute.graphs):
                    walk(sub)
    walk(graph)
    unused = [i for i in graph.initializer if i.name not in read]
    for initializer in unused:
        graph.initializer.remove(initializer)
    return len(unused)


def _renamed(proto):
    """Name the graph's single input `inputs` and single output `logits`."""
    graph = proto.graph
    names = {graph.input[0].name: "inputs", graph.output[0].name: "logits"}
    for node in graph.node:
        node.input[:] = [names.get(i, i) for i in node.input]
        node.output[:] = [names.get(o, o) for o in node.output]
    graph.input[0].name, graph.output[0].name = "inputs", "logits"
    return proto


def _quantize_before_activations(graph) -> int:
    """`x -> Relu -> Q(s, z)` becomes `x -> Q(s, z) -> DQ(s, z) -> Relu -> Q(s, z)`:
    the same values, and `x`'s producer now ends in a QuantizeLinear that ONNX Runtime
    can fuse into an int8 kernel. Returns how many activations it changed."""
    from onnx import helper

    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    changed = 0
    for node in [n for n in graph.node if n.op_type in _ACTIVATIONS]:
        after = consumers.get(node.output[0], [])
        if len(after) != 1 or after[0].op_type != "QuantizeLinear":
            continue
        source, (_, scale, zero) = node.input[0], after[0].input
        quantize = helper.make_node("QuantizeLinear", [source, scale, zero], [f"{source}/q"])
        dequantize = helper.make_node("DequantizeLinear", [f"{source}/q", scale, zero],
                                      [f"{source}/dq"])
        node.input[0] = f"{source}/dq"
        index = list(graph.node).index(node)
        graph.node.insert(index, dequantize)
        graph.node.insert(index, quantize)
        changed += 1
    return changed


def session(blob: bytes, int8: bool = False, optimized: Path | None = None, threads: int = 0):
    """An ONNX Runtime CPU session with every graph optimization (`int8`: its int8 QDQ
    kernels allowed); `optimized`: also write the optimized graph there; `threads`: for
    each op (0: every core)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    for key, value in (INT8_SESSION_CONFIG if int8 else {}).items():
        options.add_session_config_entry(key, value)
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])


def logits(sess, x: np.ndarray, batch: int = 256) -> np.ndarray:
    return np.concatenate([sess.run(["logits"], {"inputs": x[i:i + batch]})[0]
                           for i in range(0, len(x), batch)])


def latency(sess, x: np.ndarray, examples: int = 100) -> float:
    """Seconds per example, one example at a time (as the TFLite figures)."""
    rows = [x[i:i + 1] for i in range(min(examples, len(x)))]
    sess.run(["logits"], {"inputs": rows[0]})
    start = time.perf_counter()
    for row in rows:
        sess.run(["logits"], {"inputs": row})
    return (time.perf_counter() - start) / max(len(rows), 1)


def optimized_graph(blob: bytes):
    """The graph ONNX Runtime runs for `blob` with its int8 kernels allowed (after its
    QDQ fusions)."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="tftrain-onnx-") as tmp:
        path = Path(tmp) / "optimized.onnx"
        session(blob, int8=True, optimized=path)
        return onnx.load(str(path)).graph


def int8_kernels(graph) -> dict[str, int]:
    """The int8 kernels in an optimized `graph` (op type -> count)."""
    counts: dict[str, int] = {}
    for node in graph.node:
        if node.op_type.startswith(_INT8_KERNELS):
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


# ops that move values and compute nothing
_LAYOUT = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Shape",
           "Slice", "Split", "Identity", "Cast", "Expand", "Pad"}


def float_ops(graph) -> list[str]:
    """The nodes of an optimized `graph` that compute on float values (`Op (output)`):
    what ONNX Runtime did not fuse into an int8 kernel (float islands), quantize and
    dequantize nodes and layout ops aside. Types follow the graph: a DequantizeLinear, a
    float input or a float initializer (a float embedding table) gives float,
    QuantizeLinear and the int8 kernels give integers."""
    from onnx import TensorProto

    floating = {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.FLOAT}
    floating |= {i.name for i in graph.initializer if i.data_type == TensorProto.FLOAT}
    found = []
    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            floating.update(node.output)
        elif node.op_type != "QuantizeLinear" and not node.op_type.startswith(_INT8_KERNELS) \
                and any(name in floating for name in node.input):
            floating.update(node.output)
            if node.op_type not in _LAYOUT:
                found.append(f"{node.op_type} ({node.output[0]})")
    return found
