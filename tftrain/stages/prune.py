"""Pruning: magnitude pruning (tfmot's wrapper, driven once per optimizer update) as a
fine-tuning stage at a constant learning rate; the wrappers are stripped at the end."""
from __future__ import annotations

from tftrain.stages.base import Built, Stage


class Prune(Stage):
    name = "prune"
    section = "compression.pruning"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return cfg.compression.pruning.enabled and not cfg.compression.pruning.channels

    def plan(self, net, ctx):
        """The schedule in updates, and the layers chosen, checked on the model."""
        from tftrain.compress import pruning

        cfg = self.cfg.compression.pruning
        self.schedule_plan = pruning.plan_pruning(cfg, self.steps_per_epoch, self.updates)
        pruning.select_layers(net, cfg.layers, "compression.pruning.layers",
                                  pruning.pruning_refusal(cfg))
        return net

    def build(self, net, ctx) -> Built:
        from tftrain.compress import pruning

        pruned = pruning.prune_model(net, self.cfg.compression.pruning, self.schedule_plan)
        return Built(pruned, hooks=(pruning.PruningHook(pruned),),
                     callbacks=(pruning.SparsityLogger(pruned),))

    def finalize(self, built: Built, result: dict, ctx):
        from tftrain.compress import pruning

        result["sparsity"] = pruning.sparsity(built.net)
        return pruning.strip(built.net)

    def describe(self, ctx) -> str:
        p = self.schedule_plan
        return (super().describe(ctx) + f"; sparsity reaches its target at update {p.end} "
                f"(from {p.begin}, masks updated every {p.frequency} updates)")
