"""Magnitude pruning, driven by optimizer updates (tfmot's wrapper and schedules).

tfmot's `PruneLowMagnitude` increments its step and may update masks on every call in
training mode: with gradient accumulation that is N times per update, and under
MirroredStrategy its `merge_call` cannot run inside the micro-batch loop. tftrain uses the
same wrapper (same variables, schedules, mask computation and `strip_pruning`) but its
call only runs the wrapped layer; `PruningHook` sets the step to the update number,
updates masks on the schedule and re-applies them, once before and once after every
update, so the weights are sparse after each update and in every checkpoint.

The forward pass of tfmot's wrappers does not take bfloat16/float16
(tensorflow/model-optimization#367, #409): pruning runs in the training precision, the
masks applied outside the forward pass, on the float32 variables. Quantization-aware
training is `quantization.py`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot
from tensorflow_model_optimization.python.core.sparsity.keras import prune_registry
from tensorflow_model_optimization.python.core.sparsity.keras.pruning_wrapper import (
    PruneLowMagnitude,
)

from tftrain.core import internals
from tftrain.core.keras import keras
from tftrain.config import ConfigError, PruningConfig
from tftrain.core.registry import Registry

PRUNING_SCHEDULES = Registry("pruning schedule", "compression.pruning.schedule")


@dataclass(frozen=True)
class PruningPlan:
    """The pruning stage in optimizer updates (1-based update numbers, as tfmot counts)."""
    updates: int
    begin: int
    end: int
    frequency: int


def plan_pruning(cfg: PruningConfig, steps_per_epoch: int, updates: int | None = None) -> PruningPlan:
    """Begin/end of the schedule in updates of the pruning stage (`updates` long, by
    default `epochs` epochs), end aligned so the final sparsity is applied by a mask
    update at `end` (tfmot updates masks when (step - begin) is a multiple of the
    frequency)."""
    updates = updates or cfg.epochs * steps_per_epoch
    begin = cfg.begin.steps(steps_per_epoch, updates)
    end = cfg.end.steps(steps_per_epoch, updates)
    if not 0 <= begin < updates:
        raise ConfigError(f"compression.pruning.begin: update {begin} is outside the pruning "
                          f"stage (updates 0-{updates - 1}); lower it or raise "
                          "compression.pruning.epochs")
    frequency = min(cfg.frequency, max(1, end - begin))
    end = begin + max(1, (end - begin) // frequency) * frequency
    if end > updates:
        raise ConfigError(f"compression.pruning.end: update {end} is after the last update of "
                          f"the pruning stage ({updates}); lower it or raise "
                          "compression.pruning.epochs")
    return PruningPlan(updates, begin, end, frequency)


@PRUNING_SCHEDULES.register("polynomial")
def _polynomial(cfg: PruningConfig, plan: PruningPlan):
    return tfmot.sparsity.keras.PolynomialDecay(
        cfg.initial_sparsity, cfg.final_sparsity, plan.begin, plan.end, power=cfg.power,
        frequency=plan.frequency)


@PRUNING_SCHEDULES.register("constant")
def _constant(cfg: PruningConfig, plan: PruningPlan):
    return tfmot.sparsity.keras.ConstantSparsity(cfg.final_sparsity, plan.begin, plan.end,
                                                 frequency=plan.frequency)


class PruneByUpdate(PruneLowMagnitude):
    """tfmot's pruning wrapper whose forward pass only runs the wrapped layer; the step,
    the masks and the masking are `PruningHook`'s, once per optimizer update."""

    def call(self, inputs, training=None, **kwargs):
        if internals.takes_training(self.layer):
            return self.layer.call(inputs, training=training, **kwargs)
        return self.layer.call(inputs, **kwargs)


def prunable(layer) -> bool:
    """Whether tfmot can prune this layer and it has weights to prune."""
    if isinstance(layer, tfmot.sparsity.keras.PrunableLayer):
        return True
    return (prune_registry.PruneRegistry.supports(layer)
            and bool(internals.prunable_weight_names(layer)))


def pruning_refusal(cfg: PruningConfig):
    """Why a layer cannot be pruned as configured (None: it can)."""
    def refusal(layer) -> str | None:
        if not prunable(layer):
            return (f"tfmot cannot prune {type(layer).__name__} layers (Dense, Conv and "
                    "Embedding layers can be)")
        kernel = layer.get_weights()[0] if layer.get_weights() else np.zeros([])
        if cfg.m_by_n and (kernel.ndim not in (2, 4) or kernel.shape[-2] % cfg.m_by_n[1]):
            return (f"{cfg.structure} sparsity groups weights along the input axis, and its "
                    f"{kernel.shape[-2] if kernel.ndim else 0} inputs are not a multiple of "
                    f"{cfg.m_by_n[1]}")
        if cfg.block not in (None, (1, 1)) and kernel.ndim != 2:
            return "block sparsity needs a 2-D kernel (Dense); use structure \"2:4\" for convolutions"
        return None
    return refusal


