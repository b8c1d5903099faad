"""The Stage interface: one object per pipeline stage, each in its own module.

A stage's life, in the order `run.py` drives it:

1. `plan(net, ctx)`: at plan time, inside the strategy scope, before anything is
   written: check the stage's config and the model it will get (the previous stage's),
   and return the model the next stage will get (training builds it here).
2. `build(net, ctx)`: inside the strategy scope, under the stage's own `precision`: the
   network it trains, its update hooks and callbacks (a `Built`).
   `begin(built, batches)`: once, before its first update (QAT calibrates its ranges).
3. the shared runner fits it (`StageRunner`: checkpoints, resume, preemption,
   non-finite losses, logs) and evaluates it.
4. `finalize(built, result, ctx)`: strip, swap in averages, measure; returns the model
   the next stage (or the export) gets. It runs whether the stage trained now or had
   finished before a restart.
5. `describe(ctx)`: its line in the printed plan.

Adding a stage: a module with a `Stage` subclass and one line in `stages/__init__.py`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class Built:
    """A stage's network as it trains, and what trains it besides the step."""
    net: Any
    hooks: tuple = ()              # once per optimizer update (see `TrainModel`)
    callbacks: tuple = ()          # Keras callbacks adding to the logs
    stateful: tuple = ()           # callbacks whose counters go into the checkpoint
    average: Any = None            # a `WeightAverage` evaluated and used at the end


