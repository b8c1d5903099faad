"""In-memory sources: arrays, scikit-learn's digits, synthetic data, .npz files, and
keras.datasets (downloaded on first use, clear error offline)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.data.source import (DATASETS, IndexedSource, InputSpec, check_labels, existing,
                                 options)
from tftrain.core.keras import keras

# A graph constant cannot exceed 2 GB; arrays above this stay out of memory caches.
MAX_IN_GRAPH_BYTES = 1_500_000_000


def _split(n: int, fraction: float, seed: int):
    order = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * fraction))
    return order[n_val:], order[:n_val]


def from_arrays(x, y, fraction: float, seed: int, num_classes=None, vocab_size=None,
                validation: tuple | None = None, where: str = "data") -> IndexedSource:
    """A source from in-memory arrays (validation split off unless given: `validation`,
    its `(x, y)`)."""
    x_val, y_val = validation or (None, None)
    x, y = np.asarray(x), np.asarray(y)
    if x.ndim < 1 or len(x) != len(y):
        raise ConfigError(f"{where}: x has {len(x) if x.ndim else 0} examples but y has "
                          f"{len(y)}; inputs and labels must have the same length")
    if not np.issubdtype(y.dtype, np.integer) and not np.all(np.mod(y, 1) == 0):
        raise ConfigError(f"{where}: labels must be integer class indices (got {y.dtype})")
    if x_val is None:
        train, val = _split(len(x), fraction, seed)
        x, y, x_val, y_val = x[train], y[train], x[val], y[val]
    elif len(x_val) != len(y_val):
        raise ConfigError(f"{where}: validation x has {len(x_val)} examples but y has {len(y_val)}")
    dtype = np.int32 if vocab_size else np.float32
    x, x_val = x.astype(dtype), np.asarray(x_val).astype(dtype)
    y, y_val = np.asarray(y).astype(np.int32), np.asarray(y_val).astype(np.int32)
    if len(x) == 0:
        raise ConfigError(f"{where}: no training examples; check the file or "
                          "data.validation_fraction")
    num_classes = num_classes or int(max(y.max(), y_val.max() if len(y_val) else 0)) + 1
    check_labels(y, num_classes, where)
    check_labels(y_val, num_classes, where)
    spec = InputSpec(tuple(x.shape[1:]), "int32" if vocab_size else "float32", num_classes, vocab_size)
    return array_source(x, y, tf.data.Dataset.from_tensor_slices((x_val, y_val)), len(x_val), spec)


def array_source(x, y, val: tf.data.Dataset, num_val: int, spec: InputSpec,
                 kind: str = "arrays in memory") -> IndexedSource:
    """An indexed source over training arrays held in memory (as graph constants)."""
    if x.nbytes > MAX_IN_GRAPH_BYTES:
        raise ConfigError(f"data: {x.nbytes / 2**30:.1f} GiB of training arrays cannot be held "
                          "in memory by tftrain (at most 1.5 GB); write them as TFRecord files "
                          "and use data.name: tfrecord, or set data.cache: none")
    xt, yt = tf.constant(x), tf.constant(y)

    def load(idx):
        return tf.gather(xt, idx), tf.gather(yt, idx)

    return IndexedSource(spec, len(x), num_val, load, val, kind=kind,
                         decoded_bytes=x.nbytes + y.nbytes)


@DATASETS.register("digits")
def digits(fraction: float, seed: int, image_size: Optional[int] = None,
           channels: int = 1) -> IndexedSource:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), offline;
    optionally resized (bilinear) to `image_size` and repeated to `channels` (e.g. 32
    and 3 for ImageNet backbones)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0)[..., None].astype(np.float32)
    if image_size is not None:
        if image_size < 8:
            raise ConfigError(f"data.params.image_size: {image_size}; expected at least 8")
        x = np.clip(tf.image.resize(x, [image_size, image_size]).numpy(), 0.0, 1.0)
    if channels not in (1, 3):
        raise ConfigError(f"data.params.channels: {channels}; expected 1 or 3")
    x = np.repeat(x, channels, axis=-1)
    return from_arrays(x, bunch.target, fraction, seed, num_classes=10)


@dataclass(frozen=True)
class SyntheticOptions:
    """`data.params` of `synthetic`."""
    kind: str = "images"
    num_examples: int = 2048
    shape: tuple = (16, 16, 1)
    num_classes: int = 10
    seq_len: int = 32
    vocab_size: int = 1000
    noise: float = 1.0


@DATASETS.register("synthetic")
@options(SyntheticOptions)
def synthetic(fraction: float, seed: int,
              o: SyntheticOptions = SyntheticOptions()) -> IndexedSource:
    """Random data with a learnable signal: class prototypes plus noise (images) or
    class-specific marker tokens among random ones (tokens)."""
    kind, num_examples, shape, num_classes = o.kind, o.num_examples, o.shape, o.num_classes
    seq_len, vocab_size, noise = o.seq_len, o.vocab_size, o.noise
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


@dataclass(frozen=True)
class NpzOptions:
    """`data.params` of `npz`."""
    path: str = ""
    x_key: str = "x"
    y_key: str = "y"
    val_x_key: Optional[str] = None
    val_y_key: Optional[str] = None
    vocab_size: Optional[int] = None
    num_classes: Optional[int] = None


@DATASETS.register("npz")
@options(NpzOptions)
def npz(fraction: float, seed: int, o: NpzOptions = NpzOptions()) -> IndexedSource:
    """Arrays from a .npz file (keys configurable; validation keys optional)."""
    path, x_key, y_key, val_x_key, val_y_key = o.path, o.x_key, o.y_key, o.val_x_key, o.val_y_key
    vocab_size, num_classes = o.vocab_size, o.num_classes
    p = existing(path, "data.params.path")
    try:
        f = np.load(p, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ConfigError(f"data.params.path: {p} is not a readable .npz file ({err}); save "
                          "arrays with numpy.savez(path, x=..., y=...)") from None
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise ConfigError(f"data.params.path: {p} holds a single array (.npy), not a .npz "
                          "archive of named arrays; save with numpy.savez(path, x=..., y=...)")
    with f:
        for k in (x_key, y_key, val_x_key, val_y_key):
            if k is not None and k not in f.files:
                raise ConfigError(f"data.params: key '{k}' not in {p} (it has {', '.join(f.files)})")
        x_val = f[val_x_key] if val_x_key else None
        y_val = f[val_y_key] if val_y_key else None
        return from_arrays(f[x_key], f[y_key], fraction, seed, vocab_size=vocab_size,
                           validation=(x_val, y_val), num_classes=num_classes,
                           where=f"data.params.path: {p}")


def _keras_dataset(name: str):
    def load(fraction: float, seed: int) -> IndexedSource:

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
        return from_arrays(x, y.reshape(-1), fraction, seed, validation=(x_val, y_val.reshape(-1)))
    load.__doc__ = f"keras.datasets.{name} (downloaded on first use)."
    return load


for _name in ("mnist", "fashion_mnist", "cifar10", "cifar100"):
    DATASETS.register(f"keras:{_name}")(_keras_dataset(_name))
