"""Optimizers and learning-rate schedules by name.

Every schedule is a function of `optimizer.iterations`, which counts optimizer updates
(not micro-batches), so warmup and decay are the same whatever the accumulation steps.
Durations in the config ("3 epochs" or a number of updates) become updates through
`Duration.steps(steps_per_epoch, total)`, the one conversion.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from tftrain._keras import keras
from tftrain.config import ConfigError, OptimizerConfig, ScheduleConfig
from tftrain.registry import Registry, check_params

OPTIMIZERS = Registry("optimizer", "train.optimizer.name")
SCHEDULES = Registry("schedule", "train.schedule.name")

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


@dataclass(frozen=True)
class Horizon:
    """What schedules need to know about the length of training, in updates."""
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int

    @property
    def decay_steps(self) -> int:
        return max(1, self.total_steps - self.warmup_steps)


def _piecewise(lr, boundaries, gamma):
    """lr * gamma**k after the k-th boundary has been reached (update >= boundary)."""
    values = [lr * gamma**i for i in range(len(boundaries) + 1)]
    # PiecewiseConstantDecay switches after step > boundary; ours switch at step == boundary.
    return keras.optimizers.schedules.PiecewiseConstantDecay([b - 1 for b in boundaries], values)


@SCHEDULES.register("constant")
def _constant(cfg, lr, h):
    return Constant(lr)


@SCHEDULES.register("step")
def _step(cfg, lr, h):
    size = cfg.step_size.steps(h.steps_per_epoch, h.total_steps) if cfg.step_size else h.steps_per_epoch
    return _piecewise(lr, list(range(size, h.decay_steps, size)) or [h.decay_steps], cfg.gamma)


@SCHEDULES.register("multistep")
def _multistep(cfg, lr, h):
    bounds = [m.steps(h.steps_per_epoch, h.total_steps) - h.warmup_steps for m in (cfg.milestones or [])]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ConfigError(f"train.schedule.milestones: they fall at updates "
                          f"{[b + h.warmup_steps for b in bounds]}, which must be increasing; "
                          "list them in order, each at a later update")
    return _piecewise(lr, [max(b, 1) for b in bounds] or [h.decay_steps], cfg.gamma)


def _decay_steps(cfg, h):
    return cfg.decay_steps.steps(h.steps_per_epoch, h.total_steps) if cfg.decay_steps else h.decay_steps


@SCHEDULES.register("exponential")
def _exponential(cfg, lr, h):
    steps = cfg.decay_steps.steps(h.steps_per_epoch, h.total_steps) if cfg.decay_steps else h.steps_per_epoch
    return keras.optimizers.schedules.ExponentialDecay(lr, steps, cfg.decay_rate, cfg.staircase)


@SCHEDULES.register("polynomial")
def _polynomial(cfg, lr, h):
    return keras.optimizers.schedules.PolynomialDecay(
        lr, _decay_steps(cfg, h), cfg.end_learning_rate, cfg.power)


@SCHEDULES.register("cosine")
def _cosine(cfg, lr, h):
    return keras.optimizers.schedules.CosineDecay(lr, _decay_steps(cfg, h), cfg.alpha)


@SCHEDULES.register("plateau")
def _plateau(cfg, lr, h):
    return None  # a plain learning rate changed by the ReduceLROnPlateau callback


def build_schedule(cfg: ScheduleConfig, lr: float, steps_per_epoch: int, total_steps: int):
    """A LearningRateSchedule of optimizer updates, or a float for `plateau`."""
    warmup = cfg.warmup_steps.steps(steps_per_epoch, total_steps)
    horizon = Horizon(steps_per_epoch, total_steps, warmup)
    schedule = SCHEDULES.get(cfg.name)(cfg, lr, horizon)
    if schedule is None:
        return lr
    return Warmup(schedule, warmup, lr) if warmup else schedule


def plateau_callback(cfg: ScheduleConfig):
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
    rate itself): what `scale_learning_rate` changes and a checkpoint must keep."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    lr = inner._learning_rate
    return lr.factor if isinstance(lr, Scaled) else lr


def scale_learning_rate(model, factor: float) -> None:
    """Multiply the learning rate from now on by `factor` (schedules keep their shape)."""
    state = learning_rate_state(model.optimizer)
    if isinstance(state, tf.Variable) or hasattr(state, "assign"):
        state.assign(state * factor)
        return
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    inner._learning_rate = Scaled(state, factor)     # a schedule built without a factor
    model.train_function = None                      # retrace with it
