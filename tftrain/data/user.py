"""Bring your own data: `data.name: package.module:function`.

The function takes `data.params` as keyword arguments (and `seed` if it declares it) and
returns `UserData` (or a `(train, validation)` pair of `tf.data.Dataset`s of unbatched
`(x, y)` examples). tftrain then shards, shuffles (windows of `data.shuffle_buffer`,
seeded per epoch), pads, augments, batches and distributes them like its own sources.

The train dataset must yield the same examples in the same order each time it is
iterated (shuffling is tftrain's). A resumed epoch skips to the start of its shuffle
window through your dataset: `skip` is free for `from_tensor_slices`/`range`-based
pipelines; for one that reads files, use the `tfrecord` or `image_folder` sources,
which resume without reading what comes before.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError, DataConfig
from tftrain.data.source import InputSpec, Source, padded, shard_updates, window_shuffle
from tftrain.core.registry import import_function


@dataclass(frozen=True)
class UserData:
    """What a user dataset function returns. `spec` and `num_train` are read from the
    data when missing (one pass over the training set at start)."""
    train: tf.data.Dataset
    validation: tf.data.Dataset
    spec: Optional[InputSpec] = None
    num_train: Optional[int] = None


class UserSource(Source):
    def __init__(self, data: UserData, name: str, window: int):
        self.data, self.name, self.window = data, name, window
        self.spec, self.num_train = data.spec, data.num_train
        self.num_val = _count(data.validation)[0]

    def validation(self):
        return self.data.validation

    def calibration(self, n):
        return self.data.train.take(n)

    def epoch(self, seed, epoch, layout, worker, start_update, shuffle, batch):
        position = start_update * layout.global_batch
        aligned = (position // self.window) * self.window if shuffle else position
        stream = self.data.train.skip(aligned)
        if shuffle:
            stream = window_shuffle(stream, seed, epoch, position, self.window)
        stream = stream.map(lambda x, y: (x, tf.cast(y, tf.int32)))
        stream = padded(stream, self.spec, (layout.steps() - start_update) * layout.global_batch)
        return shard_updates(stream, layout, worker, batch)

    def decode(self, items, batch, padded=True):
        return items           # your pipeline decodes; its examples are the items

    def decode_one(self, item):
        return item

    def describe(self, layout, cfg) -> str:
        how = f"windows of {self.window} permuted per epoch" if cfg.shuffle else "your order"
        return f"{self.name} (your tf.data pipeline); shuffle: {how}"


def _count(ds: tf.data.Dataset, labels: bool = False):
    """(examples, largest label or None) of a finite dataset of (x, y); a pass over it
    when its size is unknown or `labels` are wanted."""
    n = int(ds.cardinality())
    if n >= 0 and not labels:
        return n, None
    if n == tf.data.INFINITE_CARDINALITY:
        raise ConfigError("data.name: the dataset function returned an infinite dataset; "
                          "return one epoch (no .repeat()), tftrain repeats it")
    total, top = ds.reduce((np.int64(0), np.int64(-1)), lambda acc, e: (
        acc[0] + 1, tf.maximum(acc[1], tf.cast(tf.reduce_max(e[1]), tf.int64))))
    return int(total), int(top)


def _check_element(ds, what: str, name: str) -> None:
    spec = ds.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2 and
            all(isinstance(s, tf.TensorSpec) for s in spec)):
        raise ConfigError(f"data.name: {name} returned a {what} dataset of {spec}; expected "
                          "unbatched (x, y) pairs of tensors")
    if spec[1].shape.rank != 0 or not spec[1].dtype.is_integer:
        raise ConfigError(f"data.name: {name}: {what} labels are {spec[1]}; expected integer "
                          "class indices, one scalar per example (unbatched)")


def user_source(cfg: DataConfig, seed: int) -> UserSource:
    fn = import_function(cfg.name, "data.name")
    params = dict(cfg.params)
    if "seed" in inspect.signature(fn).parameters:
        params["seed"] = seed
    result = fn(**params)           # a bug in it is the user's: runtime error, traceback
    if isinstance(result, tuple) and len(result) == 2:
        result = UserData(*result)
    if not isinstance(result, UserData) or not all(
            isinstance(d, tf.data.Dataset) for d in (result.train, result.validation)):
        raise ConfigError(f"data.name: {cfg.name} returned {type(result).__name__}; expected "
                          "tftrain.data.UserData(train, validation, ...) or a (train, "
                          "validation) pair of tf.data.Dataset")
    _check_element(result.train, "train", cfg.name)
    _check_element(result.validation, "validation", cfg.name)
    spec = result.spec
    num, top = (result.num_train, None) if result.num_train and spec else \
        _count(result.train, labels=spec is None)
    if num == 0:
        raise ConfigError(f"data.name: {cfg.name} returned an empty train dataset")
    if spec is None:
        x_spec = result.train.element_spec[0]
        if not x_spec.shape.is_fully_defined():
            raise ConfigError(f"data.name: {cfg.name}: inputs have shape {x_spec.shape}; "
                              "return fixed-shape examples or pass UserData(spec=...)")
        spec = InputSpec(tuple(x_spec.shape), x_spec.dtype.name, top + 1)
    result = UserData(result.train, result.validation, spec, num)
    return UserSource(result, cfg.name, cfg.shuffle_buffer or 10_000)
