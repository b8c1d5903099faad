"""MLflow tracking: one MLflow run per tftrain run, every epoch once across a kill and a
restart, params, summary and artifacts; read back with MlflowClient from a local store."""

import json
from types import SimpleNamespace

import pytest
from helpers import ROOT, cli, start_run, unwrapped, wait_for_checkpoint
from mlflow.tracking import MlflowClient

from tftrain.training.tracking import EpochMetrics, flat_params

QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def test_a_sqlite_store_keeps_artifacts_beside_its_database(tmp_path):
    from tftrain.config import load_config
    from tftrain.training.tracking import artifact_location
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


class FakeClient:
    """MlflowClient's calls the tracker makes, in memory; `down` makes every call fail as
    an unreachable server does."""

    def __init__(self, logged=()):
        self.history = {"prune/loss": set(logged)}
        self.calls, self.down, self.status = [], False, None

    def _check(self):
        if self.down:
            raise ConnectionError("Connection refused")

    def get_metric_history(self, run_id, key):
        self._check()
        return [SimpleNamespace(step=s) for s in self.history.get(key, ())]

    def log_batch(self, run_id, metrics=(), params=()):
        self._check()
        if metrics:
            self.calls.append((metrics[0].step, {m.key: m.value for m in metrics}))

    def update_run(self, run_id, status):
        self._check()

    def set_terminated(self, run_id, status):
        self._check()
        self.status = status

    def log_text(self, run_id, text, path):
        self._check()


def fake_tracker(tmp_path, client):
    from tftrain.config import load_config
    from tftrain.training.tracking import MlflowTracker
    tracker = MlflowTracker.__new__(MlflowTracker)
    cfg = load_config(None, ["tracking.mlflow={uri: 'http://u:secret@h:5000'}"])
    tracker.cfg, tracker.run_path, tracker.config_text = cfg, tmp_path, ""
    tracker.uri, tracker.client, tracker.run_id = cfg.tracking.mlflow.uri, client, "r"
    tracker._down_until, tracker._logged, tracker._missed = 0.0, {}, False
    return tracker


def test_each_finished_epoch_is_logged_once_and_a_cut_epoch_is_not(tmp_path):
    ckpt = SimpleNamespace(update=0)
    client = FakeClient(logged={0})              # epoch 0 logged before a restart
    cb = EpochMetrics(fake_tracker(tmp_path, client), "prune/", ckpt, steps_per_epoch=10,
                      last_update=35)
    ckpt.update = 10
    cb.on_epoch_end(0, {"loss": 9.0})            # redone after the restart: not again
    ckpt.update = 20
    cb.on_epoch_end(1, {"loss": 1.0, "lr": 0.1, "note": "text", "bad": float("nan")})
    assert client.calls == [(1, {"prune/loss": 1.0, "prune/lr": 0.1})]
    ckpt.update = 27
    cb.on_epoch_end(2, {"loss": 2.0})            # stopped at 27 of 30: the restart redoes it
    ckpt.update = 35
    cb.on_epoch_end(3, {"loss": 3.0})            # the stage's last, short epoch
    cb.on_epoch_end(3, {"loss": 3.5})
    assert [step for step, _ in client.calls] == [1, 3]


def test_an_outage_warns_once_per_failure_and_the_missed_epochs_follow_from_the_csv(
        tmp_path, capsys, monkeypatch):
    from tftrain.training import tracking
    client = FakeClient()
    tracker = fake_tracker(tmp_path, client)
    (tmp_path / "metrics.csv").write_text("epoch,loss,lr\n0,2.5,0.1\n1,1.9,0.1\n1,1.5,0.1\n")
    client.down = True
    assert not tracker.log_epoch("", 0, {"loss": 2.5})            # down: one warning
    assert not tracker.log_epoch("", 1, {"loss": 1.5})            # within RETRY_AFTER: skipped
    out = unwrapped(capsys.readouterr().out)
    assert len(out) == 1 and out[0].startswith(
        "tftrain: warning: MLflow at http://u:***@h:5000: reading loss failed (ConnectionError: "
        "Connection refused); training goes on")
    assert (tmp_path / tracking.PENDING_FILE).exists()
    client.down = False
    monkeypatch.setattr(tracker, "_down_until", 0.0)              # RETRY_AFTER later
    assert tracker.log_epoch("", 2, {"loss": 1.2})
    # epochs 0 and 1 from metrics.csv (the last row of epoch 1: the redone one), then 2
    assert client.calls == [(0, {"loss": 2.5, "lr": 0.1}), (1, {"loss": 1.5, "lr": 0.1}),
                            (2, {"loss": 1.2})]
    tracker.finish({"metrics": {"val_accuracy": 0.9}, "stages": {"train": {}}}, tmp_path / "none")
    assert client.status == "FINISHED" and not (tmp_path / tracking.PENDING_FILE).exists()
    assert [step for step, _ in client.calls] == [0, 1, 2, 0]      # + the final metrics


