"""Sources: what a dataset is to tftrain, and the registry that builds them by name.

A source yields the examples of an epoch in the order of that epoch, from any position,
without reading what comes before it, for one input pipeline (worker):

- `IndexedSource`: examples addressed by index (arrays in memory, image files, a
  decoded cache). Epoch e is a permutation of the indices drawn from (seed, e); a
  pipeline takes its slots of each update and starts anywhere by slicing.
- `RecordSource` (in `records.py`): examples in record files read sequentially (TFRecord,
  TFDS). Epoch e shuffles the files, interleaves a few at a time and permutes windows of
  records; a resumed epoch starts at the window holding its position, with each open file
  skipped to its offset, so resuming costs at most a window and a file, never the epoch.

Examples come out decoded and undistorted (`(x, y)`); augmentation, padding, batching and
distribution are the pipeline's (`pipeline.py`).
"""
from __future__ import annotations

import abc

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError, DataConfig
from tftrain.data.batching import EpochLayout
from tftrain.core.registry import Registry


@dataclass(frozen=True)
class InputSpec:
    """What a model builder needs to know about its input."""
    shape: tuple[int, ...]
    dtype: str
    num_classes: int
    vocab_size: Optional[int] = None
    sample_rate: Optional[int] = None     # audio: samples per second of the waveform
    serving: Optional["Serving"] = None   # raw input served in front of the model (text)
    tokens: Optional["TokenStatistics"] = None   # token ids' training statistics (text)


@dataclass(frozen=True, eq=False)
class TokenStatistics:
    """What the training split says of token ids, for models that weigh them (TF-IDF):
    `groups`, the first id of each tokenizer's ids (words, then character n-grams; each
    group's weights are normalized on their own, as stacked TF-IDF vectorizers are);
    `documents`, the training texts; `frequency[i]`, how many of them hold id i."""
    groups: tuple[int, ...]
    documents: int
    frequency: np.ndarray

    def idf(self) -> np.ndarray:
        """Smoothed inverse document frequency, scikit-learn's: ln((1 + n) / (1 + df)) + 1."""
        return (np.log((1.0 + self.documents) / (1.0 + self.frequency)) + 1.0).astype(np.float32)


@dataclass(frozen=True, eq=False)
class Serving:
    """What the exported SavedModel takes instead of the model's input: `layer` maps a
    batch of raw inputs (e.g. strings) to the model's input (e.g. token ids);
    `validation` holds the raw validation inputs, in validation's order."""
    layer: object
    spec: tuple                 # (shape without batch, dtype) of one raw input
    validation: np.ndarray
    kind: str                   # what the raw input is, for the report


def epoch_seed(seed, epoch):
    """The stateless seed of epoch `epoch` (a pure function: the same on every run)."""
    return tf.stack([tf.cast(seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64),
                     tf.constant(0x7F4A7C15, tf.int64)])


def permutation(n: int, seed, epoch):
    """Epoch `epoch`'s order of n indices (int32), drawn from (seed, epoch)."""
    keys = tf.random.stateless_uniform([n], epoch_seed(seed, epoch), minval=None, maxval=None,
                                       dtype=tf.int64)
    return tf.argsort(keys, stable=True)


