"""The run's plan: devices, strategy, precision, data, parallelism, batches and stages,
decided and checked before anything is written (`make`), and printed (`describe`)."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from tftrain.config import Config, ConfigError
from tftrain.core import internals
from tftrain.export import kinds

if TYPE_CHECKING:          # (the plan is read before TensorFlow loads: `--dry-run`)
    from tftrain.core.keras import keras
    from tftrain.data import BatchPlan, EpochLayout, Source
    from tftrain.data.feed import FeedChoice
    from tftrain.export.preflight import Preflight
    from tftrain.runtime.parallelism import Parallelism
    from tftrain.runtime.precision import Precision
    from tftrain.stages import Stage


@contextlib.contextmanager
def process_settings_kept():
    """Puts back what a run switches for its whole process (op determinism, which
    `run.deterministic` turns on), so a Python caller's later code and runs are unaffected."""
    before = internals.op_determinism()
    try:
        yield
    finally:
        if internals.op_determinism() != before:
            internals.set_op_determinism(before)


@dataclass(frozen=True)
class RunPlan:
    """Everything the stages and the runner share (what a stage's `ctx` is), made once by
    `make` and then frozen. While `make` plans the stages, each gets the draft without
    `model`, `flops_per_example` and `preflight` (what the stages decide)."""
    cfg: Config
    smoke: bool
    parallel: Parallelism
    precision: Precision     # the run's
    source: Source           # as read and checked (`training_source`: what trains)
    batches: BatchPlan
    layout: EpochLayout
    steps_per_epoch: int
    chief: bool
    stages: tuple[Stage, ...]
    model: keras.Model | None = None       # the first stage's model, as planned
    flops_per_example: float = 0.0
    preflight: Preflight | None = None     # the exports, converted already
    feed: FeedChoice | None = None         # where training batches are made (`data.feed`)

    @cached_property
    def training_source(self) -> Source:
        """The source the stages train and validate on and the export checks with: its
        decoded training set in memory when it fits (`data.cached`), made on first use
        (after the run directory is open; not by the dry run)."""
        from tftrain import data
        return data.cached(self.source, self.cfg.data)

    @property
    def first_model(self) -> keras.Model:
        """The first stage's model, as planned (what `make` sets on the plan it returns)."""
        if self.model is None:
            raise RuntimeError("a draft plan has no model yet: tftrain.plan.make sets it")
        return self.model

    @property
    def qat(self) -> bool:
        """Whether the last stage trains quantization-aware (the export is int8)."""
        return self.stages[-1].quantization_aware

    def training_line(self) -> str:
        from tftrain.training.rundir import run_path
        updates = max(1, self.stages[0].updates)
        return (optimizer_line(self.cfg, self.steps_per_epoch, updates)
                + f"\nrun directory: {run_path(self.cfg, self.smoke)}")

    @cached_property
    def peak(self):
        """The training devices' measured peak FLOP/s (what MFU is quoted against)."""
        from tftrain.runtime.planner import peak_flops
        return peak_flops(self.parallel.training_devices(), self.precision.policy,
                          self.parallel.info.workers)

    def topology(self) -> dict:
        """Where the run executes and how an update's examples are split: what its
        checkpoints are written under (`topology.json`, compared when it resumes)."""
        b, info, wire = self.batches, self.parallel.info, self.precision.wire
        return {"workers": info.workers, "replicas": info.replicas,
                "per_replica_batch": b.per_replica, "accumulation_steps": b.accumulation,
                "global_batch": b.global_batch, "shard_policy": self.cfg.data.shard_policy,
                # one stream every worker takes its share of, or files read as
                # several streams (FILE sharding: one per worker the run began with)
                "streams": self.layout.streams,
                "precision": self.precision.policy, "all_reduce": wire.dtype,
                "loss_scaled": wire.loss_scaled,
                # what computes over a micro-batch rather than per example: a resume on
                # another per-replica batch would change what the updates compute
                "micro_batch_bound": self.micro_batch_bound()}

    def micro_batch_bound(self) -> list[str]:
        """What makes an update depend on how its examples are grouped into micro-batches
        (batch-norm statistics, batch augmentations that pair examples)."""
        from tftrain.data import augment

        found = [f"batch norm ({layer.name})" for layer in self.first_model.submodules
                 if "BatchNormalization" in type(layer).__name__][:1]
        found += [f"data.augment {op.name}" for op in augment.build(self.cfg.data.augment)
                  if op.batch]
        return found

    def describe(self) -> str:
        from tftrain import data
        from tftrain.models.files import origin as model_origin
        from tftrain.runtime.strategy import device_table

        b, source, model = self.batches, self.source, self.first_model
        info = self.parallel.info
        lines = [
            device_table(self.parallel.strategy),
            f"precision: {self.precision.policy}"
            + (f"; {self.precision.wire.describe()}" if info.replicas > 1 else ""),
            f"data: {source.num_train} train / {source.num_val} validation examples, input "
            f"{source.spec.shape} {source.spec.dtype}, {source.spec.num_classes} classes",
            f"batch: {b.per_replica} per replica x {b.replicas} replicas x "
            f"{b.accumulation} accumulation steps = global batch {b.global_batch}",
            self.stages[0].describe(self),
            f"model: {model.name}, {model.count_params():,} parameters",
            *([origin.describe()] if (origin := model_origin(self.cfg.model.name)) else []),
            *(stage.describe(self) for stage in self.stages[1:]),
        ]
        if b.accumulation > 1 and any("BatchNormalization" in type(layer).__name__
                                      for layer in model.layers):
            lines.append("note: batch norm computes statistics per micro-batch of "
                         f"{b.per_replica} examples, not over the whole global batch")
        lines.append(data.describe(source, self.layout, self.cfg.data, self.feed))
        if (how := self.stages[0].recompute(self)) is not None:
            from tftrain.runtime import segments
            lines.append(f"recompute: {segments.describe(segments.segments(model, *how), *how)}"
                         "; all but the last recomputed in the backward pass")
        lines.append(kinds.exports_line(self.cfg, self.qat))
        lines.append(self.training_line())
        if self.preflight is not None:
            lines.append(self.preflight.describe())
        from tftrain.runtime.cluster import describe_source, slurm_without_srun
        lines += [line for line in (describe_source(), slurm_without_srun()) if line]
        return "\n".join(lines + self.parallel.describe())