class Stage:
    """One stage of the pipeline, planned in optimizer updates."""

    name: ClassVar[str]
    section: ClassVar[str]                 # the config section it reads, for messages
    quantization_aware: ClassVar[bool] = False   # exports as an int8 QAT model
    # accumulate in a Python loop: for forward passes that synchronise replicas
    # (`merge_call` is not allowed inside a while loop)
    unroll: ClassVar[bool] = False
    # batch-norm statistics re-estimated at its end (`train.recalibrate_batch_norm`)
    recalibrates: ClassVar[bool] = True

    def __init__(self, *, cfg, steps_per_epoch: int, smoke: bool = False):
        self.cfg, self.steps_per_epoch, self.smoke = cfg, steps_per_epoch, smoke
        self.epochs = 1 if smoke else self.configured_epochs(cfg)
        self.updates = self.epochs * steps_per_epoch

    # -- what the config asks for -------------------------------------------------------
    @classmethod
    def settings(cls, cfg):
        """The stage's own config section (`section`, a dotted path)."""
        for part in cls.section.split("."):
            cfg = getattr(cfg, part)
        return cfg

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cls.settings(cfg).enabled

    @classmethod
    def configured_epochs(cls, cfg) -> int:
        return cls.settings(cfg).epochs

    def supersedes(self) -> tuple[str, ...]:
        """Stages this one replaces when enabled (e.g. a given teacher replaces training)."""
        return ()

    # a stage that trains a new or narrowed model: by default on training's schedule, not
    # at the constant tenth of training's rate a fine-tuning stage takes
    retrains = False

    @property
    def learning_rate(self) -> float | None:
        """A constant rate for this stage (its section's `learning_rate`, by default
        training's / 10, or none if it `retrains`); None: training's optimizer schedule."""
        own = getattr(self.settings(self.cfg), "learning_rate", None)
        return own if own or self.retrains else self.cfg.train.optimizer.learning_rate / 10

    # -- the stage's life ---------------------------------------------------------------
    def precision(self, ctx):
        """The stage's precision (a `Precision`); by default the run's."""
        return ctx.precision

    def plan(self, net, ctx):
        """Plan-time checks; returns the model the next stage gets."""
        return net

    def check(self) -> None:
        """Plan-time checks every stage shares: its loss, metrics and learning rate build."""
        self.loss()
        metric_names(self.cfg.train.metrics)
        self.schedule()

    def build(self, net, ctx) -> Built:
        raise NotImplementedError

    def begin(self, built: Built, batches) -> str:
        """Before the stage's first update (not on a resume: its checkpoint holds what
        this sets up). `batches(n)`: n training batches, the same on every worker and
        rerun (`n=None`: about 2,000 examples). Returns a line to print ("": none)."""
        return ""

    def finalize(self, built: Built, result: dict, ctx):
        """The model the next stage or the export gets."""
        return built.net

    def training(self):
        """The context the stage's updates are traced and run in."""
        return contextlib.nullcontext()

    def recalibrating(self):
        """The context batch-norm statistics are re-estimated in, at the stage's end."""
        return contextlib.nullcontext()

    def describe(self, ctx) -> str:
        return self.length()

    def length(self, counted: bool = True) -> str:
        """The start of its plan line: its epochs and updates, as the config gives them
        (what `--dry-run` prints before anything is built); its epochs alone where the
        examples are not `counted` yet (read with the data)."""
        head = f"stage {self.name}: {self.epochs} epochs"
        return f"{head} = {self.updates} updates at {self.rate()}" if counted else head

    def rate(self) -> str:
        """The stage's learning rate as `describe` prints it."""
        return ("training's schedule" if self.learning_rate is None else
                f"learning rate {self.learning_rate:g}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(epochs={self.epochs}, updates={self.updates})"

    # -- how it trains ------------------------------------------------------------------
    def loss(self):
        from tftrain.training.losses import build_loss
        return build_loss(self.cfg.train.loss)

    def train_model(self):
        """The Keras model class whose `train_step` trains the stage."""
        from tftrain.training.train_step import TrainModel
        return TrainModel

    def recompute(self, ctx):
        """How the stage's forward pass recomputes activations (`train.recompute`, or the
        planner's choice for `auto`): None, ("blocks", None) or ("every", K)."""
        if self.cfg.train.recompute == "auto":
            plan = ctx.parallel.memory_plan
            if plan is None or not plan.recompute:
                return None
        return self.cfg.train.segmenting()

    def recomputing(self):
        """A context the recomputation of a segment is traced in (what a second forward
        pass must leave as the first left it, beyond batch norm and dropout)."""
        return contextlib.nullcontext()

    def checkpoint_dir(self, root: Path) -> Path:
        return root / self.name

    def log_names(self) -> tuple[str, str]:
        """(metrics CSV file, TensorBoard subdirectory)."""
        return f"metrics-{self.name}.csv", self.name

    def schedule(self):
        """The learning rate: a constant of the stage's own, else training's schedule over
        this stage's updates; wrapped in a factor the rollback can lower (and checkpoints
        keep)."""
        from tftrain.optim import optimizers, rates

        cfg = self.cfg.train
        if self.learning_rate is None:
            lr = optimizers.build_schedule(cfg.schedule, cfg.optimizer.learning_rate,
                                           self.steps_per_epoch, self.updates)
        else:
            lr = rates.Constant(self.learning_rate)
        return lr if isinstance(lr, float) else rates.Scaled(lr)

    def compile(self, built: Built, ctx):
        """(training model, optimizer) for `built`: tftrain's train step around its
        network, under the stage's precision and the run's parallelism. Call inside the
        strategy scope."""
        from tftrain.optim import optimizers

        precision = self.precision(ctx)
        model = self.train_model().wrap(
            built.net, ctx.batches.accumulation * ctx.parallel.microbatches,
            update_hooks=built.hooks, unroll=self.unroll,
            parallel=ctx.parallel, precision=precision, recompute=self.recompute(ctx),
            recomputing=self.recomputing)
        optimizer = precision.wrap_optimizer(
            optimizers.build_optimizer(self.cfg.train.optimizer, self.schedule()))
        ctx.parallel.pin(optimizer)
        model.resizable_calls = self.cfg.train.steps_per_execution == "auto"
        model.log_local_metrics()        # the runner's `GlobalMetrics` logs global values
        model.compile_step(optimizer, self.loss(), metric_names(self.cfg.train.metrics),
                           fixed_steps_per_execution(self.cfg))
        optimizer.build(model.trainable_variables)   # slots exist before a restore
        return model, optimizer


def fixed_steps_per_execution(cfg) -> int:
    """Steps per call to compile with (`auto` starts at 1; `ExecutionSizer` raises it)."""
    spe = cfg.train.steps_per_execution
    return 1 if spe == "auto" else spe


def metric_names(names):
    """The configured Keras metric names, each checked."""
    from tftrain.core.keras import keras
    from tftrain.config import ConfigError

    for name in names:
        try:
            known = name in ("accuracy", "acc") or callable(keras.metrics.get(name))
        except ValueError:
            known = False
        if not known:
            raise ConfigError(f"train.metrics: unknown metric '{name}'; use Keras metric names "
                              "such as accuracy, sparse_top_k_categorical_accuracy")
    return list(names)