def test_credentials_in_the_tracking_uri_are_never_logged():
    from tftrain.training.tracking import redact
    assert redact("postgresql://mlflow:s3cr%40t@db:5432/runs") == "postgresql://mlflow:***@db:5432/runs"
    assert redact("https://ghp_token@host/x") == "https://***@host/x"
    for kept in ("sqlite:////tmp/m.db", "http://host:5000", "1e-05", "plain text"):
        assert redact(kept) == kept


def _runs(uri, experiment):
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client, client.search_runs([found.experiment_id]) if found else []


SETS = ["train.epochs=6", "train.checkpoint.every=30", "export.tflite=none", "train.verbose=0",
        "export.preflight=false"]


@pytest.mark.slow
def test_a_killed_and_resumed_run_is_one_mlflow_run_with_each_epoch_once(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sets = [*SETS, f"tracking.mlflow={{uri: '{uri}', experiment: resumed}}"]
    args = [str(QUICKSTART), "--run-dir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    proc = start_run(*args)
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


@pytest.mark.slow
def test_mlflow_down_for_a_whole_run_neither_stops_nor_fails_it(tmp_path, capsys, monkeypatch):
    """The tracking server unreachable (a closed port) for a whole run: the run completes
    (exit 0) with every checkpoint, one warning line per failed call; a SIGTERM still
    stops with 42; once the server is back, rerunning the command finishes the MLflow
    run with every epoch once."""
    import os
    import signal as signals

    from helpers import MlflowServer
    from tftrain.launch import free_ports
    from tftrain.run import main
    from tftrain.training.train_step import TrainModel
    port, = free_ports(1)
    uri = f"http://127.0.0.1:{port}"
    sets = ["train.epochs=3", "export.tflite=none", "train.verbose=0",
            f"tracking.mlflow={{uri: '{uri}', experiment: outage}}"]
    args = lambda d: [str(QUICKSTART), "--run-dir", str(d), *[a for s in sets for a in ("--set", s)]]  # noqa: E731
    assert main(args(tmp_path)) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in unwrapped(out) if "MLflow" in line]
    assert warnings and all(line.startswith(f"tftrain: warning: MLflow at {uri}: ")
                            and "failed (MlflowException" in line for line in warnings), warnings
    assert "Traceback" not in err
    run_path = tmp_path / "quickstart"
    assert json.loads((run_path / "summary.json").read_text())["status"] == "completed"
    assert {p.name for p in (run_path / "checkpoints").glob("ckpt-*.index")} == {
        f"ckpt-{23 * e}.index" for e in (1, 2, 3)}
    assert (run_path / "mlflow_pending").exists()
    # SIGTERM during a run whose tracking is down: still a clean stop
    with monkeypatch.context() as patch:
        original = TrainModel.evaluate

        def evaluate(self, *a, **kw):
            os.kill(os.getpid(), signals.SIGTERM)
            return original(self, *a, **kw)
        patch.setattr(TrainModel, "evaluate", evaluate)
        assert main(args(tmp_path / "stopped")) == 42
    assert "stopped by SIGTERM" in capsys.readouterr().err
    # the server is back: the rerun of the completed run logs it all and ends it
    with MlflowServer(port, tmp_path / "server"):
        assert main(args(tmp_path)) == 0
        assert "already completed" in capsys.readouterr().out
        client, runs = _runs(uri, "outage")
        assert len(runs) == 1 and runs[0].info.status == "FINISHED"
        for key in ("loss", "val_loss", "val_accuracy", "lr"):
            history = client.get_metric_history(runs[0].info.run_id, key)
            assert sorted(m.step for m in history) == [0, 1, 2], key
        assert runs[0].data.params["tracking.mlflow.uri"] == uri
        assert {a.path for a in client.list_artifacts(runs[0].info.run_id)} == {
            "config.yaml", "summary.json", "export"}
    assert not (run_path / "mlflow_pending").exists()
