"""MLflow tracking: one MLflow run per tftrain run, every epoch once across a kill and a
restart, params, summary and artifacts; read back with MlflowClient from a local store."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import ROOT, cli, wait_for_checkpoint
from mlflow.tracking import MlflowClient

from tftrain.tracking import EpochMetrics, flat_params

QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def test_a_sqlite_store_keeps_artifacts_beside_its_database(tmp_path):
    from tftrain.config import load_config
    from tftrain.tracking import artifact_location
    mlflow = lambda **kw: load_config(None, [f"tracking.mlflow={kw}"]).tracking.mlflow  # noqa: E731
    assert artifact_location(mlflow(uri=f"sqlite:///{tmp_path}/m.db")) == \
        (tmp_path / "mlartifacts").as_uri()
    assert artifact_location(mlflow(uri="http://host:5000")) is None
    assert artifact_location(mlflow(uri="http://h", artifact_location="s3://b/x")) == "s3://b/x"


def test_config_flattens_to_string_params():
    assert flat_params({"run": {"name": "q", "seed": 3}, "train": {"optimizer": {"lr": 0.1}},
                        "data": {"augment": [{"flip": True}], "params": {}}, "x": None}) == {
        "run.name": "q", "run.seed": "3", "train.optimizer.lr": "0.1",
        "data.augment": '[{"flip": true}]', "data.params": "{}", "x": "null"}


class FakeTracker:
    def __init__(self, logged=()):
        self.logged, self.calls = set(logged), []

    def logged_steps(self, key):
        return self.logged if key == "prune/loss" else set()

    def log_metrics(self, values, step):
        self.calls.append((step, values))


def test_each_finished_epoch_is_logged_once_and_a_cut_epoch_is_not():
    ckpt = SimpleNamespace(update=0)
    tracker = FakeTracker(logged={0})            # epoch 0 logged before a restart
    cb = EpochMetrics(tracker, "prune/", ckpt, steps_per_epoch=10, last_update=35)
    ckpt.update = 10
    cb.on_epoch_end(0, {"loss": 9.0})            # redone after the restart: not again
    ckpt.update = 20
    cb.on_epoch_end(1, {"loss": 1.0, "lr": 0.1, "note": "text", "bad": float("nan")})
    assert tracker.calls == [(1, {"prune/loss": 1.0, "prune/lr": 0.1})]
    ckpt.update = 27
    cb.on_epoch_end(2, {"loss": 2.0})            # stopped at 27 of 30: the restart redoes it
    ckpt.update = 35
    cb.on_epoch_end(3, {"loss": 3.0})            # the stage's last, short epoch
    cb.on_epoch_end(3, {"loss": 3.5})
    assert [step for step, _ in tracker.calls] == [1, 3]


def _runs(uri, experiment):
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client, client.search_runs([found.experiment_id]) if found else []


SETS = ["train.epochs=6", "train.checkpoint.every=30", "export.tflite=none", "train.verbose=0"]


@pytest.mark.slow
def test_a_killed_and_resumed_run_is_one_mlflow_run_with_each_epoch_once(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sets = [*SETS, f"tracking.mlflow={{uri: '{uri}', experiment: resumed}}"]
    args = [str(QUICKSTART), "--run-dir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.Popen([sys.executable, "-m", "tftrain.run", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    saved = wait_for_checkpoint(tmp_path / "quickstart" / "checkpoints", proc, at_least=60)
    proc.kill()
    proc.communicate(timeout=60)
    client, runs = _runs(uri, "resumed")
    assert len(runs) == 1 and runs[0].info.status == "RUNNING"      # killed: never ended
    before = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert before == list(range(len(before))) and len(before) >= saved // 23
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout
    client, runs = _runs(uri, "resumed")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    run_id = runs[0].info.run_id
    assert (tmp_path / "quickstart" / "mlflow_run_id").read_text().strip() == run_id
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    for key in ("loss", "val_loss", "val_accuracy", "lr", "examples_per_sec"):
        history = client.get_metric_history(run_id, key)
        assert sorted(m.step for m in history) == list(range(6)), key
    last = max(client.get_metric_history(run_id, "val_accuracy"), key=lambda m: m.step)
    metrics = runs[0].data.metrics
    assert metrics["final/val_accuracy"] == pytest.approx(summary["metrics"]["val_accuracy"])
    assert last.value == pytest.approx(summary["metrics"]["val_accuracy"], abs=1e-6)
    assert metrics["export/saved_model/accuracy"] == summary["artifacts"]["saved_model"]["accuracy"]
    params = runs[0].data.params
    assert params["train.epochs"] == "6" and params["tracking.mlflow.experiment"] == "resumed"
    assert runs[0].info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())
    assert (tmp_path / "mlartifacts" / run_id / "artifacts" / "summary.json").is_file()
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert artifacts == {"config.yaml", "summary.json", "export"}
    assert {a.path for a in client.list_artifacts(run_id, "export")} == {"export/saved_model"}
