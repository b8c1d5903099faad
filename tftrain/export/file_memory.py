"""What a TFLite file needs on a device: its constants, front end and network, and its
tensor arena estimate.

Its constant bytes split into the front end and the network: the front end is what the
ops of the model's front-end layer read (a layer marked `front_end`, such as the speech
models' features, int8 or float: the ops up to the last one of its scope), or without
one what the ops before the first one with an int8 kernel read; its
tensor arena estimate: the peak, over the ops in execution order, of the bytes of
activations live at once at batch 1 (a tensor lives from the op
that writes it, or the start for an input, to the last op that reads it, or the end
for an output). A memory planner such as TensorFlow Lite Micro's cannot place them in
less; op scratch buffers come on top.
"""
from __future__ import annotations

import re

import numpy as np

from tftrain.core import internals


def own_ops(blob: bytes):
    """A LiteRT interpreter of the file's own ops (XNNPack would replace them by one
    DELEGATE node)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType
    return Interpreter(model_content=blob, experimental_op_resolver_type=(
        OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES))


def constants(interp) -> set[int]:
    """The indices of the tensors the ops read and none writes, inputs aside (an
    activation of static shape holds data too once allocated)."""
    ops = internals.ops_details(interp)
    written = {t for op in ops for t in op["outputs"]}
    inputs = {d["index"] for d in interp.get_input_details()}
    return {t for op in ops for t in op["inputs"] if t >= 0} - written - inputs


def layout(blob: bytes, front_end: str | None = None) -> dict:
    """`weight_bytes` (`front_end`, `network`) and `arena_bytes` of a TFLite file;
    `front_end`: the name of the model's front-end layer, if it has one."""
    interp = own_ops(blob)
    for inp in interp.get_input_details():      # batch 1, every shape known after a run
        interp.resize_tensor_input(inp["index"], [1, *inp["shape"][1:]])
    interp.allocate_tensors()
    for inp in interp.get_input_details():
        interp.set_tensor(inp["index"], np.zeros([1, *inp["shape"][1:]], inp["dtype"]))
    interp.invoke()
    ops = internals.ops_details(interp)
    details = interp.get_tensor_details()
    size = {t["index"]: int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize
            for t in details}
    dtype = {t["index"]: np.dtype(t["dtype"]) for t in details}
    inputs = [d["index"] for d in interp.get_input_details()]
    outputs = [d["index"] for d in interp.get_output_details()]
    constant = constants(interp).__contains__

    # a file with no int8 kernel (a float file) is all network
    end = next((i for i, op in enumerate(ops)
                if any(constant(t) and dtype[t] == np.int8 for t in op["inputs"])), 0)
    if front_end:
        scope = re.compile(rf"(^|/)(quant_)?{re.escape(front_end)}/")
        name = {t["index"]: t["name"] for t in details}
        end = 1 + max((i for i, op in enumerate(ops)
                       if any(scope.search(name[t]) for t in op["outputs"])), default=-1)
    weights = {"front_end": 0, "network": 0}
    seen: set[int] = set()
    for i, op in enumerate(ops):
        for t in op["inputs"]:
            if constant(t) and t not in seen:
                seen.add(t)
                weights["front_end" if i < end else "network"] += size[t]
    return {"weight_bytes": weights, "arena_bytes": arena(ops, size, inputs, outputs)}


def arena(ops: list[dict], size: dict[int, int], inputs: list[int],
          outputs: list[int]) -> int:
    """The peak bytes of activations live at once, `ops` in execution order."""
    start = {t: -1 for t in inputs}
    end = {t: len(ops) for t in outputs}
    for i, op in enumerate(ops):
        for t in op["outputs"]:
            start.setdefault(t, i)
        for t in op["inputs"]:
            if t >= 0 and t in start:
                end[t] = max(end.get(t, i), i)
    peak = 0
    for i in range(len(ops)):
        peak = max(peak, sum(size[t] for t, s in start.items() if s <= i <= end.get(t, s)))
    return peak
