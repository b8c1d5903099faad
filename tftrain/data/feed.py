"""The device feed: a training set held in memory is copied once to every replica's
device, and each step gathers its batch there, inside the train step, instead of taking
it from an input pipeline.

A host pipeline hands each replica its batch through tf.data and a distributed iterator:
per batch, a dataset element made on the host's threads, a multi-device iterator's
buffers, and a copy to the device. For a small model that is as long as the step: the MLP
on digits spent 0.6 ms per batch waiting on input against 0.4 ms computing, and ran 0.5x
as fast as plain `model.fit` (benchmarks/overhead.py). The feed leaves only what the
order needs: each epoch's permutation, drawn once per epoch from (seed, epoch) as the host
pipeline draws it (`IndexedSource.slot_indices`), a slice of it per replica and step, and
one gather on the device. Padding weights, example seeds and batch ops (mixup, cutmix) are
the host pipeline's own (`pipeline.Batcher`), so both give the same batches, bit for bit,
from any update (a resumed run starts the feed's cursor there).

Chosen by `data.feed` (`choose`): `auto` feeds from the device when the source is in
memory, no per-example augmentation runs (those run per example on the host's threads),
no tf.data service is configured, and one copy per device fits the budget.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError, DataConfig
from tftrain.data import augment as aug
from tftrain.data.batching import BatchPlan
from tftrain.data.pipeline import Batcher, cache_choice, decoded_bytes, epoch_layout
from tftrain.data.source import IndexedSource, Source

# the share of a device's memory `auto` lets one copy of the training set take
DEVICE_SHARE = 0.125


@dataclass(frozen=True)
class FeedChoice:
    """Where the training batches come from, and why (the plan's `feed:` line)."""
    device: bool
    reason: str

    def line(self) -> str:
        return f"feed: {'device' if self.device else 'host'} ({self.reason})"
    # (the plan prints it on its cache line: `pipeline.describe`)


def choose(source: Source, cfg: DataConfig, device_memory: float | None,
           replicas_per_host: int) -> FeedChoice:
    """`data.feed` for this source: `device` (refused, with the reason, where the feed
    cannot serve it), `host`, or `auto`. `device_memory`: bytes of one training device
    (None: host memory, where `data.cache_budget` already bounds the copies)."""
    why_not = _obstacle(source, cfg)
    size = decoded_bytes(source)
    if why_not is None:
        limit = (DEVICE_SHARE * device_memory if device_memory
                 else cfg.cache_budget / max(1, replicas_per_host))
        if size > limit:
            why_not = (f"a copy of the {_size(size)} training set per device is over "
                       f"{_size(limit)}" + (f" ({DEVICE_SHARE:.1%} of a device)" if device_memory
                                            else " (data.cache_budget / replicas)"))
    if cfg.feed == "host":
        return FeedChoice(False, "data.feed: host")
    if why_not is not None:
        if cfg.feed == "device":
            raise ConfigError(f"data.feed: device cannot serve this run: {why_not}; set "
                              "data.feed: auto or host")
        return FeedChoice(False, why_not)
    return FeedChoice(True, f"the {_size(size)} training set on each replica's device, batches "
                            "gathered in the step")


def _size(n: float) -> str:
    return f"{n / 2**10:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


def _obstacle(source: Source, cfg: DataConfig) -> str | None:
    if cache_choice(source, cfg) != "memory":
        return "the training set is read from files as it trains (data.cache: memory holds it)"
    if cfg.service is not None:
        return "data.service runs the input pipeline on tf.data service workers"
    per_example = [op.name for op in aug.build(cfg.augment) if not op.batch]
    if per_example:
        return f"data.augment runs {', '.join(per_example)} per example on the host"
    return None


class DeviceFeed:
    """Batches of an in-memory training set, gathered on each replica's device.

    Built eagerly (each device's copy is made once); `indices()` runs in the train
    function's cross-replica context once per step, and `batch(...)` in each replica."""

    def __init__(self, source: IndexedSource, plan: BatchPlan, cfg: DataConfig, seed: int, *,
                 devices: list[str], strategy, start_update: int = 0):
        """`devices`: this worker's replica devices, in the strategy's order; which worker
        this is comes from the strategy (its replicas' places in the cluster)."""
        self.strategy = strategy
        ids = strategy.experimental_local_results(
            strategy.experimental_distribute_values_from_function(
                lambda ctx: ctx.replica_id_in_sync_group))
        worker, workers = int(ids[0]) // len(devices), strategy.num_replicas_in_sync // len(devices)
        self.source, self.seed, self.shuffle, self.worker = source, seed, cfg.shuffle, worker
        self.layout = epoch_layout(source, plan, cfg, workers)
        self.batcher = Batcher(source, plan, cfg, seed, self.layout, worker, aug.build(cfg.augment))
        self.steps, self.share, self.b = self.layout.steps(), self.layout.share, plan.replica_batch
        self.local = len(devices)           # this worker's replicas, one per device
        x, y = source.load(tf.range(source.num_train, dtype=tf.int32))
        copies = []
        for device in devices:
            with tf.device(device):
                copies.append((tf.identity(x), tf.identity(y)))
        local = self.local
        self.data = strategy.experimental_distribute_values_from_function(
            lambda ctx: copies[ctx.replica_id_in_sync_group % local])
        self.host = _host_of(devices[0])
        with tf.device(self.host):
            self.order = tf.Variable(np.zeros(self.steps * self.share, np.int32),
                                     trainable=False, name="feed_order")
            self.loaded = tf.Variable(-1, dtype=tf.int64, trainable=False, name="feed_epoch")
            self.cursor = tf.Variable(start_update, dtype=tf.int64, trainable=False,
                                      name="feed_cursor")

    @property
    def bytes_per_device(self) -> int:
        return int(self.source.decoded_bytes)

    def stand_in(self):
        """What `fit` is given: an endless dataset of nothing (the train function reads the
        feed, not the iterator)."""
        options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
        return self.strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_tensors(tf.constant(0)).repeat(), options)

    def start_at(self, update: int) -> None:
        """The next step trains update `update` (a stage's start, a rollback)."""
        self.cursor.assign(update)

    def indices(self):
        """Cross-replica, once per step: (epoch, update in the epoch) of the next batch,
        the epoch's order loaded when the epoch changes, and the cursor moved on."""
        with tf.device(self.host):
            k = self.cursor.read_value()
            e, u = k // self.steps, k % self.steps

            def load():
                slots = self.source.slot_indices(self.seed, e, self.layout, self.worker,
                                                 self.shuffle)
                with tf.control_dependencies([self.order.assign(slots)]):
                    return self.loaded.assign(e)

            ready = tf.cond(tf.equal(self.loaded, e), lambda: tf.identity(self.loaded), load)
            with tf.control_dependencies([ready, self.cursor.assign_add(1)]):
                return tf.identity(e), tf.identity(u)

    def batch(self, e, u, data):
        """In a replica: its batch of update u of epoch e, gathered from `data` (its
        device's copy, `self.data`), finished as the host pipeline finishes it."""
        r = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group % self.local,
                    tf.int64)
        k = u * (self.share // self.b) + r                 # the batch's index in the epoch
        with tf.device(self.host):
            idx = self.order[k * self.b:(k + 1) * self.b]
        x, y = data
        real = idx >= 0
        safe = tf.maximum(idx, 0)
        x, y = tf.gather(x, safe), tf.gather(y, safe)
        if self.batcher.pad:                               # padding slots: zeros, label 0
            mask = tf.reshape(real, [-1] + [1] * (len(x.shape) - 1))
            x, y = tf.where(mask, x, tf.zeros_like(x)), tf.where(real, y, tf.zeros_like(y))
        return self.batcher.batch(e, k, x, y, real)


def _host_of(device: str) -> str:
    """The CPU of the host `device` is on (where the order and cursor live)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()
