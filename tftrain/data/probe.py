"""Which stage of the input pipeline is slow: each stage of a run's pipeline timed on its
own, cumulatively (what the files or arrays give, then decoded, then augmented and
batched as training takes it), so that a run whose steps wait on input can say where the
time goes (`input_wait.InputWait`)."""
from __future__ import annotations

import time

import tensorflow as tf

from tftrain.config import DataConfig
from tftrain.data import augment as aug
from tftrain.data.batching import BatchPlan
from tftrain.data.pipeline import epoch_layout, train_dataset
from tftrain.data.source import Source


def stage_rates(source: Source, plan: BatchPlan, cfg: DataConfig, seed: int,
                seconds: float = 0.5, most: int = 64) -> dict[str, float]:
    """Replica batches per second of each stage alone, in order: `read` (the epoch's
    items: indices, or raw records from the files), `decode` (examples made from them),
    `augment` (with data.augment's per-example ops; only when there are some) and
    `pipeline` (everything training gets, batched, weighed and prefetched). Each stage is
    read for `seconds` or `most` batches, whichever comes first."""
    layout = epoch_layout(source, plan, cfg)
    b, pad = plan.replica_batch, cfg.remainder == "pad"
    items = source.epoch(seed, 0, layout, 0, 0, cfg.shuffle, b).repeat()     # epoch 0, again
    decoded = (items.map(lambda i: source.decode_batch(i, pad)) if source.vectorised
               else source.decode(items, b, pad))
    stages = {"read": items, "decode": decoded}
    example_ops = [op for op in aug.build(cfg.augment) if not op.batch]
    if example_ops:
        stages["augment"] = train_dataset(source, plan, cfg, seed, ops=example_ops)
    stages["pipeline"] = train_dataset(source, plan, cfg, seed)
    return {name: _rate(ds, seconds, most) for name, ds in stages.items()}


def _rate(ds: tf.data.Dataset, seconds: float, most: int) -> float:
    it = iter(ds)
    next(it)                                   # the first element starts the threads
    n, start = 0, time.perf_counter()
    while n < most and time.perf_counter() - start < seconds:
        next(it)
        n += 1
    return n / max(time.perf_counter() - start, 1e-9)


def slowest(rates: dict[str, float], step_rate: float) -> str:
    """One line: each stage's rate against the step's, and which stage limits input (the
    first whose rate falls below the step's and well below the stage before it), or that
    none does alone (the pipeline and the step then share the cores)."""
    listed = ", ".join(f"{name} {rate:,.0f}" for name, rate in rates.items())
    line = f"timed alone, the input stages give {listed} batches/s against the steps' {step_rate:,.0f}"
    before, slow = float("inf"), None
    for name, rate in rates.items():
        if rate < step_rate and rate < 0.5 * before:
            slow = name
            break
        before = rate
    if slow is None:
        return line + ": no stage is slower than the steps alone (they share the cores)"
    return line + f": {slow} is the slow stage"
