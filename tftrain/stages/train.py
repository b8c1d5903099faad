"""Training: the configured model from its initial weights, with training's optimizer
schedule, early stopping, reduce-on-plateau and (`train.ema`) a weight average."""
from __future__ import annotations

from tftrain.stages.base import Built, Stage


class Train(Stage):
    name = "train"
    section = "train"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return True

    @property
    def learning_rate(self):
        return None                     # training's schedule

    def plan(self, net, ctx):
        """The model (unless a frozen phase built it), built now (the same initial weights on every path) so the plan can
        describe it and the later stages can check it before anything is written."""
        self.net = net if net is not None else build_network(self.cfg, ctx)
        return self.net

    def build(self, net, ctx) -> Built:
        from tftrain.training import callbacks
        from tftrain.optim.averaging import WeightAverage
        from tftrain.training.callbacks import EarlyStopping

        train = self.cfg.train
        es = train.early_stopping
        stateful = [callbacks.plateau_callback(train.schedule),
                    es and EarlyStopping(self.net, monitor=es.monitor, patience=es.patience,
                                         min_delta=es.min_delta, verbose=1,
                                         restore_best_weights=es.restore_best_weights)]
        average = WeightAverage(self.net, train.ema.decay) if train.ema else None
        return Built(self.net, hooks=(average,) if average else (),
                     stateful=tuple(c for c in stateful if c), average=average)

    def finalize(self, built: Built, result: dict, ctx):
        from tftrain.export import artifacts

        # the float model's size, the baseline of the compression stages' ratios; on every
        # worker: writing a batch-norm statistic (synchronised on read) is a collective, and
        # the chief alone would wait for a partner busy with the next stage's first check
        if ctx.stages[-1] is not self and "float32_variables_gzip_bytes" not in result:
            result["float32_variables_gzip_bytes"] = artifacts.saved_model_variables_gzip(built.net)
        return built.net

    def length(self, counted: bool = True) -> str:
        if not counted and self.epochs:
            return f"training: {self.epochs} epochs"
        if not self.updates:
            return ("training: none (train.epochs: 0): the model is evaluated as it starts"
                    + (", its batch-norm statistics re-estimated" if
                       self.cfg.train.recalibrate_batch_norm not in ("off", False) else ""))
        return (f"training: {self.epochs} epochs x {self.steps_per_epoch} updates = "
                f"{self.updates} updates"
                + (f"; weights averaged (EMA decay {self.cfg.train.ema.decay:g})"
                   if self.cfg.train.ema else ""))

    def checkpoint_dir(self, root):
        return root

    def log_names(self) -> tuple[str, str]:
        return "metrics.csv", ""


def build_network(cfg, ctx):
    """The configured model from its seeded initial weights, under the run's precision
    and parallelism: the one the plan built to size it where it built it so
    (`Parallelism.take_draft`)."""
    draft = ctx.parallel.take_draft()
    if draft is not None:
        return draft
    return ctx.parallel.build(lambda: seeded_model(cfg, ctx.precision, ctx.source.spec))


def seeded_model(cfg, precision, spec):
    """The configured model from the run's seed, under `precision`: the plan's draft and
    the first stage's network are built alike."""
    from tftrain.core.keras import keras
    from tftrain.models import build_model

    keras.utils.set_random_seed(cfg.run.seed)
    return precision.build(lambda: build_model(cfg.model, spec))
