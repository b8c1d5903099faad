"""Datasets by name, the batch arithmetic, and the sharded, seeded, resumable input
pipeline. See `source.py` for what a source is and `pipeline.py` for how epochs become
replica batches.

May import: `tftrain.core`, `tftrain.optim`, `tftrain.config`.
"""
from tftrain.data.batching import BatchPlan, EpochLayout, plan_batches
from tftrain.data.source import DATASETS, IndexedSource, InputSpec, Source
from tftrain.data.loaders import load_source
from tftrain.data import arrays, audio, augment_audio, images, records, text  # noqa: F401,E501  (register)
from tftrain.data.arrays import from_arrays
from tftrain.data.pipeline import (cache_choice, cached, describe, distribute, epoch_layout, label_spec,
                                   preprocess, train_dataset, val_dataset)
from tftrain.data.user import UserData

__all__ = ["BatchPlan", "DATASETS", "EpochLayout", "IndexedSource", "InputSpec", "Source",
           "UserData", "cache_choice", "cached", "describe", "distribute", "epoch_layout", "from_arrays",
           "label_spec", "load_source", "plan_batches", "preprocess", "train_dataset", "val_dataset"]
