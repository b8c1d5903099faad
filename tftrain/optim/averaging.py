"""Weight averaging: an exponential moving average (EMA) of a model's weights.

`train.ema: {decay: 0.999}` keeps, beside every float weight of the model (batch-norm
moving statistics included, as timm's ModelEmaV2 does), an average updated once per
optimizer update made (an update skipped by loss scaling does not move it):

    average = d * average + (1 - d) * weight,   d = min(decay, (1 + n) / (10 + n))

where n counts the updates made (TensorFlow's `ExponentialMovingAverage(num_updates=n)`
warm-up: early averages are not dominated by the random initial weights). The averages
live in the stage's checkpoints, so a resumed run continues the same average; at the
stage's end they replace the weights, batch-norm statistics are re-estimated for them
over `recalibrate_batches` training batches (the averaged statistics belong to no
single set of weights), and they are evaluated beside the raw weights and used for the
next stage and the export.
"""
from __future__ import annotations

import contextlib

import tensorflow as tf

from tftrain.optim.batch_loops import traced_after

from tftrain.core import internals
from tftrain.core.keras import keras


class WeightAverage:
    """The EMA of `model`'s float weights; an update hook of the train step (run once per
    optimizer update in cross-replica context). Create it inside the strategy scope."""

    def __init__(self, model, decay: float):
        self.decay = float(decay)
        self.weights = [w for w in model.weights if w.dtype.is_floating]
        with tf.init_scope():
            self.averages = []
            for w in self.weights:
                with tf.device(w.device):      # beside its weight (a placed model's stages)
                    self.averages.append(tf.Variable(w.read_value(), trainable=False,
                                                     name=f"ema/{w.name.split(':')[0]}"))
            # the updates folded into the averages so far
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="ema/updates")

    @property
    def variables(self) -> dict:
        """What a checkpoint must hold to resume the average."""
        return {"averages": self.averages, "count": self.count}

    def before_update(self, iterations):
        return tf.no_op()

    def after_update(self, iterations):
        """Fold the weights into the averages when an update was made since the last call."""
        made = tf.cast(iterations, tf.int64)
        moved = tf.cast(made > self.count, tf.float32)
        n = tf.cast(made, tf.float32)
        decay = tf.minimum(self.decay, (1.0 + n) / (10.0 + n))
        rate = (1.0 - decay) * moved           # 0 when no update was made
        extended = tf.distribute.get_strategy().extended
        ops = []
        for average, weight in zip(self.averages, self.weights):
            # per device: each replica's copy of the average follows its copy of the weight
            ops.append(extended.update(
                average, lambda a, w: a.assign_add(tf.cast(rate, a.dtype) * (w - a)),
                args=(weight,), group=True))
        with tf.control_dependencies(ops):
            return self.count.assign(tf.maximum(self.count, made))

    def apply(self, model=None, batches=()) -> None:
        """Copy the averages into the model's weights (outside any step); then, given
        `model` and training `batches`, re-estimate its batch-norm statistics for them."""
        for average, weight in zip(self.averages, self.weights):
            weight.assign(average.read_value())
        if model is not None:
            recalibrate_batch_norm(model, batches)


def batch_norm_layers(model) -> list:

    # a frozen batch norm runs in inference mode: its statistics are left as they are
    return [layer for layer in internals.all_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable]


def has_batch_norm(model) -> bool:
    return bool(batch_norm_layers(model))


@contextlib.contextmanager
def momentum_held(layers, momentum: float):
    """Batch-norm `layers` at `momentum` inside (read when a call is traced), as they
    were after: 0 leaves each batch's statistics, 1 leaves the moving ones unchanged."""
    before = [layer.momentum for layer in layers]
    try:
        for layer in layers:
            layer.momentum = momentum
        yield
    finally:
        for layer, m in zip(layers, before):
            layer.momentum = m


def recalibrate_batch_norm(model, batches) -> int:
    """Batch-norm moving statistics re-estimated as the plain mean over `batches` of
    inputs (or `(x, y, ...)` tuples), in training mode, as torch's `swa_utils.update_bn`
    does: averaged weights are not the weights the running statistics were gathered
    with. Returns the batches used (0 without batch norm).

    The model runs on each batch with momentum 0 (so each batch leaves its own
    statistics), which are added to running sums; past the first few batches through one
    traced function (`traced_after`): the model called eagerly batch by batch took 12.8 s
    of a MobileNetV3's stage end for 64 batches.

    Each replica runs the model on the same batch (`strategy.run`; every worker takes the
    same batches too) and the first replica's sums are kept: the statistics are
    sync-on-read variables, and read or updated in cross-replica context each of them is
    all-reduced across the replicas and workers, per batch (under MultiWorkerMirrored,
    eagerly, one collective per variable and batch: 58% of the profile's samples of a
    stage's end in a 2-worker ResNet-8 run), although every replica holds the same values."""
    layers = batch_norm_layers(model)
    if not layers:
        return 0
    stats = [v for layer in layers for v in (layer.moving_mean, layer.moving_variance)]
    strategy = model.distribute_strategy       # (the one the variables were made under)

    def replica_sums(x, sums):         # in replica context: the replica's own copies
        model(x, training=True)
        return [s + tf.cast(v, tf.float32) for s, v in zip(sums, stats)]

    def add(x, sums):
        added = strategy.run(replica_sums, args=(x, sums))
        return [strategy.experimental_local_results(s)[0] for s in added]
    sums = [tf.zeros(v.shape, tf.float32) for v in stats]
    used, step = 0, traced_after(add)
    with momentum_held(layers, 0.0):
        for used, batch in enumerate(batches, start=1):
            sums = step(batch[0] if isinstance(batch, tuple) else batch, sums)
    if used:
        for v, total in zip(stats, sums):
            v.assign(tf.cast(total / used, v.dtype), read_value=False)   # (reading reduces)
    return used
