"""The channel-pruning stage: plan line, the narrowed model handed on, exact resume."""
import json
import signal

import numpy as np
import pytest

from helpers import QUICKSTART, cli, model_weights, resumed_at, start_run, wait_for_checkpoint

SETS = ["train.epochs=1", "train.checkpoint.every=4", "export.tflite=none", "export.preflight=false",
        "run.deterministic=true", "model.params={filters: [16, 32], dense: [64], dropout: 0.2}",
        "compression.pruning={enabled: true, structure: channels, target_flops: 0.5, epochs: 2}"]


def _args(tmp_path):
    return [QUICKSTART, "--run-dir", tmp_path, *[a for s in SETS for a in ("--set", s)]]


@pytest.mark.slow
def test_sigkill_during_channel_fine_tuning_resumes_to_the_same_weights(tmp_path):
    """A run killed in its channel-pruning stage rebuilds the same narrowed model from the
    trained one (the channels are chosen from its weights) and resumes it from the
    stage's checkpoint: the weights end as those of a run never stopped; the narrowed
    model keeps <= 50% of the dense FLOPs and has fewer parameters."""
    reference = cli(*_args(tmp_path / "reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "stage channels: 2 epochs = 46 updates at training's schedule" in reference.stdout
    assert "channel groups narrowed" in reference.stdout

    proc = start_run(*_args(tmp_path))
    saved = wait_for_checkpoint(tmp_path / "quickstart" / "checkpoints" / "channels", proc, at_least=12)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    again = cli(*_args(tmp_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert saved <= resumed_at(again.stdout) < 46

    ours = model_weights(tmp_path / "quickstart", "channels")
    theirs = model_weights(tmp_path / "reference" / "quickstart", "channels")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6)
    stages = json.loads((tmp_path / "quickstart" / "summary.json").read_text())["stages"]
    narrowed = stages["channels"]["channels"]
    assert narrowed["flops_ratio"] <= 0.5 and narrowed["groups"] == 3
    # the narrowed model fine-tunes on (one short epoch of training left it far from done)
    assert stages["channels"]["metrics"]["val_accuracy"] > stages["train"]["metrics"]["val_accuracy"]
