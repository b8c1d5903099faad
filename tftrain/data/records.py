"""Record files read sequentially: `tfrecord` (tf.Example files) and `tfds:NAME`
(a prepared tensorflow-datasets directory, read offline).

Order of epoch e: the files shuffled with (seed, e), read `cycle_length` at a time
(records taken round-robin, files read in parallel), and the stream permuted in windows
of `data.shuffle_buffer` records. All of it is a function of the files' record counts,
so the state at any position is computed, not replayed: a resumed epoch opens the files
of its group at their offsets and the window holding its position, and skips at most a
window.

Counts come from `num_examples` (no pass at start) or one pass over the record headers,
cached in `~/.cache/tftrain/` keyed by the files' names, sizes and mtimes.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.data.batching import EpochLayout
from tftrain.data.source import (DATASETS, InputSpec, Source, options, parsed, permutation,
                                 window_shuffle)
from tftrain.data.images import decode

CACHE = Path(os.environ.get("TFTRAIN_CACHE", Path.home() / ".cache" / "tftrain"))


def count_records(path: str) -> int:
    """Records in a TFRecord file, from its headers (length, crc; data skipped)."""
    n = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while True:
            header = f.read(12)
            if not header:
                return n
            if len(header) < 12:
                raise ConfigError(f"data: {path} is truncated or not a TFRecord file "
                                  "(record header cut short); rewrite it or remove it")
            (length,) = struct.unpack("<Q", header[:8])
            if f.tell() + length + 4 > size:
                raise ConfigError(f"data: {path} is truncated or not a TFRecord file (a record "
                                  f"of {length} bytes runs past the end); rewrite it or remove it")
            f.seek(length + 4, os.SEEK_CUR)
            n += 1


def cached_counts(paths: list[str]) -> list[int]:
    """Records per file: one header pass, remembered by the files' names, sizes, mtimes."""
    stats = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:24]
    file = CACHE / f"counts-{key}.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        pass
    counts = [count_records(p) for p in paths]
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(counts))
        os.replace(tmp, file)
    except OSError:
        pass          # a read-only home: count again next time
    return counts


@dataclass(frozen=True)
class Files:
    """Record files and, per file, the records to skip at its start and to read."""
    paths: tuple[str, ...]
    skips: tuple[int, ...]
    counts: tuple[int, ...]

    def __len__(self):
        return len(self.paths)

    def take(self, idx) -> "Files":
        return Files(*(tuple(np.asarray(a, dtype=object)[idx].tolist()) for a in
                       (self.paths, self.skips, self.counts)))


def group_offsets(counts, t: int):
    """Round-robin reading of files with `counts` records (block 1, exhausted files left
    out): after t records, how many were read from each file, and the file read next."""
    counts = np.asarray(counts)
    lo, hi = 0, int(counts.max())
    while lo < hi:                              # largest r with sum(min(counts, r)) <= t
        mid = (lo + hi + 1) // 2
        if np.minimum(counts, mid).sum() <= t:
            lo = mid
        else:
            hi = mid - 1
    read = np.minimum(counts, lo)
    active = np.flatnonzero(counts > lo)
    extra = t - int(read.sum())
    read[active[:extra]] += 1
    following = active[extra] if extra < len(active) else 0
    return read, int(following)


