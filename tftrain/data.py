"""Datasets by name, the batch arithmetic, and the sharded, seeded input pipeline.

Loaders return a `Source`: unbatched `(x, y)` datasets for training and validation,
their sizes and an `InputSpec` the model registry builds from. `BatchPlan` is the one
place where per-replica batch, replicas and accumulation steps become the global batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError, DataConfig
from tftrain.registry import Registry, check_params


@dataclass(frozen=True)
class InputSpec:
    """What a model builder needs to know about its input."""
    shape: tuple[int, ...]
    dtype: str
    num_classes: int
    vocab_size: Optional[int] = None


@dataclass(frozen=True)
class Source:
    train: tf.data.Dataset
    val: tf.data.Dataset
    num_train: int
    num_val: int
    spec: InputSpec
    # FILE sharding when the source is many files, else DATA (each worker skips others' elements).
    shard_policy: tf.data.experimental.AutoShardPolicy = tf.data.experimental.AutoShardPolicy.DATA


@dataclass(frozen=True)
class BatchPlan:
    """Batch arithmetic, in one place.

    One optimizer update consumes `accumulation` micro-batches of `per_replica` examples
    on each of `replicas` replicas, so the examples per update (the global batch) are
    per_replica * replicas * accumulation. The input pipeline batches at that size and
    tf.distribute splits it evenly, so each replica step sees per_replica * accumulation
    examples and `train_step` slices them into `accumulation` micro-batches.
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
        steps = num_train // self.global_batch
        if steps < 1:
            raise ConfigError(
                f"data.per_replica_batch_size: global batch {self.global_batch} "
                f"(= {self.per_replica} per replica x {self.replicas} replicas x "
                f"{self.accumulation} accumulation steps) exceeds the {num_train} training "
                "examples; lower the batch size or accumulation steps")
        return steps


def plan_batches(cfg, replicas: int, accumulation: int | None = None) -> BatchPlan:
    """The batch plan; `train.global_batch_size`, when set, must divide evenly.
    `accumulation` overrides the configured steps (the planner's choice to fit memory)."""
    accumulation = accumulation or cfg.train.accumulation_steps
    if cfg.train.global_batch_size is None:
        return BatchPlan(cfg.data.per_replica_batch_size, replicas, accumulation)
    per_update = replicas * accumulation
    if cfg.train.global_batch_size % per_update:
        raise ConfigError(
            f"train.global_batch_size: {cfg.train.global_batch_size} is not divisible by "
            f"replicas x accumulation_steps = {replicas} x {accumulation}; use a multiple "
            f"of {per_update}")
    return BatchPlan(cfg.train.global_batch_size // per_update, replicas, accumulation)


# --- loaders -------------------------------------------------------------------------
DATASETS: Registry[Callable[..., "Source"]] = Registry("dataset", "data.name")


def _split(x: np.ndarray, y: np.ndarray, fraction: float, seed: int):
    order = np.random.default_rng(seed).permutation(len(x))
    n_val = int(round(len(x) * fraction))
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


def from_arrays(x, y, fraction: float, seed: int, num_classes=None, vocab_size=None,
                x_val=None, y_val=None) -> Source:
    """A Source from in-memory arrays (split off validation unless given)."""
    x, y = np.asarray(x), np.asarray(y)
    if x_val is None:
        x, y, x_val, y_val = _split(x, y, fraction, seed)
    x = x.astype(np.int32 if vocab_size else np.float32)
    x_val = np.asarray(x_val).astype(x.dtype)
    y, y_val = np.asarray(y).astype(np.int32), np.asarray(y_val).astype(np.int32)
    num_classes = num_classes or int(max(y.max(), y_val.max() if len(y_val) else 0)) + 1
    spec = InputSpec(tuple(x.shape[1:]), "int32" if vocab_size else "float32", num_classes, vocab_size)
    return Source(tf.data.Dataset.from_tensor_slices((x, y)),
                  tf.data.Dataset.from_tensor_slices((x_val, y_val)), len(x), len(x_val), spec)


@DATASETS.register("digits")
def digits(fraction: float, seed: int) -> Source:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), offline."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0)[..., None]
    return from_arrays(x, bunch.target, fraction, seed, num_classes=10)


