"""The input pipeline: epochs in order, padding and weights, augmentation, batches,
distribution, caching and tf.data service.

Each worker builds its own pipeline (`distribute_datasets_from_function`): its slots of
every update (`EpochLayout`), one replica batch per element, consecutive elements to its
consecutive replicas. Epoch e's order is a pure function of (seed, e), and a run that
resumes at update k builds the pipeline from update k directly (`Source.epoch` starts
anywhere without replaying the epoch), so resuming costs the same at any position.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError, DataConfig
from tftrain.data import augment as aug
from tftrain.data.batching import BatchPlan, EpochLayout
from tftrain.data.source import IndexedSource, Source
from tftrain.data.service import spread
from tftrain.data.arrays import array_source


def epoch_layout(source: Source, plan: BatchPlan, cfg: DataConfig, workers: int = 1,
                 streams: int | None = None) -> EpochLayout:
    """How an epoch fills updates for this source, batch plan and number of workers.
    `streams`: the file streams a resumed run began with (`EpochLayout`); 1 for a file
    source the run holds in memory (`cached`), which every worker then shares."""
    layout = source.layout(plan.global_batch, workers, cfg.remainder == "pad", cfg.shard_policy,
                           streams)
    layout.steps(plan)       # a dataset smaller than one update: a config error now
    return layout


def _options() -> tf.data.Options:
    options = tf.data.Options()
    # tftrain shards itself (each worker reads only its slots or files).
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.deterministic = True   # same batches in the same order on every run
    return options


def example_seed(seed: int, epoch, key):
    """Stateless seed of one example: (run seed, epoch, the example's place in the epoch:
    `EpochLayout.slot_key`, its stream and position there), so an example is augmented
    alike whatever the number of workers."""
    hi = tf.cast(seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64)
    key = tf.cast(key, tf.int64)
    return tf.stack([hi + tf.zeros_like(key), key], axis=-1)


class Batcher:
    """What makes a batch of pipeline `worker`'s slots of an epoch into what a replica
    trains on: padding weights, per-example seeds and batch ops (mixup, cutmix). The host
    pipeline (`train_dataset`) and the device feed (`feed.DeviceFeed`) share it, so both
    give the same batches."""

    def __init__(self, source: Source, plan: BatchPlan, cfg: DataConfig, seed: int,
                 layout: EpochLayout, worker: int, ops: list):
        self.seed, self.layout, self.worker = seed, layout, worker
        self.steps, self.share = layout.steps(), layout.share
        self.weights = tf.constant(layout.weights())
        self.example_ops = [op for op in ops if not op.batch]
        self.batch_ops = [op for op in ops if op.batch]
        self.classes = source.spec.num_classes
        self.b = plan.replica_batch
        self.micro = plan.per_replica        # the examples one forward pass of the step takes
        self.pad = cfg.remainder == "pad"
        self.seeded = bool(ops)

    def label(self, e, j, x, y, real):
        """Weights and example seeds of the slots j of epoch e (a batch or one example;
        only what is used: weights with padding, seeds with augmentation)."""
        w = (tf.where(real, tf.gather(self.weights, tf.minimum(j // self.share, self.steps - 1)),
                      0.0) if self.pad else None)
        s = example_seed(self.seed, e, self.layout.slot_key(self.worker, j)) if self.seeded else None
        return x, tf.one_hot(y, self.classes) if self.batch_ops else y, w, s

    def finish(self, x, y, w, s):
        b, micro = self.b, self.micro
        if self.batch_ops and w is None:
            w = tf.ones([b])          # pairs are never padding without data.remainder: pad
        if self.batch_ops:
            # batch ops (mixup, cutmix) pair examples within each micro-batch, seeded by its
            # first example's place in the epoch: the same pairs and draws on any number of
            # replicas or workers with the same micro-batch (a mirrored step and one device
            # accumulating its replicas' micro-batches; an elastic resume)
            parts = []
            for k in range(b // micro):
                part = slice(k * micro, (k + 1) * micro)
                px, py, pw = x[part], y[part], w[part]
                for i, op in enumerate(self.batch_ops):
                    px, py, pw = op.fn(px, py, pw, tf.random.experimental.stateless_fold_in(
                        s[k * micro], 100 + i))
                parts.append((px, py, pw))
            x, y, w = (tf.concat(t, 0) for t in zip(*parts))
        return (x, y, w) if self.pad else (x, y)

    def batch(self, e, k, x, y, real):
        """Batch k of epoch e (its examples decoded: `(x, y, real)`), finished."""
        j = k * self.b + tf.range(self.b, dtype=tf.int64)
        return self.finish(*self.label(e, j, x, y, real))


def train_dataset(source: Source, plan: BatchPlan, cfg: DataConfig, seed: int,
                  start_update: int = 0, pipeline: tuple[int, int] = (0, 1),
                  ops: Optional[list] = None, streams: int | None = None) -> tf.data.Dataset:
    """Endless replica batches for input pipeline `worker` of `workers` (`pipeline`),
    beginning at update `start_update`:
    each update takes `plan.replicas / workers` consecutive elements of `plan.replica_batch`
    examples. Elements are `(x, y)`, or `(x, y, weight)` with `data.remainder: pad`.
    `streams`: as for `epoch_layout`."""
    worker, workers = pipeline
    ops = aug.build(cfg.augment) if ops is None else ops
    layout = epoch_layout(source, plan, cfg, workers, streams)
    batcher = Batcher(source, plan, cfg, seed, layout, worker, ops)
    steps, share, b, pad = batcher.steps, batcher.share, batcher.b, batcher.pad
    example_ops, batch_ops, classes = batcher.example_ops, batcher.batch_ops, batcher.classes
    label, finish = batcher.label, batcher.finish

    def epoch(e, start, part, parts):
        items = source.epoch(seed, e, layout, worker, start, cfg.shuffle, b)
        if parts > 1:              # a tf.data service part: every parts-th batch, undecoded
            items = items.shard(parts, part)
        first = start * share // b + part          # index of the first batch in the epoch
        if not example_ops:        # vectorised: decode, weigh and finish whole batches
            if source.vectorised:  # in memory: one function per batch, from index to batch
                return tf.data.Dataset.zip(tf.data.Dataset.range(first, 2**62, parts), items).map(
                    lambda k, i: batcher.batch(e, k, *source.decode_batch(i, pad)),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            ds = tf.data.Dataset.zip(tf.data.Dataset.range(first, 2**62, parts),
                                     source.decode(items, b, pad))
            return ds.map(lambda k, batch: batcher.batch(e, k, *batch))
        # per example: decoding and augmentation fused in one parallel map, order kept;
        # each slot's weight and seed computed a batch at a time beforehand
        def slot_info(k):
            _, _, w, seeds = label(e, k * b + tf.range(b, dtype=tf.int64), 0, 0, True)
            return (w if pad else tf.ones([b])), seeds

        def one(info, item):
            w, seeds = info
            x, y, real = source.decode_one(item)
            for i, op in enumerate(example_ops):
                x = op.fn(x, tf.random.experimental.stateless_fold_in(seeds, i))
            w = tf.where(real, w, 0.0) if pad else None
            return x, tf.one_hot(y, classes) if batch_ops else y, w, seeds

        info = tf.data.Dataset.range(first, 2**62, parts).map(slot_info).unbatch()
        ds = tf.data.Dataset.zip(info, items.unbatch()).map(
            one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.batch(b).map(finish)

    first, skip = divmod(start_update, steps)

    def stream(part=0, parts=1):
        if source.starts_in_graph:
            # one flat_map over epochs, the first starting at `skip`: measured, the resumed
            # epoch concatenated in front of the others made the MLP's steps on digits
            # 0.6x as fast under fit (benchmarks/input.py)
            return tf.data.Dataset.range(first, 2**62).flat_map(lambda e: epoch(
                e, tf.where(e == first, tf.constant(skip, tf.int64), 0), part, parts)
            ).with_options(_options())
        return epoch(first, skip, part, parts).concatenate(tf.data.Dataset.range(
            first + 1, 2**62).flat_map(lambda e: epoch(e, 0, part, parts))).with_options(_options())

    if cfg.service is None:
        ds = stream()
    else:           # the same batches, decoded and augmented on tf.data service workers
        per_epoch = steps * share // b
        ds = spread(stream, cfg.service.dispatchers, per_epoch, per_epoch - skip * share // b)
    # The stream never ends; saying so spares a cluster an all-reduce per step: for input of
    # unknown size, a multi-worker iterator asks every worker whether it still has data.
    ds = ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options())


def distribute(strategy, source: Source, plan: BatchPlan, cfg: DataConfig, seed: int,
               start_update: int = 0, streams: int | None = None):
    """The training input for `fit`: one pipeline per worker, from `start_update`."""
    ops = aug.build(cfg.augment)

    def per_worker(context: tf.distribute.InputContext):
        return train_dataset(source, plan, cfg, seed, start_update,
                             (context.input_pipeline_id, context.num_input_pipelines), ops,
                             streams)

    # Prefetching onto accelerators overlaps the host-to-device copy with the step; for
    # CPU devices it only adds a copy (measured: about 10% of the quickstart's step).
    try:
        devices = strategy.extended.worker_devices
    except RuntimeError:        # the default strategy: the default device
        devices = [d.name for d in tf.config.list_logical_devices("GPU")[:1]]
    on_gpu = any("GPU" in d.upper() or "TPU" in d.upper() for d in devices)
    options = tf.distribute.InputOptions(experimental_fetch_to_device=on_gpu)
    return strategy.distribute_datasets_from_function(per_worker, options)


def label_spec(source: Source, cfg: DataConfig) -> tf.TensorSpec:
    """The spec of the training batches' labels without building their pipeline (its
    functions traced: about half a second of a small run): class indices as every source
    decodes them (int32), or one-hot probabilities where a batch op of `data.augment`
    (mixup, cutmix) makes soft labels."""
    if aug.soft_labels(aug.build(cfg.augment)):
        return tf.TensorSpec([None, source.spec.num_classes], tf.float32)
    return tf.TensorSpec([None], tf.int32)


def val_dataset(source: Source, plan: BatchPlan, cfg: Optional[DataConfig] = None) -> tf.data.Dataset:
    """Validation batches of per_replica x replicas (the last one may be partial), with
    the deterministic preprocessing steps only."""
    ds = preprocess(source.validation(), cfg).batch(plan.per_replica * plan.replicas)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    options.deterministic = True
    return ds.cache().prefetch(tf.data.AUTOTUNE).with_options(options)


def preprocess(ds: tf.data.Dataset, cfg: Optional[DataConfig]) -> tf.data.Dataset:
    """`(x, y)` examples through the deterministic steps of `data.augment` (what
    validation, calibration and exported models get)."""
    steps = [op for op in aug.build(cfg.augment) if op.deterministic] if cfg else []
    if not steps:
        return ds

    def apply(x, y):
        for op in steps:
            x = op.fn(x)
        return x, y
    return ds.map(apply, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def describe(source: Source, layout: EpochLayout, cfg: DataConfig, feed=None) -> str:
    """The data lines of the plan: source, shuffle, cache (and the feed: `feed.FeedChoice`),
    sharding, remainder, augment."""
    cached = cache_choice(source, cfg)
    lines = [f"input: {source.describe(layout, cfg)}",
             f"cache: memory: {feed.reason} (data.feed: {cfg.feed})" if feed and feed.device else
             f"cache: {cached} (data.cache: {cfg.cache}, budget {cfg.cache_budget / 2**20:,.0f} "
             f"MiB for {decoded_bytes(source) / 2**20:,.1f} MiB decoded)"
             + (f"; fed from the host: {feed.reason}" if feed and cached == "memory" else "")]
    if layout.workers > 1:
        how = (f"FILE: each worker reads its own files ({layout.workers} workers, "
               f"{layout.streams} file streams)" if not layout.shared_stream else
               f"DATA: each worker takes its share of every update ({layout.workers} workers)")
        lines.append(f"sharding: {how}")
    if layout.pad:
        padding = layout.slots() * layout.workers - layout.total
        lines.append(f"remainder: pad ({padding} padding slots per epoch, weighted 0)")
    else:
        lost = layout.dropped()
        lines.append(f"remainder: drop ({lost} of {layout.total} examples per epoch unused)")
        if lost > 0.05 * layout.total:
            lines.append(f"warning: data.remainder: drop loses {lost / layout.total:.0%} of each "
                         "epoch; set data.remainder: pad to use every example")
    ops = aug.build(cfg.augment)
    if ops:
        lines.append("augment: " + ", ".join(op.name for op in ops))
    return "\n".join(lines)


# --- caching --------------------------------------------------------------------------
def cache_choice(source: Source, cfg: DataConfig) -> str:
    """`memory` or `none` for this source: `auto` holds the decoded training set in memory
    only when it fits `data.cache_budget`."""
    in_memory = isinstance(source, IndexedSource) and not source.elementwise
    if in_memory:
        return "memory"
    size = decoded_bytes(source)
    if cfg.cache == "memory":
        if size > cfg.cache_budget:
            raise ConfigError(f"data.cache: memory needs {size / 2**20:,.0f} MiB for the decoded "
                              f"training set, above data.cache_budget ({cfg.cache_budget / 2**20:,.0f}"
                              " MiB); raise the budget or set data.cache: auto or none")
        return "memory"
    if cfg.cache == "auto":
        return "memory" if size <= cfg.cache_budget else "none"
    return "none"


def decoded_bytes(source: Source) -> int:
    """Bytes of the decoded training set (what holding it in memory costs)."""
    if isinstance(source, IndexedSource) and source.decoded_bytes:
        return source.decoded_bytes
    return source.num_train * (int(np.prod(source.spec.shape)) * 4 + 4)


def holds_arrays(source: Source) -> bool:
    """Whether the source is its training arrays, held in memory (`array_source`)."""
    return isinstance(source, IndexedSource) and not source.elementwise


def decodes(source: Source, cfg: DataConfig) -> bool:
    """Whether `cached` decodes the training set into memory (arrays already are)."""
    return cache_choice(source, cfg) == "memory" and not holds_arrays(source)


def decoded_later(source: Source, cfg: DataConfig) -> int:
    """Bytes `cached` will add to memory once the run starts (0 where it adds none)."""
    return decoded_bytes(source) if decodes(source, cfg) else 0


def cached(source: Source, cfg: DataConfig) -> Source:
    """The source with its decoded training set in memory when `cache_choice` says so
    (one parallel pass in file order; epochs then permute indices of the arrays)."""
    if not decodes(source, cfg):
        return source

    parts = list(source.calibration(source.num_train).batch(1024).as_numpy_iterator())
    x, y = (np.concatenate(p) for p in zip(*parts))
    return array_source(x, y, source.validation(), source.num_val, source.spec,
                        kind=f"{getattr(source, 'kind', 'data')}, decoded once into memory")
