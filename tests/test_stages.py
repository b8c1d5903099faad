"""Stages: which run, how long, at what learning rate (the fitting is in test_run.py)."""
from tftrain.config import load_config
from tftrain.stages import Stage, plan_stages


def test_training_alone():
    assert plan_stages(load_config(None, ["train.epochs=3"]), 23) == [Stage("train", 3, 69)]


def test_compression_stages_follow_training_with_their_own_rates():
    cfg = load_config(None, ["train.epochs=3", "train.optimizer.learning_rate=0.01",
                             "compression.pruning={enabled: true, epochs: 2}",
                             "compression.quantization={enabled: true, epochs: 1, learning_rate: 0.0005}"])
    assert plan_stages(cfg, 23) == [Stage("train", 3, 69), Stage("prune", 2, 46, 0.001),
                                    Stage("qat", 1, 23, 0.0005)]


def test_smoke_runs_one_epoch_of_each():
    cfg = load_config(None, ["compression.quantization.enabled=true"])
    assert plan_stages(cfg, 3, smoke=True) == [Stage("train", 1, 3), Stage("qat", 1, 3, 0.0001)]
