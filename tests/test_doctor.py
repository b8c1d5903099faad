"""The environment doctor: version coherence with fixes, the full report, cluster kinds."""
import json
import re

import pytest

from tftrain import doctor

GOOD = {"TensorFlow": "2.21.0", "tf_keras": "2.21.0", "Keras": "3.15.1", "tfmot": "0.8.1",
        "LiteRT": "2.3.0"}


def test_a_coherent_stack_has_no_problems():
    assert doctor.stack_problems(GOOD) == []
    assert doctor.stack_problems({**GOOD, "Keras": None}) == []          # Keras 3 is optional


@pytest.mark.parametrize("change, fix", [
    ({"tf_keras": "2.20.1"}, "tf_keras 2.20.1 does not match TensorFlow 2.21.0 (their minor "
                             "versions must be equal): pip install 'tf_keras~=2.21.0'"),
    ({"tf_keras": None}, "pip install 'tf_keras~=2.21.0'"),
    ({"tfmot": None}, "pip install 'tensorflow-model-optimization>=0.8'"),
    ({"tfmot": "0.7.5"}, "0.7.5 predates tf_keras support"),
    ({"LiteRT": None}, "pip install ai-edge-litert"),
    ({"TensorFlow": "2.15.1", "tf_keras": "2.15.0"}, "pip install 'tensorflow>=2.16'"),
    ({"TensorFlow": None}, "TensorFlow is not installed"),
])
def test_each_incoherence_names_its_fix(change, fix):
    problems = doctor.stack_problems({**GOOD, **change})
    assert len(problems) == 1 and fix in problems[0], problems


def test_a_faked_tf_keras_mismatch_exits_1_naming_the_fix(monkeypatch, capsys):
    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version",
                        lambda dist: "2.20.0" if dist == "tf_keras" else real(dist))
    assert doctor.main([]) == 1
    out, err = capsys.readouterr()
    assert re.search(r"^stack\s+INCOHERENT$", out, re.M), out
    assert "tf_keras 2.20.0 does not match TensorFlow" in err and "pip install 'tf_keras~=" in err
    with pytest.raises(doctor.StackError, match="tf_keras 2.20.0 does not match"):
        doctor.check_stack()


def test_this_machine_gets_the_full_report_and_exit_0(capsys):
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    for name in ("TensorFlow", "tf_keras", "tfmot", "LiteRT", "stack", "devices", "NCCL", "cluster"):
        assert name in rows, (name, out)
    assert rows["stack"] == "coherent"
    assert rows["TensorFlow"] == doctor.installed_version("tensorflow")
    assert rows["precision auto"].split()[0] in ("float32", "mixed_bfloat16", "mixed_float16")
    import tensorflow as tf
    has_nccl = bool(tf.sysconfig.get_build_info().get("is_cuda_build")
                    and tf.config.list_physical_devices("GPU"))
    assert rows["NCCL"].startswith("yes" if has_nccl else "no"), rows["NCCL"]
    assert rows["cluster"].startswith("none")
    # the test extras install every optional extra
    assert rows["extra [onnx]"] == ", ".join(f"{d} {doctor.installed_version(d)}"
                                             for d in ("tf2onnx", "onnxruntime", "onnx"))
    assert rows["extra [sweep]"] == f"optuna {doctor.installed_version('optuna')}"


def test_a_missing_extra_says_how_to_install_it(monkeypatch):
    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version",
                        lambda d: None if d in ("onnxruntime", "mlflow", "mlflow-skinny") else real(d))
    rows = dict(doctor.extras())
    assert rows["extra [onnx]"] == 'not installed: pip install -e ".[onnx]"'
    assert rows["extra [mlflow]"] == 'not installed: pip install -e ".[mlflow]"'
    assert rows["extra [sweep]"].startswith("optuna ")


def test_cluster_kinds_are_recognised():
    tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}})
    where, problems = doctor.cluster_environment({"TF_CONFIG": tf_config})
    assert problems == [] and where == "TF_CONFIG: 2 workers, this process is worker (rank 1)"
    where, _ = doctor.cluster_environment({"TF_CONFIG": tf_config, "KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    assert where.startswith("Kubeflow (TF_CONFIG from the training operator): 2 workers")
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_STEP_ID": "0",
             "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    where, problems = doctor.cluster_environment(slurm)
    assert problems == [] and where.startswith("SLURM: 2 workers, this process is chief (rank 0)")
    where, problems = doctor.cluster_environment({"TF_CONFIG": "{not json"})
    assert where == "unreadable" and "fix or unset TF_CONFIG" in problems[0]


def test_run_refuses_an_incoherent_stack_with_the_fix(monkeypatch, capsys, tmp_path):
    from helpers import ROOT
    from tftrain.run import main
    monkeypatch.setattr(doctor, "installed_version",
                        lambda dist: None if dist == "tensorflow-model-optimization" else "2.21.0")
    assert main([str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "tftrain: environment: tensorflow-model-optimization is not installed (pruning, QAT): "
        "pip install 'tensorflow-model-optimization>=0.8' (python -m tftrain.doctor shows the "
        "whole environment)"]
    assert not any(tmp_path.iterdir())
