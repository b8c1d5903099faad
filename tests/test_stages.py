"""Stages: which run, how long, at what learning rate, and the interface each keeps (the
fitting is in test_run.py)."""
import pytest

from tftrain.config import load_config
from tftrain.stages import STAGES, Stage, plan_stages


def summary(stages):
    return [(s.name, s.epochs, s.updates, s.learning_rate) for s in stages]


def test_training_alone():
    assert summary(plan_stages(load_config(None, ["train.epochs=3"]), 23)) == [("train", 3, 69, None)]


def test_compression_stages_follow_training_with_their_own_rates():
    cfg = load_config(None, ["train.epochs=3", "train.optimizer.learning_rate=0.01",
                             "compression.pruning={enabled: true, epochs: 2}",
                             "compression.quantization={enabled: true, epochs: 1, learning_rate: 0.0005}"])
    assert summary(plan_stages(cfg, 23)) == [("train", 3, 69, None), ("prune", 2, 46, 0.001),
                                             ("qat", 1, 23, 0.0005)]


def test_smoke_runs_one_epoch_of_each():
    cfg = load_config(None, ["compression.quantization.enabled=true"])
    assert summary(plan_stages(cfg, 3, smoke=True)) == [("train", 1, 3, None), ("qat", 1, 3, 0.0001)]


@pytest.mark.parametrize("cls", STAGES)
def test_every_stage_implements_the_interface_and_reads_its_own_section(cls):
    assert cls.build is not Stage.build and cls.name
    cfg = load_config(None, ["compression.distillation.student={name: mlp}"])
    section = cls.settings(cfg)
    assert type(section).__name__.endswith("Config") and cls.configured_epochs(cfg) == section.epochs
    assert len({c.name for c in STAGES}) == len(STAGES)


def test_constructors_are_keyword_only():
    from tftrain.stages import StageRunner
    from tftrain.stages.train import Train
    with pytest.raises(TypeError):
        Train(load_config(None, []), 3)
    with pytest.raises(TypeError):
        StageRunner(None, None)


def test_a_stage_can_supersede_another():
    class Replacement(Stage):
        name, section = "replacement", "train"

        @classmethod
        def enabled(cls, cfg):
            return True

        @classmethod
        def configured_epochs(cls, cfg):
            return 2

        def supersedes(self):
            return ("train",)

    from tftrain import stages
    original = stages.STAGES
    stages.STAGES = original + (Replacement,)
    try:
        assert summary(plan_stages(load_config(None, []), 5)) == [("replacement", 2, 10, 0.0001)]
    finally:
        stages.STAGES = original