def sketch(cfg: Config, smoke: bool = False) -> str:
    """The plan as the config and the machine tell it before TensorFlow loads (what
    `--dry-run` prints in a second or two): strategy and replicas, precision, data and
    batch arithmetic, stages in updates, optimizer, schedule, checkpoints, exports and the
    run directory. Sizes only TensorFlow can read (files of records, a model's parameters)
    are left to `--dry-run --full`."""
    import math

    from tftrain.core.batches import per_replica_batch
    from tftrain.runtime.forking import local_gpus
    from tftrain.runtime.cluster import current_task, describe_source, resolve_kind
    from tftrain.stages import plan_stages
    from tftrain.training.rundir import run_path

    d = cfg.distribute
    gpus = local_gpus()
    devices = len(d.devices) if d.devices else (len(gpus) or d.virtual_cpus or 1)
    task = current_task()
    # the run's own functions, on the devices the config names (TensorFlow lists them)
    kind = resolve_kind(d, [f"device:{i}" for i in range(devices)])
    replicas = 1 if kind in ("one_device", "default") else devices * task.num_workers
    total = _examples(cfg)
    acc = cfg.train.accumulation_steps
    b = per_replica_batch(cfg, replicas, acc)
    g = b * replicas * acc
    lines = ["plan, from the config (--dry-run --full builds the model, --dry-run --preflight "
             "also converts the exports):",
             f"strategy: {kind}   replicas: {replicas}   workers: {task.num_workers}"
             f"{f' (from {task.source})' if task.source != 'local' else ''}   devices: "
             + (f"{len(gpus)} GPUs" if gpus else f"{devices} logical CPU(s)")
             + (" per worker" if task.num_workers > 1 else ""),
             f"precision: {cfg.precision.policy}"
             + (" (chosen from the devices when TensorFlow loads)" if cfg.precision.policy == "auto"
                else ""),
             f"batch: {b} per replica x {replicas} replicas x {acc} accumulation steps = global "
             f"batch {g}"]
    if total is not None:
        val = int(round(total * cfg.data.validation_fraction))
        train = total - val
        steps = (math.ceil if cfg.data.remainder == "pad" else math.floor)(train / g)
        if smoke:
            steps = min(steps, cfg.train.smoke_steps)
        lines.insert(3, f"data: {cfg.data.name}, {train} train / {val} validation examples")
    else:
        steps = None
        lines.insert(3, f"data: {cfg.data.name} (examples counted when it is read)")
    # the stages as the run plans them (`plan_stages`), each with its length in updates
    # (their epochs alone where the examples are counted only when the data is read)
    stages = plan_stages(cfg, steps or 0, smoke)
    lengths = [stage.length(counted=steps is not None) for stage in stages]
    lines.append(lengths[0])
    lines.append(f"model: {cfg.model.name}"
                 + (f" ({', '.join(f'{k} {v}' for k, v in cfg.model.params.items())})"
                    if cfg.model.params else ""))
    lines += lengths[1:]
    first = stages[0]
    if steps:
        lines.append(optimizer_line(cfg, steps, max(1, first.updates)))
    lines.append(kinds.exports_line(cfg, stages[-1].quantization_aware, built=False))
    lines.append(f"run directory: {run_path(cfg, smoke)}")
    if where := describe_source():
        lines.append(where)
    return "\n".join(lines)


