"""Learning rates as Keras schedules of optimizer updates: warmup, a constant, the factor
a rollback lowers, and the rate the next update will use.

Every schedule is a function of `optimizer.iterations`, which counts optimizer updates
(not micro-batches), so warmup and decay are the same whatever the accumulation steps.
"""
from __future__ import annotations

import tensorflow as tf

from tftrain.core import internals
from tftrain.core.keras import keras


@keras.utils.register_keras_serializable("tftrain")
class Warmup(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak` over `steps` updates, then `after(step - steps)`."""

    def __init__(self, after, steps: int, peak: float):
        self.after, self.steps, self.peak = after, int(steps), float(peak)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = self.peak * (step + 1.0) / float(max(self.steps, 1))
        rest = self.after(tf.maximum(step - self.steps, 0.0))
        return tf.where(step < self.steps, warm, rest)

    def get_config(self):
        return {"after": keras.optimizers.schedules.serialize(self.after),
                "steps": self.steps, "peak": self.peak}


@keras.utils.register_keras_serializable("tftrain")
class Constant(keras.optimizers.schedules.LearningRateSchedule):
    def __init__(self, value: float):
        self.value = float(value)

    def __call__(self, step):
        return tf.constant(self.value, tf.float32)

    def get_config(self):
        return {"value": self.value}


def current_lr(optimizer) -> float:
    """The learning rate the next update will use."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = internals.learning_rate(inner)     # the schedule itself, not its last value
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return float(lr(inner.iterations))
    return float(keras.backend.get_value(lr))


@keras.utils.register_keras_serializable("tftrain")
class Scaled(keras.optimizers.schedules.LearningRateSchedule):
    """`schedule` times a factor held in a variable: the rollback after a non-finite loss
    lowers it, and the stage's checkpoint keeps it (`learning_rate_factor`)."""

    def __init__(self, schedule, factor=1.0):
        self.schedule = schedule
        with tf.init_scope():
            self.factor = tf.Variable(float(factor), trainable=False, name="lr_factor")

    def __call__(self, step):
        return self.schedule(step) * self.factor

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule),
                "factor": float(self.factor.numpy())}


def learning_rate_state(optimizer):
    """The variable that scales the learning rate (the schedule's factor, or a plain
    rate itself): what the rollback after a non-finite loss lowers and a checkpoint
    must keep."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = internals.learning_rate(inner)
    return lr.factor if isinstance(lr, Scaled) else lr
