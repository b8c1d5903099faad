"""The channel-pruning stage: plan line, the narrowed model handed on, exact resume."""
import json
import signal

import numpy as np
import pytest

from helpers import QUICKSTART, cli, model_weights, resumed_at, start_run, wait_for_checkpoint

SETS = ["train.epochs=1", "train.checkpoint.every=4", "export.tflite=none", "export.preflight=false",
        "run.deterministic=true", "model.params={filters: [16, 32], dense: [64], dropout: 0.2}",
        "compression.pruning={enabled: true, structure: channels, target_flops: 0.5, epochs: 2}"]


def test_distill_makes_the_narrowed_model_learn_the_wide_models_logits():
    """`distill: true`: the stage trains with the distillation loss, the teacher being the
    wide model it narrowed (alpha * CE + (1 - alpha) * T^2 * KL, at
    compression.distillation's temperature and alpha); without it, the plain loss."""
    import tensorflow as tf

    from tftrain.config import load_config
    from tftrain.data import InputSpec
    from tftrain.models import MODELS
    from tftrain.stages import plan_stages
    from tftrain.stages.distill import soft_target_loss

    spec = InputSpec((8, 8, 1), "float32", 10)
    sets = ["compression.pruning={enabled: true, structure: channels, distill: true, epochs: 1}",
            "compression.distillation={temperature: 2.0, alpha: 0.25}"]
    wide = MODELS.get("cnn")(spec, filters=[16, 32], dense=[64])
    x = np.random.default_rng(0).normal(size=(6, 8, 8, 1)).astype(np.float32)
    y = tf.constant([0, 1, 2, 3, 4, 5])
    losses = []
    for distill in (True, False):
        cfg = load_config(None, sets + [f"compression.pruning.distill={distill}"])
        stage, = [s for s in plan_stages(cfg, 10) if s.name == "channels"]
        stage.plan(wide, None)
        built = stage.build(wide, None)
        assert (stage.teacher is wide) == distill
        model = stage.train_model().wrap(built.net, 1)
        model.compile(optimizer="sgd", loss=tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        student = model(x, training=False)
        losses.append(float(model.compute_loss(x, y, student)))
        if distill:
            hard = float(tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, student, from_logits=True)))
            soft = float(soft_target_loss(wide(x, training=False), student, 2.0))
            assert soft > 1e-3 and losses[0] == pytest.approx(0.25 * hard + 0.75 * soft, rel=1e-5)
    assert losses[1] != pytest.approx(losses[0], rel=1e-3)      # the plain loss without it
    with pytest.raises(Exception, match="compression.pruning.distill: only with structure"):
        load_config(None, ["compression.pruning={enabled: true, distill: true}"])


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
