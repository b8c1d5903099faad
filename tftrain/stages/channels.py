"""Channel pruning (`compression.pruning.structure: channels`): the trained model's
least important channels go, group by group (`compress.channels`), leaving a physically
narrower model with the surviving weights, which this stage retrains and hands on (to QAT,
the export) like any other model. A narrowed network has lost what its missing channels
computed, more than a pruned one whose weights stay in place: by default it retrains on
training's schedule (warm-up and decay over this stage's updates), not at the constant
tenth of training's rate the other fine-tuning stages take. With `distill: true` it also
learns the trained wide model's logits (`stages.distill`'s loss, with
`compression.distillation`'s temperature and alpha), the usual way to win back what
narrowing lost (the teacher is the trained model a restart rebuilds the same)."""
from __future__ import annotations

import numpy as np

from tftrain.stages.base import Built, Stage


class ChannelPrune(Stage):
    name = "channels"
    section = "compression.pruning"
    teacher = None          # the trained wide model, with `distill`

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.compression.pruning.enabled and cfg.compression.pruning.channels

    retrains = True      # a narrowed model: on training's schedule by default

    def plan(self, net, ctx):
        """The groups and the channels each keeps, checked on the model (a layer the
        groups cannot follow is a `ConfigError` naming it); the next stage gets a model
        of the narrowed shape."""
        from tftrain.compress import channels

        cfg = self.cfg.compression.pruning
        graph, self.channel_plan = channels.plan(net, cfg.target_flops, cfg.min_channels,
                                                 cfg.channel_multiple)
        if cfg.importance == "bn":
            channels.importance(graph, "bn")
        return channels.narrowed(graph, {g: np.arange(k)
                                         for g, k in self.channel_plan.counts.items()})

    def build(self, net, ctx) -> Built:
        """The narrowed model, from the channels `net` (trained) holds most weight in: the
        same on every worker and on every restart, since `net` is."""
        from tftrain.compress import channels

        cfg = self.cfg.compression.pruning
        graph = channels.ChannelGraph(net)
        keep = channels.select(graph, self.channel_plan.counts, cfg.importance)
        self.teacher = net if cfg.distill else None
        return Built(channels.narrowed(graph, keep))

    def train_model(self):
        if self.teacher is None:
            return super().train_model()
        from tftrain.stages.distill import distiller
        return distiller(self.teacher, self.cfg.compression.distillation)

    def finalize(self, built: Built, result: dict, ctx):
        from tftrain.compress import channels

        p = self.channel_plan
        result["channels"] = {"groups": p.groups, "flops_before": p.flops_before,
                              "flops_after": channels.flops(built.net),
                              "flops_ratio": channels.flops(built.net) / max(p.flops_before, 1),
                              "params": int(built.net.count_params())}
        return built.net

    def describe(self, ctx) -> str:
        d = self.cfg.compression.distillation
        teacher = (f"; learns from the trained wide model at temperature {d.temperature:g}, "
                   f"alpha {d.alpha:g}") if self.cfg.compression.pruning.distill else ""
        return super().describe(ctx) + f"; {self.channel_plan.describe()}{teacher}"