class Source(abc.ABC):
    """Base of every source: its input spec, sizes, validation examples and epochs."""

    spec: InputSpec
    num_train: int
    num_val: int

    @abc.abstractmethod
    def validation(self) -> tf.data.Dataset:
        """Validation examples `(x, y)`, unbatched, in a fixed order."""

    @abc.abstractmethod
    def calibration(self, n: int) -> tf.data.Dataset:
        """The first n training examples in file order (int8 calibration)."""

    def layout(self, global_batch: int, workers: int, pad: bool, policy: str,
               streams: int | None = None) -> EpochLayout:
        """How an epoch fills updates: one stream every pipeline shares (file sources may
        give each worker its own, `streams` of them)."""
        return EpochLayout((self.num_train,), workers, global_batch, pad)

    @abc.abstractmethod
    def epoch(self, seed: int, epoch, layout: EpochLayout, worker: int, start_update,
              shuffle: bool, batch: int) -> tf.data.Dataset:
        """Pipeline `worker`'s slots of epoch `epoch` from update `start_update` on, as
        batches of `batch` items (which divides the pipeline's share of an update): cheap
        references to examples (indices, raw records) that `decode` turns into them."""

    def decode(self, items: tf.data.Dataset, batch: int, padded: bool = True) -> tf.data.Dataset:
        """Batches of items -> batches of `(x, y, real)`; `real` is False for padding
        slots (x zeros, y 0; `padded`: the items may hold some)."""
        return items.unbatch().map(self.decode_one, num_parallel_calls=tf.data.AUTOTUNE,
                                   deterministic=True).batch(batch)

    @abc.abstractmethod
    def decode_one(self, item):
        """One item -> `(x, y, real)` (for per-example work fused with decoding)."""

    vectorised = False      # `decode_batch` exists: a batch decodes in one function

    # `epoch` takes `start_update` as a tensor: the pipeline then starts every epoch, the
    # resumed one included, inside one `flat_map` (a resumed epoch concatenated in front
    # of the rest costs every epoch's batches more, see `pipeline.train_dataset`)
    starts_in_graph = False

    def decode_batch(self, items, padded: bool):
        """A batch of items -> `(x, y, real)` in one function (in-memory sources);
        `padded`: the batch may hold padding slots. By default, item by item."""
        return tf.map_fn(self.decode_one, items, fn_output_signature=(
            tf.TensorSpec(self.spec.shape, self.spec.dtype), tf.int32, tf.bool))

    @abc.abstractmethod
    def describe(self, layout: EpochLayout, cfg: DataConfig) -> str:
        """The plan's line about this source and its order."""


