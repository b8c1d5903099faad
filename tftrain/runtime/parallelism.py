"""How one training step spreads over devices: data parallel (one device, mirrored
replicas on one machine, or workers of a cluster) or placed (model parallel, the layers
split over devices in stages). The runner and the train step ask this object what to
do; nothing else checks which kind it is.

`choose` decides on one machine from the model's size (the planner), or takes the
strategy already built for a cluster or a smoke run.
"""
from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from tftrain.config import Config, ConfigError
from tftrain.core import internals
from tftrain.runtime.strategy import describe
from tftrain.runtime import placement
from tftrain.runtime import planner
from tftrain.runtime import segments
from tftrain.runtime import strategy
from tftrain.config import PlacementConfig
from tftrain.runtime.strategy import local_devices
from tftrain.runtime.strategy import any_worker, worker_mean
from tftrain.core.keras import keras
from tftrain.runtime.strategy import StrategyInfo
from tftrain.runtime.placement import build_placed
from tftrain.runtime.placement import pin_updates
from tftrain.runtime.placement import measure_bubble


class Parallelism:
    """Data parallel: every replica holds the whole model and computes the gradients of
    its share of the batch; the optimizer sums them over replicas once per update."""

    microbatches = 1        # a placed pipeline splits each micro-batch further
    unroll = False          # whether the step must loop over micro-batches in Python
    # whether micro-batches may run side by side (a pipeline's stages work on different
    # ones at once); otherwise each starts after the previous one's gradients, so one
    # micro-batch's activations are alive at a time
    overlap_micro_batches = False
    _draft = None           # see `take_draft`

    def __init__(self, *, strategy=None, memory_plan=None, draft=None):

        self.strategy = strategy or tf.distribute.get_strategy()
        self.info = describe(self.strategy)
        self.memory_plan = memory_plan
        self._draft = draft

    def take_draft(self):
        """The model the plan sized, built under this strategy from the run's seed, once
        (the first stage's network: `stages.train.build_network`); None where the plan
        built it before the strategy existed (`distribute.strategy: auto`) or not at all."""
        draft, self._draft = self._draft, None
        return draft

    @property
    def agree(self):
        """`agree(*flags) -> bool(s)`: whether any worker raised each flag, the same answer
        on all (None on one worker: a local flag is the answer)."""
        return None

    @property
    def mean(self):
        """`mean(values) -> values`: the element-wise mean over the cluster's replicas, the
        same on all workers (None on one worker)."""
        return None

    def build(self, builder):
        """The model `builder()` builds, laid out for this kind (call in the strategy scope)."""
        return builder()

    def detach(self, net, clone=None):
        """The model the chief exports alone (every worker calls this, at the same point).
        `clone(net)`: how the model is copied where a copy is needed (the QAT stage's)."""
        return net

    def beside(self, variable):
        """The device scope for an op that belongs beside `variable`."""
        return contextlib.nullcontext()

    def step_scope(self, model):
        """The device scope of the step's own ops (loss, metrics, counters)."""
        return contextlib.nullcontext()

    def gradients(self, forward, variables):
        """(y_pred, loss, gradients) of `forward() -> (y_pred, loss)`."""
        with tf.GradientTape() as tape:
            y_pred, loss = forward()
        return y_pred, loss, tape.gradient(loss, variables)

    def pin(self, optimizer) -> None:
        """Where the optimizer's per-variable updates run (replicated: each replica's own)."""

    def check(self, plan) -> None:
        """Plan-time checks of the batch plan."""

    def training_devices(self) -> list[str]:
        return local_devices(self.strategy)

    def input_devices(self) -> list[str]:
        """Where each replica's batch is consumed (a device feed's copies go there)."""
        return self.training_devices()

    def describe(self) -> list[str]:
        return [self.memory_plan.describe()] if self.memory_plan is not None else []

    def estimated_bytes(self) -> float | None:
        """The planner's bytes for the device that holds most, the training set's copy
        on it included (None: no plan was made)."""
        plan = self.memory_plan
        return max(e.total for e in plan.per_device) + plan.resident.bytes if plan is not None else None

    def summary(self, net, batch, loss) -> dict:
        """What summary.json says of the layout (`batch()`: a batch to measure on)."""
        plan = self.memory_plan
        return {"placement": None, "memory_plan": None if plan is None else {
            "kind": plan.kind, "stages": plan.stages, "device_memory": plan.memory,
            "recompute": plan.recompute, "host": plan.host,
            "bytes_per_device": [e.total for e in plan.per_device]}}


