"""How fast each artifact runs the way deployments run it.

- `grid`: milliseconds per example at batch 1 and batch 32, on 1 thread and on every
  core, through the artifact's own runtime (LiteRT with its default XNNPack delegate,
  ONNX Runtime's CPU provider).
- `xnnpack`: which ops of a TFLite file the XNNPack delegate runs (its QS8 kernels for
  int8 ops, F32 for float ones) and which fall back to LiteRT's reference kernels.
"""
from __future__ import annotations

import os
import time

import numpy as np

from tftrain.core import internals

SETTINGS = ((1, 1), (32, 1), (1, 0), (32, 0))     # (batch, threads); 0: every core


def key(batch: int, threads: int) -> str:
    return f"batch{batch}_threads{threads or 'all'}"


def timed(run, x: np.ndarray, batch: int, budget: float = 0.05) -> float:
    """Milliseconds per example of a runner (`tflite_runner`, `onnx_runner`) on `batch`
    rows: warmed up, then repeated for about `budget` seconds (at least 3 calls), the
    median call."""
    rows = x[:batch] if len(x) >= batch else np.resize(x, (batch, *x.shape[1:]))
    run(rows)
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 200):
        t = time.perf_counter()
        run(rows)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / batch * 1e3


def tflite_runner(blob: bytes, batch: int, threads: int, like: np.ndarray):
    """A callable running LiteRT on `batch` rows shaped like `like`'s (0 threads: every
    core)."""
    from ai_edge_litert.interpreter import Interpreter

    from tftrain.export.file_tensors import set_example

    interp = Interpreter(model_content=blob, num_threads=threads or os.cpu_count())
    inp = interp.get_input_details()[0]
    interp.resize_tensor_input(inp["index"], [batch, *like.shape[1:]])
    interp.allocate_tensors()

    def run(rows):
        set_example(interp, inp, rows, batch=True)
        interp.invoke()
    return run


def onnx_runner(blob: bytes, batch: int, threads: int, like: np.ndarray, int8: bool):
    """A callable running ONNX Runtime (every graph optimization) on a batch."""
    from tftrain.export import onnx_export

    sess = onnx_export.session(blob, int8=int8, threads=threads)
    return lambda rows: sess.run(["logits"], {"inputs": rows})


def tflite_grid(blob: bytes, x: np.ndarray, budget: float = 0.05) -> dict[str, float]:
    """`grid` for a TFLite file run by LiteRT."""
    return tflite_grids([blob], x, budget, rounds=1)[0]


def tflite_grids(blobs: list[bytes], x: np.ndarray, budget: float = 0.05,
                 rounds: int = 3) -> list[dict[str, float]]:
    """`grid` for several TFLite files timed in turn (`grids`)."""
    return grids(tflite_makers(blobs, x), x, budget, rounds)


def tflite_makers(blobs: list[bytes], x: np.ndarray) -> list:
    """For each TFLite file, `(batch, threads) -> runner` (`tflite_runner`)."""
    return [lambda b, t, blob=blob: tflite_runner(blob, b, t, x) for blob in blobs]


def onnx_grid(blob: bytes, x: np.ndarray, int8: bool, budget: float = 0.05) -> dict[str, float]:
    """`grid` for an ONNX model run by ONNX Runtime."""
    return grids([lambda b, t: onnx_runner(blob, b, t, x, int8)], x, budget, rounds=1)[0]


def grids(makers: list, x: np.ndarray, budget: float, rounds: int) -> list[dict[str, float]]:
    """`grid` for several files (`makers`: for each, `(batch, threads) -> runner`) timed in
    turn (`round_times`), each figure the median of its rounds."""
    return [medians(times) for times in round_times(makers, x, budget, rounds)]


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Each setting's median over its rounds."""
    return {k: float(np.median(v)) for k, v in times.items()}


def round_times(makers: list, x: np.ndarray, budget: float, rounds: int,
                settings=None) -> list[dict[str, list[float]]]:
    """For each file, each setting's milliseconds per example in each round: in each
    setting (`(batch, threads)`; default `SETTINGS`), `rounds` rounds (the order reversed every other round)
    of `budget / rounds` seconds a file, so that two files' figures of one round are
    timed moments apart (the machine's speed jumps from second to second)."""
    found = [{} for _ in makers]
    for b, t in settings or SETTINGS:
        runners = [make(b, t) for make in makers]
        times = [[] for _ in makers]
        for r in range(rounds):
            for i in (range(len(makers)) if r % 2 == 0 else reversed(range(len(makers)))):
                times[i].append(timed(runners[i], x, b, budget / rounds))
        for grid, seen in zip(found, times):
            grid[key(b, t)] = seen
    return found


def speedups(slow: dict[str, list[float]], fast: dict[str, list[float]]) -> dict[str, float]:
    """How many times as fast `fast` runs as `slow` in each setting: the median of the
    rounds' ratios (a round's two figures were timed together; a ratio of two medians can
    pair a fast moment of one file with a slow moment of the other)."""
    return {k: float(np.median(v)) for k, v in round_ratios(slow, fast).items()}


