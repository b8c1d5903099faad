"""`tfds:NAME`: a tensorflow-datasets dataset already prepared in `data_dir`, read
offline as record files (the shard lengths in its metadata are the counts, so nothing is
counted at start). Never downloads."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import tensorflow as tf

from tftrain.config import ConfigError, DataConfig
from tftrain.data.records import Files, RecordSource, split_files
from tftrain.data.source import InputSpec
from tftrain.core.registry import check_params


def _params(data_dir: Optional[str] = None, split: str = "train",
            validation_split: Optional[str] = None, x: Optional[str] = None,
            y: Optional[str] = None, image_size: Optional[list] = None, cycle_length: int = 8):
    """Parameters of `tfds:NAME` (documented by their names)."""


def _builder(name: str, data_dir: str):
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ConfigError("data.name: tfds datasets need tensorflow-datasets; install the "
                          "extra: pip install -e \".[tfds]\"") from None
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as err:      # DatasetNotFoundError and friends
        raise ConfigError(f"data.name: tfds:{name} is not prepared in {data_dir} "
                          f"({type(err).__name__}); prepare it there on a machine with network "
                          f"(tfds.builder('{name}', data_dir=...).download_and_prepare()) and "
                          "copy the directory, or set data.params.data_dir") from None
    if str(builder.info.file_format).split(".")[-1].lower() != "tfrecord":
        raise ConfigError(f"data.name: tfds:{name} in {data_dir} is stored as "
                          f"{builder.info.file_format}; tftrain reads TFRecord-format TFDS data")
    return builder


def _files(builder, split: str) -> Files:
    if split not in builder.info.splits:
        raise ConfigError(f"data.params.split: tfds:{builder.name} has no split '{split}' "
                          f"(it has {', '.join(builder.info.splits)})")
    info = builder.info.splits[split]
    paths = tuple(str(p) for p in info.filepaths)
    return Files(paths, tuple(0 for _ in paths), tuple(int(n) for n in info.shard_lengths))


def tfds_source(cfg: DataConfig, seed: int) -> RecordSource:
    name = cfg.name.split(":", 1)[1]
    check_params(_params, cfg.params, "data.params")
    p = dict(cfg.params)
    data_dir = os.path.expanduser(p.get("data_dir") or os.environ.get(
        "TFDS_DATA_DIR", str(Path.home() / "tensorflow_datasets")))
    builder = _builder(name, data_dir)
    features = builder.info.features
    keys = builder.info.supervised_keys or ("image", "label")
    x, y = p.get("x") or keys[0], p.get("y") or keys[1]
    for role, key in (("x", x), ("y", y)):
        if key not in features:
            raise ConfigError(f"data.params.{role}: tfds:{name} has no feature '{key}' (it has "
                              f"{', '.join(features.keys())})")
    label = features[y]
    if not hasattr(label, "num_classes"):
        raise ConfigError(f"data.params.y: feature '{y}' of tfds:{name} is not a ClassLabel")
    size = p.get("image_size")

    def parse(record):
        example = features.deserialize_example(record)
        inputs = example[x]
        scale = 1.0 / 255.0 if inputs.dtype == tf.uint8 else 1.0     # images to [0, 1]
        inputs = tf.cast(inputs, tf.float32)
        if size is not None:
            inputs = tf.image.resize(inputs, size)
        return inputs * scale, tf.cast(example[y], tf.int32)

    train = _files(builder, p.get("split", "train"))
    if p.get("validation_split"):
        val = _files(builder, p["validation_split"])
    else:
        train, val = split_files(list(train.paths), lambda: list(train.counts),
                                 cfg.validation_fraction)
    shape = tuple(size) + (features[x].shape[-1],) if size else tuple(features[x].shape)
    if None in shape:
        raise ConfigError(f"data.params.image_size: tfds:{name} '{x}' has shape "
                          f"{features[x].shape}; set image_size: [height, width] to resize")
    spec = InputSpec(shape, "float32", int(label.num_classes))
    return RecordSource(spec=spec, files=(train, val), parse=parse,
                        cycle_length=int(p.get("cycle_length", 8)),
                        window=cfg.shuffle_buffer or 10_000,
                        kind=f"tfds:{name} ({len(train)} files in {builder.data_dir})")