class RecordSource(Source):
    """Examples in record files, parsed by `parse(serialized) -> (x, y)`; `files`: the
    training and the validation files."""

    def __init__(self, *, spec: InputSpec, files: tuple[Files, Files], parse: Callable,
                 cycle_length: int, window: int, kind: str, num_train: Optional[int] = None,
                 counts: Optional[Callable] = None):
        train, val = files
        self.spec, self.train_files, self.val_files, self.parse = spec, train, val, parse
        self.cycle_length, self.window, self.kind = max(1, min(cycle_length, len(train))), window, kind
        self._counts = counts
        self.num_train = num_train if num_train is not None else sum(self.counts)
        self.num_val = sum(val.counts)

    @cached_property
    def counts(self) -> tuple[int, ...]:
        """Records per training file (a header pass, cached, only when needed)."""
        if all(c >= 0 for c in self.train_files.counts):
            return self.train_files.counts
        return tuple(self._counts())

    def _read(self, files: Files) -> tf.data.Dataset:
        return tf.data.Dataset.from_tensor_slices(
            (list(files.paths), np.array(files.skips, np.int64), np.array(files.counts, np.int64)))

    def _group(self, paths, skips, counts):
        cycle = self.cycle_length
        return tf.data.Dataset.from_tensor_slices((paths, skips, counts)).interleave(
            lambda p, s, n: tf.data.TFRecordDataset(p).skip(s).take(n), cycle_length=cycle,
            block_length=1, num_parallel_calls=min(cycle, 8), deterministic=True)

    def _stream(self, files: Files, seed, epoch, position: int, shuffle: bool):
        """Raw records of `files` in epoch order, from `position` on."""
        cycle, window = self.cycle_length, self.window
        if position >= sum(files.counts):       # only padding is left in this epoch
            return tf.data.Dataset.from_tensor_slices(tf.constant([], tf.string))
        order = permutation(len(files), seed, epoch) if shuffle else tf.range(len(files))
        first = 0
        if position:
            ordered = files.take(order.numpy())
            start = (position // window) * window if shuffle else position
            totals = np.cumsum([0] + list(ordered.counts))
            group_totals = totals[::cycle] if len(ordered) % cycle == 0 else \
                np.append(totals[::cycle], totals[-1])
            g = int(np.searchsorted(group_totals, start, side="right")) - 1
            members = list(range(g * cycle, min((g + 1) * cycle, len(ordered))))
            read, nxt = group_offsets([ordered.counts[i] for i in members], start - group_totals[g])
            rotated = [(members[i], int(read[i])) for i in list(range(nxt, len(members))) +
                       list(range(nxt))]
            rotated = [(m, r) for m, r in rotated if r < ordered.counts[m]]
            head = self._group(
                [ordered.paths[m] for m, _ in rotated],
                np.array([ordered.skips[m] + r for m, r in rotated], np.int64),
                np.array([ordered.counts[m] - r for m, r in rotated], np.int64)) \
                if rotated else tf.data.Dataset.from_tensor_slices(tf.constant([], tf.string))
            first = g + 1
        paths = tf.gather(tf.constant(list(files.paths)), order)
        skips = tf.gather(tf.constant(list(files.skips), tf.int64), order)
        counts = tf.gather(tf.constant(list(files.counts), tf.int64), order)
        groups = tf.data.Dataset.from_tensor_slices((paths, skips, counts)).batch(cycle)
        stream = groups.skip(first).flat_map(self._group)
        if position:
            stream = head.concatenate(stream)
        if not shuffle:
            return stream
        return window_shuffle(stream, seed, epoch, position, window)

    def layout(self, global_batch, workers, pad, policy, streams=None) -> EpochLayout:
        """`streams`: the number of file streams a resumed run began with (else decided
        here: one per worker with FILE sharding, one shared stream otherwise)."""
        if streams is None:
            streams = workers if self._by_file(workers, policy) else 1
        if streams == 1:
            return EpochLayout((self.num_train,), workers, global_batch, pad)
        return EpochLayout(tuple(sum(self.counts[s::streams]) for s in range(streams)),
                           workers, global_batch, pad)

    def _by_file(self, workers: int, policy: str) -> bool:
        if workers == 1 or policy == "data":
            return False
        if policy == "file" and len(self.train_files) < workers:
            raise ConfigError(f"data.shard_policy: file sharding needs at least one file per "
                              f"worker ({len(self.train_files)} files, {workers} workers); set "
                              "data.shard_policy: auto or data")
        return len(self.train_files) >= workers

    def epoch(self, seed, epoch, layout, worker, start_update, shuffle, batch):
        """Pipeline `worker`'s part of every update (`EpochLayout.streams_of`): its share
        of the one stream, or (FILE sharding) whole streams of its own side by side, or
        its part of one stream's chunk."""
        chunk, steps = layout.chunk, layout.steps()
        parts = []
        for s, first, size in layout.streams_of(worker):
            files = self.train_files.take(slice(s, None, layout.streams))
            files = Files(files.paths, files.skips, self.counts[s::layout.streams])
            stream = self._padded(self._stream(files, seed, epoch, start_update * chunk, shuffle),
                                  (steps - start_update) * chunk)
            if size < chunk:               # this pipeline's part of each update's chunk
                stream = stream.batch(size).shard(chunk // size, first // size).unbatch()
            parts.append(stream)
        if len(parts) == 1:
            return parts[0].batch(batch)
        return tf.data.Dataset.zip(tuple(p.batch(chunk) for p in parts)).map(
            lambda *chunks: tf.concat(chunks, 0)).unbatch().batch(batch)

    @staticmethod
    def _padded(stream, slots: int):
        """Raw records, then empty records (padding slots), `slots` in all."""
        return stream.concatenate(tf.data.Dataset.from_tensors(tf.constant(b"")).repeat()).take(slots)

    def decode_one(self, record):
        return parsed(self.parse, self.spec)(record)

    def validation(self):
        return self._read(self.val_files).flat_map(
            lambda p, s, n: tf.data.TFRecordDataset(p).skip(s).take(n)).map(
            self.parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def calibration(self, n):
        return self._read(self.train_files).flat_map(
            lambda p, s, n: tf.data.TFRecordDataset(p).skip(s).take(n)).take(n).map(
            self.parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def describe(self, layout, cfg) -> str:
        how = (f"files shuffled per epoch, {self.cycle_length} read at a time, records "
               f"permuted in windows of {self.window}") if cfg.shuffle else "file order"
        return f"{self.kind}, streamed; shuffle: {how}"


# --- tf.Example files -----------------------------------------------------------------
_TF_DTYPES = {"float32": tf.float32, "int64": tf.int64, "string": tf.string}


def split_files(paths: list[str], counts: Callable, fraction: float, num_examples=None):
    """(train, val) Files: whole files for validation when there are several, else the
    first records of the one file."""
    unknown = tuple(-1 for _ in paths)
    n_val_files = int(round(len(paths) * fraction))
    if len(paths) > 1 and n_val_files >= 1:
        val_counts = tuple(cached_counts(paths[:n_val_files]))
        train = Files(tuple(paths[n_val_files:]), tuple(0 for _ in paths[n_val_files:]),
                      unknown[n_val_files:] if num_examples else tuple(counts()[n_val_files:]))
        return train, Files(tuple(paths[:n_val_files]), tuple(0 for _ in val_counts), val_counts)
    if not fraction:
        return Files(tuple(paths), tuple(0 for _ in paths),
                     unknown if num_examples else tuple(counts())), Files((), (), ())
    (total,) = counts()
    n_val = int(round(total * fraction))
    return (Files(tuple(paths), (n_val,), (total - n_val,)), Files(tuple(paths), (0,), (n_val,)))


def example_parser(features: dict, x: str, y: str, image: Optional[dict]):
    spec = {}
    for name, f in features.items():
        if f.get("dtype", "float32") not in _TF_DTYPES:
            raise ConfigError(f"data.params.features.{name}.dtype: {f.get('dtype')!r}; "
                              f"expected one of {', '.join(_TF_DTYPES)}")
        spec[name] = tf.io.FixedLenFeature(f.get("shape") or [], _TF_DTYPES[f.get("dtype", "float32")])
    for role, name in (("input", x), ("label", y)):
        if name not in spec:
            raise ConfigError(f"data.params.features: no feature '{name}' for the {role}; "
                              f"describe it (have: {', '.join(spec) or 'none'})")

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        if image:
            inputs = decode(ex[x], [int(v) for v in image.get("size", (32, 32))],
                            int(image.get("channels", 3)))
        else:
            inputs = tf.cast(ex[x], tf.float32)
        return inputs, tf.cast(ex[y], tf.int32)
    return parse


@dataclass(frozen=True)
class TFRecordOptions:
    """`data.params` of `tfrecord` (`shuffle_buffer`: `data.shuffle_buffer`)."""
    files: str = ""
    features: Optional[dict] = None
    x: str = "x"
    y: str = "y"
    shape: Optional[list] = None
    num_classes: Optional[int] = None
    num_examples: Optional[int] = None
    image: Optional[dict] = None
    cycle_length: int = 8
    shuffle_buffer: int = 10_000


@DATASETS.register("tfrecord")
@options(TFRecordOptions)
def tfrecord(fraction: float, seed: int, o: TFRecordOptions = TFRecordOptions()) -> RecordSource:
    """tf.Example records, streamed. `features` maps name -> {dtype, shape}; `x`/`y`
    name the input and label; `image: {size, channels}` decodes an encoded-image bytes
    input; `num_examples` (training records) skips the counting pass at start."""
    files, features, x, y, shape, image = o.files, o.features, o.x, o.y, o.shape, o.image
    num_classes, num_examples = o.num_classes, o.num_examples
    cycle_length, shuffle_buffer = o.cycle_length, o.shuffle_buffer
    paths = sorted(tf.io.gfile.glob(str(files)))
    if not paths:
        raise ConfigError(f"data.params.files: no file matches {files!r}; give a glob of TFRecord files")
    if image is not None:
        features = features or {x: {"dtype": "string"}, y: {"dtype": "int64"}}
    features = features or {x: {"dtype": "float32", "shape": shape}, y: {"dtype": "int64", "shape": []}}
    parse = example_parser(features, x, y, image)
    counts = lambda: cached_counts(paths)  # noqa: E731
    train, val = split_files(paths, counts, fraction, num_examples)
    if num_examples is None and sum(train.counts) == 0:
        raise ConfigError(f"data.params.files: {files!r} holds no training records")
    try:
        first_x, first_y = parse(next(iter(tf.data.TFRecordDataset(paths[-1]).take(1))))
    except StopIteration:
        raise ConfigError(f"data.params.files: {paths[-1]} holds no records") from None
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as err:
        raise ConfigError(f"data: {paths[-1]}: cannot parse its first record with "
                          f"data.params.features ({err.message.splitlines()[0]}); describe the "
                          "features as written") from None
    if num_classes is None:
        raise ConfigError("data.params.num_classes: required for tfrecord (labels are not "
                          "read ahead of training); set it to the number of classes")
    spec = InputSpec(tuple(first_x.shape), "float32", num_classes)
    del first_y
    return RecordSource(spec=spec, files=(train, val), parse=_checked(parse, num_classes),
                        cycle_length=cycle_length, window=shuffle_buffer,
                        kind=f"{len(paths)} TFRecord files", num_train=num_examples,
                        counts=lambda: counts()[len(paths) - len(train):])


def _checked(parse, num_classes: int):
    """The parser with a label check: a label outside [0, classes) stops with its value."""
    def checked(record):
        x, y = parse(record)
        tf.debugging.assert_less(y, num_classes, message=f"data: a label is >= num_classes "
                                 f"({num_classes}); fix the data or data.params.num_classes")
        tf.debugging.assert_non_negative(y, message="data: a label is negative")
        return x, y
    return checked
