"""Knowledge distillation: the loss, its gradients under replicas and accumulation, and
the stage end to end (teacher of this run or a SavedModel, resume, prune after it)."""
import json
import signal

import numpy as np
import pytest
import tensorflow as tf

from helpers import ROOT, model_weights, shared_run
from tftrain.core.keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.run import main
from tftrain.stages.distill import distiller_class, soft_target_loss
from tftrain.training.losses import build_loss

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SPEC = InputSpec((8, 8, 1), "float32", 10)


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_soft_target_loss_is_t_squared_kl_of_the_softened_logits():
    rng = np.random.default_rng(0)
    t, s = rng.normal(size=(5, 4)) * 3, rng.normal(size=(5, 4)) * 3
    p, q = _softmax(t / 4.0), _softmax(s / 4.0)
    kl = np.sum(p * (np.log(p) - np.log(q)), axis=-1)
    got = float(soft_target_loss(tf.constant(t, tf.float32), tf.constant(s, tf.float32), 4.0))
    assert got == pytest.approx(16 * kl.mean(), rel=1e-5)
    w = np.array([1, 1, 0, 1, 1], np.float32)      # a padding example counts for nothing
    weighted = float(soft_target_loss(tf.constant(t, tf.float32), tf.constant(s, tf.float32),
                                      4.0, tf.constant(w)))
    assert weighted == pytest.approx(16 * np.sum(w * kl) / 5, rel=1e-5)
    same = float(soft_target_loss(tf.constant(t, tf.float32), tf.constant(t, tf.float32), 4.0))
    assert same == pytest.approx(0.0, abs=1e-6)


def distiller(teacher, alpha=0.3, temperature=2.0, accumulation=1):
    cls = type("D", (distiller_class(),), {"teacher": staticmethod(teacher),
                                           "alpha": alpha, "temperature": temperature})
    keras.utils.set_random_seed(7)
    student = MODELS.get("mlp")(SPEC, hidden=[8])
    model = cls.wrap(student, accumulation)
    model.compile(keras.optimizers.SGD(0.5), build_loss("sparse_categorical_crossentropy"))
    return model


def teacher_model():
    keras.utils.set_random_seed(3)
    return MODELS.get("mlp")(SPEC, hidden=[32])


def data(n=64):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, n)


def test_the_loss_is_alpha_ce_plus_one_minus_alpha_t2_kl():
    teacher = teacher_model()
    model = distiller(teacher)
    x, y = data(16)
    logits = model(x).numpy()
    loss = float(model.compute_loss(x, tf.constant(y), tf.constant(logits)))
    ce = float(np.mean(-np.log(_softmax(logits)[np.arange(16), y])))
    p, q = _softmax(teacher(x).numpy() / 2.0), _softmax(logits / 2.0)
    kl = np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=-1))
    assert loss == pytest.approx(0.3 * ce + 0.7 * 4.0 * kl, rel=1e-5)


def test_distilled_updates_equal_under_replicas_and_accumulation():
    x, y = data(64 * 4)

    def weights(strategy, accumulation):
        with strategy.scope():
            model = distiller(teacher_model(), accumulation=accumulation)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64, drop_remainder=True)
        model.fit(ds, epochs=1, verbose=0)
        return model.get_weights()

    one = weights(tf.distribute.OneDeviceStrategy("/cpu:0"), 1)
    split = weights(tf.distribute.MirroredStrategy(            # 2 replicas x 2 x 16 examples
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()), 2)
    for a, b in zip(one, split):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = weights(tf.distribute.OneDeviceStrategy("/cpu:0"), 1)
    assert any(not np.allclose(a, b) for a, b in zip(moved, distiller(teacher_model()).get_weights()))


DISTILL = ["train.epochs=2", "train.checkpoint.every=7", "train.verbose=0", "export.tflite=int8",
           "export.preflight=false",      # (test_preflight.py's)
           "run.deterministic=true",
           "compression.distillation={enabled: true, epochs: 3, temperature: 2, alpha: 0.5, "
           "student: {name: cnn, params: {filters: [16, 32], dense: [32]}}}"]


def _args(run_dir, *sets):
    return [str(QUICKSTART), "--run-dir", str(run_dir),
            *[a for s in (*DISTILL, *sets) for a in ("--set", s)]]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    def build(out):
        assert main(_args(out)) == 0
        from tensorflow.python.framework import config as tf_config
        assert not tf_config.is_op_determinism_enabled()   # run.deterministic ends with the run
    return shared_run(tmp_path_factory, "distilled", build)[0] / "quickstart"