def _examples(cfg: Config) -> int | None:
    """The dataset's examples, where the config says them without reading the data."""
    params = cfg.data.params
    if cfg.data.name == "digits":
        return 1797                           # scikit-learn's bundled digits
    if cfg.data.name == "synthetic":
        return int(params.get("num_examples", 2048))
    return None


def optimizer_line(cfg: Config, steps_per_epoch: int, updates: int) -> str:
    """The optimizer, its schedule and the checkpoints, as the plan prints them."""
    o, sched, ckpt = cfg.train.optimizer, cfg.train.schedule, cfg.train.checkpoint
    warmup = sched.warmup_steps.steps(steps_per_epoch, updates)
    extras = [f"weight decay {o.weight_decay:g}" if o.weight_decay else "",
              f"clipnorm {o.clipnorm:g}" if o.clipnorm else "",
              f"global_clipnorm {o.global_clipnorm:g}" if o.global_clipnorm else "",
              *[f"{k} {v}" for k, v in o.params.items()]]
    return (f"optimizer: {o.name}, learning rate {o.learning_rate:g}"
            + "".join(f", {e}" for e in extras if e)
            + f"; schedule {sched.name}" + (f" after {warmup} warmup updates" if warmup else "")
            + f"; checkpoint every {ckpt.every.steps(steps_per_epoch, updates)} updates "
            f"(keep {ckpt.keep})")


def make(cfg: Config, *, smoke: bool, stop) -> RunPlan:
    """Plan the run: nothing is written, and every check that can fail early fails here."""
    import tensorflow as tf

    from tftrain import data
    from tftrain.runtime import parallelism
    from tftrain.export import preflight
    from tftrain.runtime import strategy
    from tftrain.training import xla
    from tftrain.training.memory import host_allocated
    from tftrain.data import augment
    from tftrain.core.keras import keras
    from tftrain.runtime.placement import layer_costs
    from tftrain.runtime.precision import Precision, choose_policy
    from tftrain.stages import plan_stages

    strategy.configure_devices(cfg)                  # logical devices first, before any op
    # MultiWorkerMirroredStrategy (a cluster, or one worker under TF_CONFIG) configures
    # the collectives, which must come before any op runs: built first, planned around
    multi_worker = strategy.resolve_kind(cfg.distribute, devices=[]) == "multi_worker"
    planned_here = not multi_worker
    if not planned_here:                             # then the collectives, before all else
        strat = strategy.build_strategy(cfg)
        stop.rearm()                                 # (the collectives' own SIGTERM handler)
    keras.backend.experimental.enable_tf_random_generator()   # RNG state checkpointable
    if cfg.run.deterministic:
        tf.config.experimental.enable_op_determinism()
    policy = choose_policy(cfg.precision)
    before = host_allocated()
    source = data.load_source(cfg.data, cfg.run.seed)
    held = host_allocated() - before        # the source's arrays, in the CPU allocator
    augment.check(augment.build(cfg.data.augment), source.spec.shape, source.spec.dtype)
    if source.num_val == 0:
        raise ConfigError(f"data.validation_fraction: {cfg.data.validation_fraction} leaves no "
                          "validation examples; raise it (e.g. 0.15) or give a validation split")
    if planned_here:        # one machine: the planner chooses data or model parallelism
        from tftrain.stages.train import seeded_model
        draft = Precision(policy=policy, config=cfg.precision)   # the first stage may adopt it
        parallel = parallelism.choose(cfg, policy, lambda: seeded_model(cfg, draft, source.spec),
                                      resident=resident(cfg, source, held))
    else:
        parallel = parallelism.of_strategy(strat)
    memory = parallel.memory_plan
    batches = data.plan_batches(cfg, parallel.info.replicas, memory.accumulation
                                if memory and cfg.train.global_batch_size else None)
    parallel.check(batches)
    # a resumed run reads its files as the streams it began with, on any number of
    # workers; files decoded into memory (`data.cached`) are one stream all workers share
    from tftrain.training import rundir
    streams = 1 if data.cache_choice(source, cfg.data) == "memory" else \
        rundir.recorded_streams(rundir.run_path(cfg, smoke))
    layout = data.epoch_layout(source, batches, cfg.data, parallel.info.workers, streams)
    steps_per_epoch = layout.steps(batches)
    feed = plan_feed(cfg, source, parallel.input_devices())
    if smoke:
        steps_per_epoch = min(steps_per_epoch, cfg.train.smoke_steps)
    planning = RunPlan(cfg, smoke, parallel,
                       Precision.for_strategy(policy=policy, config=cfg.precision,
                                              distribute=cfg.distribute,
                                              strategy=parallel.strategy),
                       source, batches, layout, steps_per_epoch, strategy.is_chief(),
                       tuple(plan_stages(cfg, steps_per_epoch, smoke)))
    with parallel.strategy.scope():   # each stage checks the model it will get
        net, first = None, None
        for stage in planning.stages:
            stage.check()
            xla.check(cfg, stage, parallel)
            net = stage.plan(net, planning)
            first = net if first is None else first
    for kind in kinds.enabled(cfg, planning.qat):          # what an artifact cannot be made of
        why = kind.refusal(cfg, net, planning.qat)
        if why:
            raise ConfigError(why)
    return dataclasses.replace(
        planning, model=first, flops_per_example=sum(c.flops for c in layer_costs(first)), feed=feed,
        # every export converted once from the model the last stage hands on, before any update
        preflight=preflight.run(cfg, net, source, qat=planning.qat))