def round_ratios(slow: dict[str, list[float]], fast: dict[str, list[float]]) -> dict[str, list]:
    """Each round's ratio `slow / fast` in each setting."""
    return {k: [a / b for a, b in zip(slow[k], fast[k])] for k in slow}


def tflite_entry(blob: bytes, x: np.ndarray, beside: bytes | None = None) -> dict:
    """A TFLite file's speed fields: its latency grid, XNNPack's ops, the CPU's int8; with
    `beside` (the float file of the same model) also that file's grid, timed in turn with
    the file's (`round_times`, three rounds), and how many times as fast the file runs
    (`speedups`)."""
    speed = {"xnnpack": xnnpack(blob), "cpu_int8": cpu_int8()}
    if beside is None:
        return {"latency_grid": tflite_grid(blob, x), **speed}
    times, float_times = round_times(tflite_makers([blob, beside], x), x, 0.05, 3)
    return {"latency_grid": medians(times), "float_latency_grid": medians(float_times),
            "speedup_vs_float": speedups(float_times, times), **speed}


def makers_for(blob: bytes, kind: str, x: np.ndarray, int8: bool = False):
    """`(batch, threads) -> runner` for a file of `kind` (`tflite` or `onnx`)."""
    if kind == "tflite":
        return tflite_makers([blob], x)[0]
    return lambda b, t: onnx_runner(blob, b, t, x, int8)


def versus_reference(blob: bytes, kind: str, x: np.ndarray, reference: str,
                     int8: bool = False, rounds: int = 5, budget: float = 0.25) -> dict:
    """`export.latency_reference`: the file at `reference` (of the artifact's runtime,
    `kind`) timed in turn with the artifact (`round_times`, `rounds` rounds), its grid and
    how many times as fast the artifact runs in each setting (`speedups`); {} when the
    reference is of another runtime. The artifact's own grid from those rounds comes too
    (`latency_grid_beside_reference`)."""
    from pathlib import Path

    if Path(reference).suffix != f".{kind}":
        return {}
    other = Path(reference).read_bytes()
    ref_int8 = kind == "onnx" and onnx_is_int8(other)
    times, ref_times = round_times([makers_for(blob, kind, x, int8),
                                    makers_for(other, kind, x, ref_int8)], x, budget, rounds)
    return {"reference": str(reference), "reference_latency_grid": medians(ref_times),
            "latency_grid_beside_reference": medians(times),
            "speedup_vs_reference": speedups(ref_times, times),
            "speedup_rounds_vs_reference": round_ratios(ref_times, times)}


def onnx_is_int8(blob: bytes) -> bool:
    import onnx
    return any(n.op_type == "QuantizeLinear" for n in onnx.load_from_string(blob).graph.node)


def cpu_int8(flags: str | None = None) -> str:
    """The CPU's int8 dot-product instructions, which decide whether int8 beats float."""
    from tftrain.core.cpu import cpu_flags, int8_instructions
    flags = cpu_flags() if flags is None else flags
    found = int8_instructions(flags)
    if found:
        return ", ".join(found)
    return "AVX2, no VNNI" if " avx2" in flags else "no int8 dot-product instructions found"


def int8_reason(flags: str | None = None) -> str:
    """Why int8 can lose to float on this CPU ("" where it should not)."""
    found = cpu_int8(flags)
    if not found.startswith(("AVX2, no", "no int8")):
        return ""
    return (f"this CPU has {found}: XNNPack's and ONNX Runtime's int8 kernels widen int8 to "
            "int16 (vpmaddwd) and requantize every output, which on small layers (depthwise, "
            "few channels, small maps) costs more than float's fused multiply-adds; with VNNI "
            "(vpdpbusd), AMX or ARM's dot product int8 runs faster")


def xnnpack(blob: bytes) -> dict:
    """{"delegated": ops XNNPack runs, "fallback": the others as `OP (output tensor)`}: an
    op belongs to a delegate partition when it lies between the partition's inputs and
    its outputs."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=blob, num_threads=1)
    interp.allocate_tensors()
    ops = internals.ops_details(interp)
    names = {t["index"]: t["name"] for t in interp.get_tensor_details()}
    producer = {int(o): op["index"] for op in ops if op["op_name"] != "DELEGATE"
                for o in op["outputs"]}
    covered: set[int] = set()
    for op in (o for o in ops if o["op_name"] == "DELEGATE"):
        inputs, todo = {int(i) for i in op["inputs"]}, [int(o) for o in op["outputs"]]
        while todo:
            tensor = todo.pop()
            index = producer.get(tensor)
            if tensor in inputs or index is None or index in covered:
                continue
            covered.add(index)
            todo.extend(int(i) for i in ops[index]["inputs"] if i >= 0)
    own = [op for op in ops if op["op_name"] != "DELEGATE"]
    return {"delegated": sum(op["index"] in covered for op in own),
            "fallback": [f"{op['op_name']} ({names.get(int(op['outputs'][0]), '?')})"
                         for op in own if op["index"] not in covered]}
