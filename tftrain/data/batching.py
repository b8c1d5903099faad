"""The batch arithmetic, in one place: the global batch, and how an epoch fills updates.

`BatchPlan` turns per-replica batch, replicas and accumulation steps into the global
batch. `EpochLayout` says how one epoch's examples fill optimizer updates across the
input pipelines (one per worker): how many updates, which slots hold real examples, how
many examples `remainder: drop` loses, and the weight each real example carries so that
a padded update is the mean over its real examples.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tftrain.config import ConfigError
from tftrain.core.batches import per_replica_batch


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic.

    One optimizer update consumes `accumulation` micro-batches of `per_replica` examples
    on each of `replicas` replicas, so the examples per update (the global batch) are
    per_replica * replicas * accumulation. Each replica receives per_replica *
    accumulation examples per update and `train_step` slices them into `accumulation`
    micro-batches.
    """
    per_replica: int
    replicas: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.per_replica * self.replicas * self.accumulation

    @property
    def replica_batch(self) -> int:
        """Examples one replica receives per optimizer update (all its micro-batches)."""
        return self.per_replica * self.accumulation

    def steps_per_epoch(self, num_train: int) -> int:
        """Full updates in an epoch of `num_train` examples (the last partial dropped)."""
        return EpochLayout((num_train,), 1, self.global_batch, pad=False).steps(self)


def plan_batches(cfg, replicas: int, accumulation: int | None = None) -> BatchPlan:
    """The batch plan; `train.global_batch_size`, when set, must divide evenly.
    `accumulation` overrides the configured steps (the planner's choice to fit memory)."""
    accumulation = accumulation or cfg.train.accumulation_steps
    return BatchPlan(per_replica_batch(cfg, replicas, accumulation), replicas, accumulation)


@dataclass(frozen=True)
class EpochLayout:
    """How an epoch's examples fill updates.

    `sizes` holds the examples of each stream. One stream when every input pipeline
    reads the same one (in-memory and indexed sources, or DATA sharding): update u then
    holds stream positions [u*G, (u+1)*G) and pipeline w takes its contiguous share
    [u*G + w*P, u*G + (w+1)*P) with P = G / workers. With FILE sharding there are S
    streams (stream s: files s, s+S, ...; S is the number of workers the run began
    with) and update u holds positions [u*C, (u+1)*C) of every stream, C = G / S. A
    worker reads S / workers whole streams, or (more workers than streams) its part of
    one stream's chunk, so a run resumed on another number of workers trains on the same
    examples in the same updates.
    A slot past the real examples is padding (`pad`) or does not exist (`drop`: the
    epoch ends at the last update every stream can fill).
    """
    sizes: tuple[int, ...]
    workers: int
    global_batch: int
    pad: bool

    def __post_init__(self):
        streams, workers = len(self.sizes), self.workers
        if streams > 1 and streams % workers and workers % streams:
            raise ConfigError(
                f"data.shard_policy: the run's files are read as {streams} streams (FILE "
                f"sharding over the {streams} workers it began with), which {workers} workers "
                f"cannot split evenly; resume on a number of workers that divides {streams} "
                f"or is a multiple of it")
        if streams > 1 and self.global_batch % streams:
            raise ConfigError(
                f"train.global_batch_size: {self.global_batch} examples per update do not split "
                f"evenly over the {streams} file streams the run's files are read as (FILE "
                f"sharding over the {streams} workers it began with), so each update would "
                f"drop {self.global_batch % streams} of them; use a multiple of {streams}")

    @property
    def share(self) -> int:
        """Slots per update and pipeline (the pipeline's part of the global batch)."""
        return self.global_batch // self.workers

    @property
    def streams(self) -> int:
        return len(self.sizes)

    @property
    def chunk(self) -> int:
        """Slots per update and stream."""
        return self.global_batch // self.streams

    @property
    def shared_stream(self) -> bool:
        return len(self.sizes) == 1

    def streams_of(self, worker: int) -> list[tuple[int, int, int]]:
        """What pipeline `worker` reads: (stream, first slot, slots) of each update's chunk
        of each of its streams, in the order its share of an update lists them."""
        p, c = self.share, self.chunk
        if self.streams >= self.workers:
            k = self.streams // self.workers
            return [(worker * k + i, 0, c) for i in range(k)]
        g = self.workers // self.streams
        return [(worker // g, (worker % g) * p, p)]

    def slot_key(self, worker: int, j):
        """Where slot `j` of pipeline `worker`'s epoch lies, as stream * 2**40 + position
        in the stream (ints or integer tensors): the same example has the same key on any
        number of workers (augmentation seeds use it)."""
        p, c = self.share, self.chunk
        u, r = j // p, j % p
        if self.streams >= self.workers:
            k = self.streams // self.workers
            stream, at = worker * k + r // c, r % c
        else:
            g = self.workers // self.streams
            stream, at = worker // g, (worker % g) * p + r
        return stream * (1 << 40) + u * c + at

    def steps(self, plan: BatchPlan | None = None) -> int:
        c = self.chunk
        steps = max(-(-n // c) for n in self.sizes) if self.pad else min(n // c for n in self.sizes)
        if steps < 1:
            raise ConfigError(
                f"data.per_replica_batch_size: global batch {self.global_batch}"
                + (f" (= {plan.per_replica} per replica x {plan.replicas} replicas x "
                   f"{plan.accumulation} accumulation steps)" if plan else "")
                + f" exceeds the {min(self.sizes)} training examples"
                + (" of a file stream" if not self.shared_stream else "")
                + "; lower the batch size or accumulation steps, or set data.remainder: pad")
        return steps

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def dropped(self) -> int:
        """Examples an epoch never uses (`drop` only)."""
        return self.total - self.real_per_update().sum()

    def real_per_update(self) -> np.ndarray:
        """Real examples in each update of an epoch."""
        u, c = np.arange(self.steps()), self.chunk
        return sum(np.clip(n - u * c, 0, c) for n in self.sizes)

    def weights(self) -> np.ndarray:
        """Weight of a real example in each update: G / real examples. The loss averages
        over all G slots (padding weighs 0), so the update is the mean over the real
        examples, across replicas and micro-batches, without another all-reduce."""
        return (self.global_batch / self.real_per_update()).astype(np.float32)

    def slots(self) -> int:
        """Slots per pipeline and epoch."""
        return self.steps() * self.share