@DATASETS.register("synthetic")
def synthetic(fraction: float, seed: int, kind: str = "images", num_examples: int = 2048,
              shape: tuple = (16, 16, 1), num_classes: int = 10, seq_len: int = 32,
              vocab_size: int = 1000, noise: float = 1.0) -> Source:
    """Random data with a learnable signal: class prototypes plus noise (images) or
    class-specific marker tokens among random ones (tokens)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, num_classes, num_examples)
    if kind == "images":
        prototypes = rng.normal(size=(num_classes, *shape))
        x = prototypes[y] + noise * rng.normal(size=(num_examples, *shape))
        return from_arrays(x, y, fraction, seed, num_classes=num_classes)
    if kind == "tokens":
        markers = rng.integers(1, vocab_size, size=(num_classes, 4))
        x = rng.integers(1, vocab_size, size=(num_examples, seq_len))
        positions = rng.integers(0, seq_len, size=(num_examples, 4))
        np.put_along_axis(x, positions, markers[y], axis=1)
        return from_arrays(x, y, fraction, seed, num_classes=num_classes, vocab_size=vocab_size)
    raise ConfigError(f"data.params.kind: unknown synthetic kind '{kind}'; expected images or tokens")


def _existing(path, key: str) -> Path:
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise ConfigError(f"{key}: {path} does not exist; give the path of your data")
    return p


@DATASETS.register("npz")
def npz(fraction: float, seed: int, path: str = "", x_key: str = "x", y_key: str = "y",
        val_x_key: Optional[str] = None, val_y_key: Optional[str] = None,
        vocab_size: Optional[int] = None) -> Source:
    """Arrays from a .npz file (keys configurable; validation keys optional)."""
    p = _existing(path, "data.params.path")
    with np.load(p, allow_pickle=False) as f:
        for k in (x_key, y_key, val_x_key, val_y_key):
            if k is not None and k not in f.files:
                raise ConfigError(f"data.params: key '{k}' not in {p} (it has {', '.join(f.files)})")
        x_val = f[val_x_key] if val_x_key else None
        y_val = f[val_y_key] if val_y_key else None
        return from_arrays(f[x_key], f[y_key], fraction, seed, vocab_size=vocab_size,
                           x_val=x_val, y_val=y_val)


_TF_DTYPES = {"float32": tf.float32, "int64": tf.int64, "string": tf.string}


@DATASETS.register("tfrecord")
def tfrecord(fraction: float, seed: int, files: str = "", features: Optional[dict] = None,
             x: str = "x", y: str = "y", shape: Optional[list] = None,
             num_classes: Optional[int] = None) -> Source:
    """tf.Example records. `features` maps name -> {dtype, shape}; `x`/`y` name the
    input and label features."""
    paths = sorted(tf.io.gfile.glob(str(files)))
    if not paths:
        raise ConfigError(f"data.params.files: no file matches {files!r}; give a glob of TFRecord files")
    features = features or {x: {"dtype": "float32", "shape": shape}, y: {"dtype": "int64", "shape": []}}
    spec = {}
    for name, f in features.items():
        if f.get("dtype", "float32") not in _TF_DTYPES:
            raise ConfigError(f"data.params.features.{name}.dtype: {f.get('dtype')!r}; "
                              f"expected one of {', '.join(_TF_DTYPES)}")
        spec[name] = tf.io.FixedLenFeature(f.get("shape") or [], _TF_DTYPES[f.get("dtype", "float32")])
    if x not in spec or y not in spec:
        raise ConfigError(f"data.params.features: must describe the input '{x}' and label '{y}'")

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        return tf.cast(ex[x], tf.float32), tf.cast(ex[y], tf.int32)

    n_val_files = int(round(len(paths) * fraction))
    if len(paths) > 1 and n_val_files >= 1:
        train_files, val_files = paths[n_val_files:], paths[:n_val_files]
    else:
        train_files, val_files = paths, []
    train = tf.data.TFRecordDataset(train_files).map(parse)
    labels = np.array([int(lbl) for _, lbl in train.as_numpy_iterator()])
    if val_files:
        val = tf.data.TFRecordDataset(val_files).map(parse)
        n_val = sum(1 for _ in val)
    else:  # one file: split records
        n_val = int(round(len(labels) * fraction))
        val, train = train.take(n_val), train.skip(n_val)
        labels = labels[n_val:]
    element = next(iter(train))[0]
    input_spec = InputSpec(tuple(element.shape), "float32", num_classes or int(labels.max()) + 1)
    policy = (tf.data.experimental.AutoShardPolicy.FILE if len(train_files) > 1
              else tf.data.experimental.AutoShardPolicy.DATA)
    return Source(train, val, len(labels), n_val, input_spec, policy)


@DATASETS.register("image_folder")
def image_folder(fraction: float, seed: int, path: str = "", image_size: tuple = (32, 32),
                 channels: int = 3) -> Source:
    """Images in one sub-folder per class (png/jpg/bmp/gif), resized to `image_size`."""
    root = _existing(path, "data.params.path")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise ConfigError(f"data.params.path: {root} has no class sub-folders (expected root/<class>/<image>)")
    files, labels = [], []
    for label, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            if f.suffix.lower() in (".png", ".jpg", ".jpeg", ".bmp", ".gif"):
                files.append(str(f))
                labels.append(label)
    if not files:
        raise ConfigError(f"data.params.path: no images under {root}")
    images = np.stack([
        tf.image.resize(tf.io.decode_image(tf.io.read_file(f), channels=channels,
                                           expand_animations=False), image_size).numpy() / 255.0
        for f in files])
    return from_arrays(images, np.array(labels), fraction, seed, num_classes=len(classes))


def _keras_dataset(name: str):
    def load(fraction: float, seed: int) -> Source:
        from tftrain._keras import keras

        module = getattr(keras.datasets, name)
        try:
            (x, y), (x_val, y_val) = module.load_data()
        except Exception as err:  # offline: urllib raises various errors
            raise ConfigError(
                f"data.name: could not load keras:{name} ({type(err).__name__}); it is "
                f"downloaded on first use and this machine seems offline. Copy the file "
                f"keras downloads into ~/.keras/datasets/, or save the arrays with "
                f"numpy.savez and use data.name: npz with data.params.path") from None
        x = x.astype(np.float32) / 255.0
        x_val = x_val.astype(np.float32) / 255.0
        if x.ndim == 3:
            x, x_val = x[..., None], x_val[..., None]
        return from_arrays(x, y.reshape(-1), fraction, seed, x_val=x_val, y_val=y_val.reshape(-1))
    load.__doc__ = f"keras.datasets.{name} (downloaded on first use)."
    return load


for _name in ("mnist", "fashion_mnist", "cifar10", "cifar100"):
    DATASETS.register(f"keras:{_name}")(_keras_dataset(_name))


def load_source(cfg: DataConfig, seed: int) -> Source:
    """Build the configured dataset (validating its params against the loader)."""
    loader = DATASETS.get(cfg.name)
    check_params(loader, cfg.params, "data.params", skip=2)
    return loader(cfg.validation_fraction, seed, **cfg.params)


# --- pipeline ------------------------------------------------------------------------
def _options(policy) -> tf.data.Options:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    options.deterministic = True   # same batches in the same order on every run
    return options


def train_dataset(source: Source, plan: BatchPlan, cfg: DataConfig, seed: int,
                  start_update: int = 0) -> tf.data.Dataset:
    """Endless batches of `plan.global_batch`, beginning at optimizer update `start_update`.

    Epoch e is shuffled with seed (seed, e), so the order is a pure function of the epoch
    and a resumed run sees exactly the batches the interrupted one would have seen.
    The last partial batch of each epoch is dropped, so every replica gets a full,
    equal share of every update.
    """
    steps = plan.steps_per_epoch(source.num_train)
    base = source.train.cache() if cfg.cache else source.train
    buffer = cfg.shuffle_buffer or source.num_train

    def epoch(e):
        # A fixed graph-level seed inside this traced function (it does not touch the
        # process's seed): the order then depends on the op seed (seed, e) alone, and
        # TensorFlow's seed check never has to compare a tensor (it fails for seed 0).
        tf.random.set_seed(1)
        ds = base
        if cfg.shuffle:
            ds = ds.shuffle(buffer, seed=tf.cast(seed, tf.int64) * 1_000_003 + e,
                            reshuffle_each_iteration=False)
        return ds.batch(plan.global_batch, drop_remainder=True).take(steps)

    first_epoch, skip = divmod(start_update, steps)
    ds = tf.data.Dataset.range(first_epoch, 2**62).flat_map(epoch).skip(skip)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(_options(source.shard_policy))


def val_dataset(source: Source, plan: BatchPlan) -> tf.data.Dataset:
    """Validation batches of per_replica x replicas (the last one may be partial)."""
    ds = source.val.batch(plan.per_replica * plan.replicas).cache().prefetch(tf.data.AUTOTUNE)
    return ds.with_options(_options(source.shard_policy))