# the global batches a host pipeline holds in its buffers (AUTOTUNE prefetch; measured
# 6.3 and 6.6 on MobileNetV2's batches of 128 and 512 images: benchmarks/recompute.py)
INPUT_BUFFER_BATCHES = 8


def resident(cfg: Config, source, held: float = 0.0):
    """What each training device holds before any step (`planner.Resident`), where its
    memory is planned (`distribute.device_memory`, or a GPU's): a device feed's copy of
    the training set (`plan_feed` on the devices the run trains on). A CPU's memory is
    the host's, one allocator for everything the process holds, so there it also counts
    the source's arrays (`held`: measured as they loaded, where the allocator counts),
    the training set decoded into memory later (`data.cache`) and the host pipeline's
    buffers."""
    from tftrain.data import feed as feeding, pipeline
    from tftrain.runtime import planner, strategy

    devices = strategy.resolve_devices(cfg.distribute)
    gpu = "GPU" in devices[0].upper()
    if not (cfg.distribute.device_memory or gpu):
        return planner.Resident()  # host memory: `data.cache_budget` already bounds the copies
    fed = plan_feed(cfg, source, devices).device
    decoded = float(feeding.decoded_bytes(source))
    copy = decoded if fed else 0.0
    if gpu:
        return planner.Resident(copy, "the training set's copy", "data.feed: host frees it") \
            if copy else planner.Resident()
    example = decoded / max(1, source.num_train)
    batch = cfg.train.global_batch_size or (
        cfg.data.per_replica_batch_size * strategy.local_replicas(cfg.distribute, devices)
        * cfg.train.accumulation_steps)
    buffers = 0.0 if fed else INPUT_BUFFER_BATCHES * batch * example
    arrays = decoded if pipeline.holds_arrays(source) else 0.0
    host = max(held, arrays) + pipeline.decoded_later(source, cfg.data) + buffers
    return planner.Resident(copy + host, "the host's data: arrays and "
                            + ("the feed's copy" if fed else "input buffers"))


def plan_feed(cfg: Config, source, devices: list[str]) -> FeedChoice:
    """`data.feed` for this run on `devices` (where each replica's batch is consumed):
    from the device (the copies go to each replica's device, judged against 1/8 of a
    GPU's memory or `distribute.device_memory`; on CPUs against `data.cache_budget`) or
    from the host pipeline."""
    from tftrain.data import feed as feeding
    from tftrain.runtime import planner

    sized = cfg.distribute.device_memory or "GPU" in devices[0].upper()
    memory = planner.device_memory(devices[0], cfg.distribute.device_memory) if sized else None
    return feeding.choose(source, cfg.data, memory, len(devices))
