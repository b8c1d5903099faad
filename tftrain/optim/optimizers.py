"""Optimizers by name, and the learning rate of a run: its schedule
(`schedules.py`) with warmup (`rates.py`).

Every schedule is a function of `optimizer.iterations`, which counts optimizer updates
(not micro-batches), so warmup and decay are the same whatever the accumulation steps.
"""
from __future__ import annotations

import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.core.config_types import ConfigError
from tftrain.optim.configs import OptimizerConfig
from tftrain.core.registry import Registry, check_params
from tftrain.optim import fused
from tftrain.optim.schedules import Horizon, Schedule
from tftrain.optim.rates import Warmup

OPTIMIZERS = Registry("optimizer", "train.optimizer.name")

# tf_keras' own, each variable updated by one fused op (`fused.py`: half the graph of a
# many-layer model's train step, the same arithmetic)
OPTIMIZERS.register("sgd")(fused.SGD)
OPTIMIZERS.register("adam")(fused.Adam)
OPTIMIZERS.register("adamw")(fused.AdamW)
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


def build_schedule(cfg: Schedule, lr: float, steps_per_epoch: int, total_steps: int):
    """A LearningRateSchedule of optimizer updates (the schedule's own `build`, after
    warmup), or a float for `plateau`."""
    warmup = cfg.warmup_steps.steps(steps_per_epoch, total_steps)
    schedule = cfg.build(lr, Horizon(steps_per_epoch, total_steps, warmup))
    if schedule is None:
        return lr
    return Warmup(schedule, warmup, lr) if warmup else schedule


def slots_per_weight(cfg: OptimizerConfig) -> int:
    """Optimizer state variables per weight, counted on the configured optimizer itself
    (tf_keras' SGD, for one, keeps a momentum slot even at momentum 0)."""
    with tf.init_scope(), tf.device("/cpu:0"):
        optimizer = build_optimizer(cfg, 0.001)
        probe = tf.Variable(tf.zeros([7]), name="probe")
        optimizer.build([probe])
        return sum(1 for v in optimizer.variables if v.shape == probe.shape)
