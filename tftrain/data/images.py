"""`image_folder`: images in one sub-folder per class, streamed from disk.

The file list is read once; each epoch is a permutation of file indices and every image
is read, decoded and resized in a parallel `map` when its slot comes, so memory holds a
bounded window of images whatever the folder's size. Images are resized to
`image_size` (bilinear) and scaled to [0, 1], as `image_dataset_from_directory` does.
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


def decode(data, size, channels: int):
    """Encoded image bytes -> float32 [h, w, channels] in [0, 1] at `size`."""
    image = tf.io.decode_image(data, channels=channels, expand_animations=False)
    return tf.image.resize(image, size) * (1.0 / 255.0)


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
        return decode(tf.io.read_file(train_files[i]), size, channels), train_labels[i]

    val_ds = tf.data.Dataset.from_tensor_slices((np.array(files)[val], labels[val])).map(
        lambda f, y: (decode(tf.io.read_file(f), size, channels), y),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    spec = InputSpec((*size, channels), "float32", len(classes))
    return IndexedSource(spec, len(train), len(val), load, val_ds,
                         kind=f"{len(files)} image files under {root}", elementwise=True,
                         decoded_bytes=len(train) * int(np.prod(size)) * channels * 4)