@pytest.mark.slow
def test_the_student_is_trained_from_the_teacher_and_exported(distilled):
    summary = json.loads((distilled / "summary.json").read_text())
    assert list(summary["stages"]) == ["train", "distill"]
    assert summary["stages"]["distill"]["updates"] == 3 * 23
    assert summary["metrics"] == summary["stages"]["distill"]["metrics"]
    assert summary["metrics"]["val_accuracy"] > 0.5          # learning (benchmarks/distill.py
    #                                                          measures how well)
    student = model_weights(distilled, "distill")
    teacher = model_weights(distilled)
    assert sum(v.size for v in student.values()) * 4 < sum(v.size for v in teacher.values())
    int8 = summary["artifacts"]["tflite_int8"]
    assert int8["verified"] and abs(int8["accuracy"] - summary["metrics"]["val_accuracy"]) <= 0.02
    assert (distilled / "metrics-distill.csv").exists()


@pytest.mark.slow
def test_sigterm_in_distillation_resumes_to_the_same_student(tmp_path, capsys, monkeypatch,
                                                             distilled):
    import os

    from tftrain.training.train_step import TrainModel
    calls = []
    original = TrainModel.evaluate

    def evaluate(self, *args, **kwargs):      # train: 2 validations (its metrics the last's,
        calls.append(1)                       # not evaluated again); then distill's
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(TrainModel, "evaluate", evaluate)
        assert main(_args(tmp_path)) == 42
    assert "in stage distill at update 23/69" in capsys.readouterr().err
    assert main(_args(tmp_path)) == 0
    assert "at update 23/69 of stage distill" in capsys.readouterr().out
    ours, reference = model_weights(tmp_path / "quickstart", "distill"), model_weights(distilled, "distill")
    assert ours.keys() == reference.keys()
    for name in reference:
        np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_saved_model_teacher_replaces_training_and_pruning_follows(distilled, tmp_path):
    teacher = distilled / "export" / "saved_model"
    args = _args(tmp_path, f"compression.distillation.teacher={teacher}",
                 "compression.pruning={enabled: true, epochs: 1, final_sparsity: 0.5}")
    assert main(args) == 0
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert list(summary["stages"]) == ["distill", "prune"]
    assert summary["steps"] == 3 * 23                              # the first stage's updates
    assert set(summary["sparsity"]) == {"conv_0", "conv_1", "dense_0", "logits"}   # the student's
    assert all(v == pytest.approx(0.5, abs=0.01) for v in summary["sparsity"].values())
    assert summary["stages"]["distill"]["metrics"]["val_accuracy"] > 0.5
    assert summary["metrics"]["val_accuracy"] > 0.3


@pytest.mark.parametrize("sets,pattern", [
    (["compression.distillation={enabled: true}"],
     r"compression\.distillation\.student: required"),
    (["compression.distillation={enabled: true, teacher: /no/such/dir, student: {name: mlp}}"],
     r"compression\.distillation\.teacher: /no/such/dir is not a SavedModel directory"),
    (["compression.distillation={enabled: true, student: {name: cnnn}}"],
     r"compression\.distillation\.student\.name: unknown model 'cnnn'.*did you mean 'cnn'"),
    (["compression.distillation={enabled: true, alpha: 1.5, student: {name: mlp}}"],
     r"compression\.distillation\.alpha: "),
])
def test_bad_distillation_config_exits_2(tmp_path, capsys, sets, pattern):
    args = [str(QUICKSTART), "--run-dir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(pattern, err), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("policy,accumulation", [("mixed_float16", 2), ("mixed_bfloat16", 1)])
def test_distillation_under_mixed_precision_and_accumulation(tmp_path, policy, accumulation):
    sets = ["train.epochs=1", "train.verbose=0", "export.tflite=none", "export.saved_model=false",
            f"precision.policy={policy}", f"train.accumulation_steps={accumulation}",
            "data.per_replica_batch_size=16", "train.jit_compile=false",
            # a small teacher: bfloat16 is emulated on CPUs without BF16 instructions
            "model.params={filters: [8, 16], dense: [32]}",
            "compression.distillation={enabled: true, epochs: 1, temperature: 2, alpha: 0.5, "
            "student: {name: cnn, params: {filters: [16, 32], dense: [32]}}}"]
    args = [str(QUICKSTART), "--run-dir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    before = keras.mixed_precision.global_policy().name
    assert main(args) == 0
    assert keras.mixed_precision.global_policy().name == before       # left as it was
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["precision"] == policy and summary["accumulation_steps"] == accumulation
    assert summary["all_reduce"]["loss_scaled"] is (policy == "mixed_float16")
    distill = summary["stages"]["distill"]
    assert distill["updates"] == summary["steps_per_epoch"]
    assert np.isfinite(distill["metrics"]["val_loss"]) and distill["metrics"]["val_accuracy"] > 0.3
