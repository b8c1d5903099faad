"""A candidate's latency against the dense file, judged with its uncertainty.

A candidate's run times its file in turn with the dense float file over a few rounds
(`export.latency_reference`: each round's ratio of the two, timed moments apart). On a
shared machine one round's ratio moves by tens of percent, so the ratio is the median of
the rounds, with the interval the rounds give that median (`median_interval`: order
statistics, no assumption on the noise), at least `MIN_SPREAD` either side of it (the
median itself moves that much from one process to the next). Where the interval straddles the target's
latency limit, the two files are timed again, `MORE_ROUNDS` rounds at a time, until it
clears the limit or `MAX_ROUNDS` are spent; a candidate still straddling it is
`borderline`: decided by the median, reported with its interval. A narrower model timed
slower than a wider one of the same kind is timed again too, and flagged if it still is.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

CONFIDENCE = 0.9        # the interval's coverage of the median (at least)
# a ratio's median moves between processes by more than its rounds spread within one
# (three searches of one trained run, 2026-12-04: each candidate's rounds within 0.2-1%,
# its median 0.4-2% apart from search to search; channels67-qat 0.496 and 0.503 against
# a 0.5 limit): an interval is at least this share either side of the median
MIN_SPREAD = 0.03
MORE_ROUNDS = 10        # rounds a re-timing adds
MAX_ROUNDS = 45         # rounds of a candidate at most: its run's 5, then 4 re-timings
ROUND_SECONDS = 0.05    # a file's share of a round (as `speed.versus_reference`'s)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The interval of order statistics `(x_(k), x_(n+1-k))` that holds the median of
    the distribution the values were drawn from with probability at least `confidence`
    (the widest, the range, when the values are too few for it: 93.75% for 5)."""
    ordered = sorted(values)
    n = len(ordered)
    k = 1
    while k + 1 <= n // 2 and _coverage(n, k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k]


def ratio_interval(rounds: list[float]) -> tuple[float, float]:
    """A latency ratio's interval: its rounds' `median_interval`, widened to at least
    `MIN_SPREAD` either side of their median."""
    low, high = median_interval(rounds)
    middle = float(np.median(rounds))
    return min(low, middle * (1 - MIN_SPREAD)), max(high, middle * (1 + MIN_SPREAD))


def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) for n draws: 1 - 2 P(Binomial(n, 1/2) < k)."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2.0 ** n


def ratio_limit(target, dense: dict) -> float | None:
    """The target's latency limits as one ratio to the dense file: the ratio limit, or
    the milliseconds limit over the dense file's milliseconds, the tighter; None without
    either."""
    limits = [target.max_latency_ratio] if target.max_latency_ratio else []
    if target.max_latency_ms and dense.get("latency_ms"):
        limits.append(target.max_latency_ms / dense["latency_ms"])
    return min(limits) if limits else None


def straddles(interval: tuple[float, float], limit: float | None) -> bool:
    return limit is not None and interval[0] <= limit < interval[1]


def settle(figures: dict, file: Path, reference: Path, target, dense: dict) -> None:
    """Time `file` against the dense `reference` again while the ratio's interval
    straddles the target's limit (up to `MAX_ROUNDS`); `figures` updated: every round's
    ratio (`latency_rounds`), the median (`latency_ratio`, and `latency_ms` from it), its
    interval, and whether it still straddles (`borderline`)."""
    limit = ratio_limit(target, dense)
    while straddles(interval_of(figures), limit) and len(figures["latency_rounds"]) < MAX_ROUNDS:
        add_rounds(figures, file, reference, target, dense)
    figures["borderline"] = straddles(interval_of(figures), limit)


def interval_of(figures: dict) -> tuple[float, float]:
    return tuple(figures["latency_interval"])


def add_rounds(figures: dict, file: Path, reference: Path, target, dense: dict,
               rounds: int = MORE_ROUNDS) -> None:
    """`rounds` more rounds of `file` timed in turn with `reference` in the target's
    setting, joined to the figures' rounds."""
    found = retimed(file, reference, target.latency, rounds)
    joined = [*figures["latency_rounds"], *found]
    ratio = float(np.median(joined))
    figures.update(latency_rounds=joined, latency_ratio=ratio,
                   latency_interval=list(ratio_interval(joined)))
    if dense.get("latency_ms"):
        figures["latency_ms"] = ratio * dense["latency_ms"]


def retimed(file: Path, reference: Path, latency, rounds: int,
            round_seconds: float = ROUND_SECONDS) -> list[float]:
    """Each round's ratio of `file`'s milliseconds to `reference`'s, timed in turn
    (`speed.round_times`) at the target's batch and threads, on examples shaped as the
    file's input (random values: the files' speed does not depend on them)."""
    from tftrain.export import speed

    kind = "onnx" if Path(file).suffix == ".onnx" else "tflite"
    blobs = [Path(file).read_bytes(), Path(reference).read_bytes()]
    x = examples(blobs[0], kind)
    makers = [speed.makers_for(blob, kind, x, kind == "onnx" and speed.onnx_is_int8(blob))
              for blob in blobs]
    setting = (latency.batch, latency.threads)
    ours, theirs = speed.round_times(makers, x, round_seconds * rounds, rounds, (setting,))
    key = speed.key(*setting)
    return [a / b for a, b in zip(ours[key], theirs[key])]


def examples(blob: bytes, kind: str, n: int = 32) -> np.ndarray:
    """`n` examples of a file's input: standard normal floats, or zeros for token ids."""
    from tftrain.export import speed

    if kind == "onnx":
        from tftrain.export import onnx_export
        found = onnx_export.session(blob, int8=speed.onnx_is_int8(blob)).get_inputs()[0]
        shape = [d if isinstance(d, int) else 1 for d in found.shape[1:]]
        dtype = np.float32 if "float" in found.type else np.int64 if "int64" in found.type \
            else np.int32
    else:
        from ai_edge_litert.interpreter import Interpreter
        found = Interpreter(model_content=blob).get_input_details()[0]
        shape, dtype = list(found["shape"][1:]), found["dtype"]
        if found["quantization"][0]:
            dtype = np.float32          # `set_example` quantizes float rows itself
    if np.issubdtype(dtype, np.floating):
        return np.random.default_rng(0).standard_normal((n, *shape)).astype(np.float32)
    return np.zeros((n, *shape), dtype)


def narrower_slower(measured: list[tuple]) -> list[tuple]:
    """Pairs `(narrower, wider)` of measured candidates (`(candidate, figures)`) of the
    same file kind and sparsity where the one keeping fewer channels was timed slower
    (a higher ratio to the dense file): a narrower model does less of the same work."""
    from tftrain.search.candidates import FILE_KIND

    found = []
    for a, fa in measured:
        for b, fb in measured:
            if a.reference or b.reference or FILE_KIND[a.precision] != FILE_KIND[b.precision]:
                continue
            if a.sparsity == b.sparsity and (a.channels or 1.0) < (b.channels or 1.0) \
                    and fa["latency_ratio"] > fb["latency_ratio"]:
                found.append((a, b))
    return found