class MultiWorker(Parallelism):
    """Data parallel over the workers of a cluster: flags (stop, non-finite loss) are
    agreed on by all workers with one small all-reduce, so they stop together."""

    def __init__(self, *, strategy, memory_plan=None, draft=None):

        super().__init__(strategy=strategy, memory_plan=memory_plan, draft=draft)
        self._agree, self._mean = any_worker(strategy), worker_mean(strategy)

    @property
    def agree(self):
        return self._agree

    @property
    def mean(self):
        return self._mean

    def detach(self, net, clone=None):
        """A copy of `net` outside the cluster's strategy, with its weights (`clone(net)`,
        by default Keras' `clone_model` in tfmot's `quantize_scope`). The chief
        exports alone, and a model of the cluster's strategy cannot run alone: its
        `predict` is distributed, and reading batch-norm statistics (synchronised on
        read) is a collective. Reading the weights here is that collective, which every
        worker joins."""
        import tensorflow_model_optimization as tfmot


        weights = net.get_weights()
        if clone is not None:
            copy = clone(net)
        else:
            with tfmot.quantization.keras.quantize_scope():       # QAT wrappers, if any
                copy = keras.models.clone_model(net)
        copy.set_weights(weights)
        return copy


class Placed(Parallelism):
    """Model parallel: each layer's variables and ops on its stage's device, each batch
    split into the pipeline's micro-batches (an unrolled loop, so stage k can work on
    micro-batch i while stage k+1 works on i-1). Every op of the step gets a device:
    gradients beside their forward ops, sums, zero-fills and unscaling beside their
    variable, each optimizer update on its variable's device, and the loss, metrics and
    counters where the model's outputs are."""

    unroll = True
    overlap_micro_batches = True

    def __init__(self, *, placement, memory_plan=None):

        self.strategy = tf.distribute.get_strategy()
        self.placement, self.memory_plan = placement, memory_plan
        self.info = StrategyInfo("model_parallel", placement.devices, 1, 1)
        self.microbatches = placement.microbatches

    def build(self, builder):
        return build_placed(builder, self.placement)

    def beside(self, variable):
        return tf.device(variable.device)

    def step_scope(self, model):
        layer = internals.history(model.outputs[0]).layer
        return tf.device(getattr(layer, "_tftrain_device", ""))

    def gradients(self, forward, variables):
        if tf.executing_eagerly():
            return super().gradients(forward, variables)
        # tf.gradients colocates each gradient op with its forward op; a tape leaves them
        # unplaced (and the placer would not keep a stage's backward pass on its device).
        y_pred, loss = forward()
        return y_pred, loss, tf.gradients(loss, variables)

    def pin(self, optimizer) -> None:
        pin_updates(optimizer)

    def check(self, plan) -> None:
        if plan.per_replica % self.microbatches:
            raise ConfigError(f"model.placement.microbatches: {self.microbatches} does not "
                              f"divide the batch of {plan.per_replica}; use a divisor of it")

    def training_devices(self) -> list[str]:
        return list(self.placement.devices)

    def input_devices(self) -> list[str]:
        return list(self.placement.devices[:1])      # the first stage takes the batch

    def describe(self) -> list[str]:
        return super().describe() + [self.placement.describe()]

    def summary(self, net, batch, loss) -> dict:

        p = self.placement
        x, y = batch()
        return {**super().summary(net, batch, loss), "placement": {
            "devices": list(p.devices), "microbatches": p.microbatches, "balance": p.balance,
            "stage_costs": list(p.costs),
            "stages": [[n for n, s in zip(p.layers, p.stage) if s == k]
                       for k in range(p.num_stages)],
            "bubble_formula": p.bubble(),
            **measure_bubble(net, p, x, y, loss)}}   # the idle fraction, on one batch


