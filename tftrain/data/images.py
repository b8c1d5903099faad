"""`image_folder`: images in one sub-folder per class, streamed from disk.

The file list is read once; each epoch is a permutation of file indices and every image
is read, decoded and resized in a parallel `map` when its slot comes, so memory holds a
bounded window of images whatever the folder's size. Decoded images are uint8 at
`image_size` (rounded after resizing), then scaled to [0, 1]: the same values whether
they come from disk or from a cache.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.data.source import DATASETS, IndexedSource, InputSpec, existing

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
_MAGIC = {b"\x89PNG": "png", b"\xff\xd8\xff": "jpeg", b"BM": "bmp", b"GIF8": "gif"}


def _is_image(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return any(head.startswith(m) for m in _MAGIC)


def list_images(root: Path, on_bad_record: str):
    """(files, labels, classes, skipped) of root/<class>/<image>."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise ConfigError(f"data.params.path: {root} has no class sub-folders (expected "
                          "root/<class>/<image>)")
    files, labels, skipped = [], [], 0
    for label, name in enumerate(classes):
        found = sorted(str(f) for f in (root / name).iterdir() if f.suffix.lower() in SUFFIXES)
        if not found:
            raise ConfigError(f"data.params.path: class folder {root / name} has no images "
                              f"({', '.join(SUFFIXES)}); remove it or add images")
        for f in found:
            if not _is_image(Path(f)):
                if on_bad_record == "fail":
                    raise ConfigError(f"data: {f} is not a PNG/JPEG/BMP/GIF image; remove it "
                                      "or set data.on_bad_record: skip")
                skipped += 1
                continue
            files.append(f)
            labels.append(label)
    return files, np.array(labels, np.int32), classes, skipped


def decode(path, size, channels: int):
    """One image file -> uint8 [h, w, channels] at `size`."""
    image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
    image = tf.image.resize(image, size)
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def to_float(image):
    return tf.cast(image, tf.float32) / 255.0


@DATASETS.register("image_folder")
def image_folder(fraction: float, seed: int, path: str = "", image_size: tuple = (32, 32),
                 channels: int = 3, on_bad_record: str = "fail") -> IndexedSource:
    """Images in one sub-folder per class (png/jpg/bmp/gif), resized to `image_size`."""
    root = existing(path, "data.params.path")
    files, labels, classes, skipped = list_images(root, on_bad_record)
    if skipped:
        print(f"data: skipped {skipped} files that are not images (data.on_bad_record: skip)")
    order = np.random.default_rng(seed).permutation(len(files))
    n_val = int(round(len(files) * fraction))
    train, val = order[n_val:], order[:n_val]
    size = [int(s) for s in image_size]
    train_files = tf.constant(np.array(files)[train])
    train_labels = tf.constant(labels[train])

    def load(i):
        return to_float(decode(train_files[i], size, channels)), train_labels[i]

    val_ds = tf.data.Dataset.from_tensor_slices((np.array(files)[val], labels[val])).map(
        lambda f, y: (to_float(decode(f, size, channels)), y),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    spec = InputSpec((*size, channels), "float32", len(classes))
    return IndexedSource(spec, len(train), len(val), load, val_ds,
                         kind=f"{len(files)} image files under {root}", elementwise=True,
                         decoded_bytes=len(train) * int(np.prod(size)) * channels * 4)
