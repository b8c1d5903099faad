"""Optimizers by name, and the learning rate around a schedule (`tftrain/schedules.py`):
warmup, the factor a rollback lowers, the rate of the next update.

Every schedule is a function of `optimizer.iterations`, which counts optimizer updates
(not micro-batches), so warmup and decay are the same whatever the accumulation steps.
"""
from __future__ import annotations

import tensorflow as tf

from tftrain._keras import keras
from tftrain.config import ConfigError, OptimizerConfig
from tftrain.registry import Registry, check_params
from tftrain.schedules import Horizon, Schedule

OPTIMIZERS = Registry("optimizer", "train.optimizer.name")

OPTIMIZERS.register("sgd")(keras.optimizers.SGD)
OPTIMIZERS.register("adam")(keras.optimizers.Adam)
OPTIMIZERS.register("adamw")(keras.optimizers.AdamW)
OPTIMIZERS.register("rmsprop")(keras.optimizers.RMSprop)


def build_optimizer(cfg: OptimizerConfig, learning_rate):
    """The configured optimizer; `params` (momentum, nesterov, beta_1, ...) are checked
    against the optimizer's own arguments."""
    cls = OPTIMIZERS.get(cfg.name)
    reserved = {"learning_rate", "weight_decay", "clipnorm", "global_clipnorm"}
    bad = reserved & set(cfg.params)
    check_params(cls.__init__, {k: v for k, v in cfg.params.items() if k not in reserved},
                 "train.optimizer.params", skip=1, strict=True)
    if bad:
        raise ConfigError(f"train.optimizer.params.{sorted(bad)[0]}: set it as "
                          f"train.optimizer.{sorted(bad)[0]}, not under params")
    kwargs = dict(cfg.params)
    for key in ("weight_decay", "clipnorm", "global_clipnorm"):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    return cls(learning_rate=learning_rate, **kwargs)


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


def build_schedule(cfg: Schedule, lr: float, steps_per_epoch: int, total_steps: int):
    """A LearningRateSchedule of optimizer updates (the schedule's own `build`, after
    warmup), or a float for `plateau`."""
    warmup = cfg.warmup_steps.steps(steps_per_epoch, total_steps)
    schedule = cfg.build(lr, Horizon(steps_per_epoch, total_steps, warmup))
    if schedule is None:
        return lr
    return Warmup(schedule, warmup, lr) if warmup else schedule


def plateau_callback(cfg: Schedule):
    """ReduceLROnPlateau (its state kept in checkpoints) for the `plateau` schedule, else
    None."""
    from tftrain.callbacks import ReduceLROnPlateau

    if cfg.name != "plateau":
        return None
    return ReduceLROnPlateau(monitor=cfg.monitor, factor=cfg.factor, patience=cfg.patience,
                             min_lr=cfg.min_lr, min_delta=cfg.min_delta, verbose=1)


def current_lr(optimizer) -> float:
    """The learning rate the next update will use."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = inner._learning_rate     # the schedule itself (`learning_rate` gives its last value)
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
    lr = inner._learning_rate
    return lr.factor if isinstance(lr, Scaled) else lr


def slots_per_weight(cfg: OptimizerConfig) -> int:
    """Optimizer state variables per weight, counted on the configured optimizer itself
    (tf_keras' SGD, for one, keeps a momentum slot even at momentum 0)."""
    with tf.init_scope(), tf.device("/cpu:0"):
        optimizer = build_optimizer(cfg, 0.001)
        probe = tf.Variable(tf.zeros([7]), name="probe")
        optimizer.build([probe])
        return sum(1 for v in optimizer.variables if v.shape == probe.shape)