def select_layers(model, rules: list[str], key: str, refusal) -> list[str]:
    """Names of the layers chosen by name/regex `rules` (full match). Every rule must
    match a layer and every layer it matches must be usable (`refusal(layer)` is None);
    with no rules, every usable layer."""
    if not rules:
        return [layer.name for layer in model.layers if refusal(layer) is None]
    names = [layer.name for layer in model.layers]
    chosen = []
    for i, rule in enumerate(rules):
        matched = [n for n in names if re.fullmatch(rule, n)]
        if not matched:
            raise ConfigError(f"{key}[{i}]: rule {rule!r} matches no layer; the model's layers "
                              f"are: {', '.join(names)}")
        chosen += [n for n in matched if n not in chosen]
    for name in chosen:
        reason = refusal(model.get_layer(name))
        if reason:
            raise ConfigError(f"{key}: layer {name}: {reason}; change the rules to leave it out")
    return chosen


def prune_model(model, cfg: PruningConfig, plan: PruningPlan):
    """A functional copy of `model` (same layers and weights) with the chosen layers
    wrapped for pruning. Call inside the strategy scope: the masks are created here."""
    names = select_layers(model, cfg.layers, "compression.pruning.layers", pruning_refusal(cfg))
    if not names:
        raise ConfigError("compression.pruning: no layer of the model can be pruned as "
                          "configured; check compression.pruning.structure/block")
    schedule = PRUNING_SCHEDULES.get(cfg.schedule)(cfg, plan)
    options = dict(pruning_schedule=schedule, block_size=tuple(cfg.block or (1, 1)),
                   block_pooling_type=cfg.block_pooling.upper(), sparsity_m_by_n=cfg.m_by_n)

    def wrap(layer):
        if layer.name in names:
            # the wrapper computes in its layer's precision: a float32 logits layer under a
            # mixed policy would otherwise get float16 inputs for its float32 kernel
            return PruneByUpdate(layer, dtype=layer.dtype_policy, **options)
        return layer

    return keras.models.clone_model(model, clone_function=wrap)


def pruned_layers(model) -> list:
    return [layer for layer in model.layers if isinstance(layer, PruneLowMagnitude)]


class PruningHook:
    """Once per optimizer update (see `TrainModel`): set the pruning step to the update
    number, update masks when the schedule says so, apply them; and after the update,
    apply them again so the weights stay sparse."""

    def __init__(self, model):
        self.layers = pruned_layers(model)

    def before_update(self, iterations):
        step = tf.cast(iterations, tf.int64) + 1
        ops = []
        for layer in self.layers:
            with tf.control_dependencies([layer.pruning_step.assign(step)]):
                with tf.control_dependencies([layer.pruning_obj.conditional_mask_update()]):
                    ops.append(self._mask(layer))
        return tf.group(ops)

    def after_update(self, iterations):
        return tf.group([self._mask(layer) for layer in self.layers])

    @staticmethod
    def _mask(layer):
        # Mirrored weights and masks are equal on every replica, so each copy is masked
        # where it lives: no reduction is needed.
        return tf.group([weight.assign(weight * mask) for weight, mask, _ in layer.pruning_vars])


def strip(model):
    """The model without pruning wrappers (tfmot's `strip_pruning`), sharing its weights."""
    return tfmot.sparsity.keras.strip_pruning(model)


def sparsity(model) -> dict[str, float]:
    """Fraction of exact zeros in each pruned layer's kernel, by layer name."""
    report = {}
    for layer in model.layers:
        inner = layer.layer if isinstance(layer, PruneLowMagnitude) else layer
        weights = [w for w in getattr(inner, "get_prunable_weights", lambda: [])()]
        if weights:
            values = np.concatenate([np.ravel(w.numpy()) for w in weights])
            report[inner.name] = float(np.mean(values == 0))
    return report


class SparsityLogger(keras.callbacks.Callback):
    """Adds `sparsity_<layer>` of each pruned layer to the epoch logs (CSV, TensorBoard)."""

    def __init__(self, model):
        super().__init__()
        self.pruned = model

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update({f"sparsity_{k}": v for k, v in sparsity(self.pruned).items()})


def kernel_sparsity(model, names) -> dict[str, float]:
    """Fraction of zeros in the kernels of the named layers (of a stripped model)."""
    return {n: float(np.mean(model.get_layer(n).get_weights()[0] == 0)) for n in names}
