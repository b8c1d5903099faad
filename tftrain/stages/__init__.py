"""The pipeline's stages, in the order they run: each enabled stage gets the model the
previous one finished with. One module per stage (see `base.Stage` for the interface);
adding one is its module and one line here.

May import: every package (`core`, `optim`, `config`, `data`, `models`, `runtime`,
`training`, `compress`, `export`); not the top-level modules.
"""
from __future__ import annotations

from tftrain.stages.base import Built, Stage
from tftrain.stages.channels import ChannelPrune
from tftrain.stages.distill import Distill
from tftrain.stages.freeze import Freeze
from tftrain.stages.prune import Prune
from tftrain.stages.qat import QAT
from tftrain.stages.train import Train

# The order stages run in.
STAGES: tuple[type[Stage], ...] = (
    Freeze,
    Train,
    Distill,
    Prune,
    ChannelPrune,
    QAT,
)


def plan_stages(cfg, steps_per_epoch: int, smoke: bool = False) -> list[Stage]:
    """The stages this config runs, each with its length in optimizer updates."""
    stages = [cls(cfg=cfg, steps_per_epoch=steps_per_epoch, smoke=smoke)
              for cls in STAGES if cls.enabled(cfg)]
    replaced = {name for stage in stages for name in stage.supersedes()}
    return [stage for stage in stages if stage.name not in replaced]


def __getattr__(name: str):
    """The runner's names, imported when first asked for: planning the stages (the dry
    run) loads no TensorFlow."""
    if name in ("Preempted", "StageRunner", "fit", "scratch_dir"):
        from tftrain.stages import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'tftrain.stages' has no attribute {name!r}")


__all__ = ["Built", "Preempted", "STAGES", "Stage", "StageRunner", "fit", "plan_stages",
           "scratch_dir"]