@dataclass(frozen=True, eq=False)
class IndexedSource(Source):
    """Examples addressed by index: `load(indices)` returns `(x, y)` for a vector of
    training indices; the order of an epoch is a permutation of all of them."""
    spec: InputSpec
    num_train: int
    num_val: int
    load: Callable                       # int32 [k] -> (x [k, ...], y [k]); or per index
    val: tf.data.Dataset                 # (x, y) unbatched
    kind: str = "arrays in memory"
    elementwise: bool = False            # load takes one index (a file decode), in parallel
    decoded_bytes: int = 0               # bytes of the decoded training set

    def validation(self) -> tf.data.Dataset:
        return self.val

    def calibration(self, n: int) -> tf.data.Dataset:
        idx = tf.data.Dataset.range(min(n, self.num_train)).map(lambda i: tf.cast(i, tf.int32))
        if self.elementwise:
            return idx.map(self.load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return idx.batch(64).map(self.load).unbatch()

    def slot_indices(self, seed, epoch, layout: EpochLayout, worker: int, shuffle: bool):
        """Index of each of the pipeline's slots in the epoch (-1: padding)."""
        n, g, share = self.num_train, layout.global_batch, layout.share
        order = permutation(n, seed, epoch) if shuffle else tf.range(n, dtype=tf.int32)
        steps = layout.steps()
        slots = steps * g
        order = tf.concat([order, -tf.ones([max(slots - n, 0)], tf.int32)], 0)[:slots]
        return tf.reshape(tf.reshape(order, [steps, layout.workers, share])[:, worker], [-1])

    starts_in_graph = True

    def epoch(self, seed, epoch, layout, worker, start_update, shuffle, batch):
        idx = self.slot_indices(seed, epoch, layout, worker, shuffle)[start_update * layout.share:]
        return tf.data.Dataset.from_tensor_slices(idx).batch(batch)

    def decode(self, items, batch, padded=True):
        if self.elementwise and padded:    # one file per example: decoded in parallel, in order
            return super().decode(items, batch)
        if self.elementwise:               # no padding slot: no branch per example
            return items.unbatch().map(lambda i: (*self.load(i), True),
                                       num_parallel_calls=tf.data.AUTOTUNE,
                                       deterministic=True).batch(batch)
        return items.map(self._load_padded)                  # one gather per batch

    @property
    def vectorised(self) -> bool:
        return not self.elementwise

    def decode_batch(self, items, padded):
        if not padded:
            return (*self.load(items), True)
        return self._load_padded(items)

    def decode_one(self, i):
        def load():
            if self.elementwise:
                return (*self.load(i), True)
            x, y = self.load(tf.reshape(i, [1]))
            return x[0], y[0], True
        zeros = (tf.zeros(self.spec.shape, self.spec.dtype), tf.constant(0, tf.int32), False)
        return tf.cond(i >= 0, load, lambda: zeros)

    def _load_padded(self, idx):
        real = idx >= 0
        x, y = self.load(tf.maximum(idx, 0))
        mask = tf.reshape(real, tf.concat([tf.shape(real), tf.ones([len(x.shape) - len(real.shape)],
                                                                    tf.int32)], 0))
        return tf.where(mask, x, tf.zeros_like(x)), tf.where(real, y, tf.zeros_like(y)), real

    def describe(self, layout, cfg) -> str:
        order = "a permutation of all examples per epoch" if cfg.shuffle else "file order"
        return f"{self.kind}; shuffle: {order} (index-based, resumes without replay)"


# --- registry ------------------------------------------------------------------------
DATASETS: Registry[Callable[..., Source]] = Registry("dataset", "data.name")


# the recipes' data, made here (configs/speech_digits.yaml, configs/text_classification.yaml)
RECIPE_DATA = {"speech_digits": "python scripts/make_speech_digits.py --out {path}",
               "fortunes": "python scripts/make_fortunes_text.py --out {path}"}


def options(kind: type):
    """A loader whose `data.params` are the fields of the frozen dataclass `kind`: it is
    called `loader(fraction, seed, kind(**params))`, and `data.params` are checked against
    the fields."""
    def mark(loader):
        loader.options = kind
        return loader
    return mark


def existing(path, key: str) -> Path:
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        make = RECIPE_DATA.get(p.name)
        raise ConfigError(f"{key}: {path} does not exist; " + (
            f"make it first: {make.format(path=path)}" if make else
            "give the path of your data"))
    return p


def window_shuffle(stream, seed, epoch, position: int, window: int):
    """`stream` (epoch order before mixing) permuted in windows of `window` elements,
    window j with the stateless seed (seed, epoch, j); starts at `position`, which the
    caller has aligned `stream` to the start of its window."""
    base = epoch_seed(seed, epoch)[0] * 7919 + 1

    def permute(j, elements):
        n = tf.shape(tf.nest.flatten(elements)[0])[:1]
        keys = tf.random.stateless_uniform(n, tf.stack([base, j]), minval=None, maxval=None,
                                           dtype=tf.int64)
        order = tf.argsort(keys, stable=True)
        return tf.nest.map_structure(lambda t: tf.gather(t, order), elements)

    first = position // window
    return (stream.batch(window).enumerate(first).map(permute).unbatch()
            .skip(position - first * window))


def shard_updates(stream, layout: EpochLayout, worker: int, batch: int):
    """Pipeline `worker`'s share of every update of a stream shared by all pipelines,
    in batches of `batch`."""
    if layout.workers == 1:
        return stream.batch(batch)
    return stream.batch(layout.share).shard(layout.workers, worker).unbatch().batch(batch)


def padded(stream, spec: InputSpec, slots: int):
    """`(x, y)` examples as `(x, y, True)`, then padding `(0, 0, False)`, `slots` in all."""
    x = tf.zeros(spec.shape, spec.dtype)
    padding = tf.data.Dataset.from_tensors((x, tf.constant(0, tf.int32), False)).repeat()
    return stream.map(lambda x, y: (x, y, True)).concatenate(padding).take(slots)


def parsed(parse: Callable, spec: InputSpec):
    """A record parser that maps the empty record (a padding slot) to `(0, 0, False)`."""
    def parse_or_pad(record):
        return tf.cond(tf.strings.length(record) > 0,
                       lambda: (*parse(record), True),
                       lambda: (tf.zeros(spec.shape, spec.dtype), tf.constant(0, tf.int32), False))
    return parse_or_pad


def check_labels(y: np.ndarray, num_classes: int, where: str) -> None:
    """Labels must be integers in [0, num_classes)."""
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        bad = y[(y < 0) | (y >= num_classes)][0]
        raise ConfigError(f"{where}: label {bad} is outside [0, {num_classes}); labels must be "
                          "class indices 0..num_classes-1 (set data.params.num_classes if "
                          "classes are missing from the data)")
