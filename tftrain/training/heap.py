"""Python's garbage collector while training and converting.

A full collection scans every object the process tracks, and a run's process holds
millions: TensorFlow's, tf_keras' and tfmot's modules, the model, its traced functions,
tfmot's clones. In the quickstart's process (2026-12-07, 2-core Intel Xeon) one took
0.5-0.9 s once the model was built, about one every 25 s of training: a pause of every
step (and of every worker at the next all-reduce), 2-4% of a long run's time; and
TensorFlow's converter runs one on every conversion. Objects that live through the work
are frozen (`gc.freeze`) for its length, so collections scan only what the work makes,
and unfrozen after it.
"""
from __future__ import annotations

import contextlib
import gc

from tftrain.training.device_logs import DeviceLogsCallback

# a fit of fewer steps is left alone: the collection before the freeze would cost about
# what the collections during it do
MIN_STEPS = 100


class FrozenWhileFitting(DeviceLogsCallback):
    """In a `fit` of at least `MIN_STEPS` steps: after its first call (the train function
    traced), one full collection, then every object alive frozen, so the collections while
    it trains pass over the model, its functions and the data and scan only what steps and
    epochs make; unfrozen when `fit` ends (`release`, which the caller also calls when
    `fit` raises)."""

    def __init__(self, steps: int):
        super().__init__()
        self.steps, self.first, self.frozen = steps, True, False

    def on_train_batch_end(self, batch, logs=None):
        if self.first:
            self.first = False
            if self.steps >= MIN_STEPS:
                gc.collect()
                gc.freeze()
                self.frozen = True

    def on_train_end(self, logs=None):
        self.release()

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


@contextlib.contextmanager
def older_objects_frozen():
    """Inside, garbage collections pass over the objects made before. TensorFlow's
    converter collects all garbage on every conversion from a SavedModel (`lite.py`, to
    free the graph it loaded): in a run's process, beside a trained QAT model, 0.5-1 s of
    CPU a conversion. What the conversion loads is made inside and still collected; older
    garbage is left to the next collection."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