def placed(builder, base, layout: PlacementConfig, batch: int, memory_plan) -> Placed:
    """Model parallelism as `layout` says; `microbatches: auto` measured on the placed
    model (`placement.fastest_microbatches`): pipelining is chosen only where it ran
    faster than the whole batch at once."""
    plan = placement.plan(base, layout, batch)
    if layout.microbatches == "auto":
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        best, times = placement.fastest_microbatches(build_placed(builder, plan), batch, loss)
        plan = dataclasses.replace(plan, microbatches=best, measured=tuple(times.items()))
    return Placed(placement=plan, memory_plan=memory_plan)


def of_strategy(strategy, memory_plan=None, draft=None) -> Parallelism:
    """The data-parallel object for an existing strategy (`draft`: the model the plan
    built under it, see `Parallelism.take_draft`)."""

    if describe(strategy).workers > 1:
        return MultiWorker(strategy=strategy, memory_plan=memory_plan, draft=draft)
    return Parallelism(strategy=strategy, memory_plan=memory_plan, draft=draft)


def recompute_kept(cfg: Config, base, costs) -> float | None:
    """Activation bytes per example a step of `base` keeps with `train.recompute` (auto:
    blocks), None where it is none."""
    how = cfg.train.segmenting()
    if how is None:
        return None
    found = segments.segments(base, *how)
    return segments.kept_bytes(base, found, {c.name: c.activation_bytes for c in costs})


def choose(cfg: Config, policy: str, builder,
           resident: planner.Resident = planner.Resident()) -> Parallelism:
    """On one machine: the configured placement, else the planner's choice for
    `distribute.strategy: auto` (data parallel when the model fits one device, else the
    fewest stages that fit). `builder()` builds the model (for its sizes); `resident`:
    what each training device holds before any step (`tftrain.plan.resident`)."""

    devices = strategy.resolve_devices(cfg.distribute)
    # a data-parallel strategy the config names is built first and the model sized under
    # it, the first stage's network (`take_draft`) rather than built a second time;
    # `auto` sizes the model to choose the strategy
    explicit = cfg.distribute.strategy != "auto" and cfg.model.placement is None
    strat = strategy.build_strategy(cfg) if explicit else None
    with strat.scope() if strat is not None else contextlib.nullcontext():
        base = placement.build(builder)
    costs = placement.layer_costs(base)
    batch, acc = cfg.data.per_replica_batch_size, cfg.train.accumulation_steps
    if cfg.model.placement is not None:
        wanted = cfg.model.placement.devices
        missing = strategy.missing_devices(wanted)
        if missing:
            raise ConfigError(f"model.placement.devices: {', '.join(missing)} does not exist; set "
                              "distribute.virtual_cpus to split the CPU into more devices")
        memory_plan = planner.choose(cfg, costs, wanted, policy, batch, acc,
                                     force_stages=len(wanted), resident=resident)
        return placed(builder, base, cfg.model.placement, batch, memory_plan)
    copies = strategy.local_replicas(cfg.distribute, devices)
    memory_plan = planner.choose(cfg, costs, devices, policy, batch, acc, replicas=copies,
                                 kept=recompute_kept(cfg, base, costs), resident=resident)
    if memory_plan.kind == "model":
        if cfg.distribute.strategy != "auto":
            raise ConfigError(
                f"distribute.strategy: the model needs {memory_plan.per_device[0].total / 2**20:,.1f}"
                f" MiB per stage and does not fit one device with '{cfg.distribute.strategy}'; "
                "set distribute.strategy: auto (model parallel) or model.placement")
        layout = PlacementConfig(devices=devices[:memory_plan.stages], balance="memory",
                                 microbatches="auto")
        return placed(builder, base, layout, batch, memory_plan)
    return of_strategy(strat or strategy.build_strategy(cfg), memory_plan,
                       draft=base if strat is not None else None)
