"""Experiment tracking: `tracking.mlflow: {uri, experiment}` (extra `[mlflow]`).

The chief alone logs, once per run: the resolved config as params, each epoch's metrics
(the train stage's under their own names, later stages' as `STAGE/name`), the summary's
figures and file, and the exported artifacts. The MLflow run's id is kept in the run
directory (`mlflow_run_id`), so a restarted run logs into the same MLflow run.

Each epoch is logged once: when it ends, before its checkpoint is saved; an epoch cut
short by a stop is not logged (the restart finishes it), and an epoch already in the
MLflow run is not logged again when a restart from an earlier checkpoint redoes it (the
MLflow run keeps the first values; metrics.csv has both).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from tftrain._keras import keras

RUN_ID_FILE = "mlflow_run_id"


class Tracker:
    """No tracking: the interface the pipeline calls."""

    def callback(self, stage: str, checkpointer, steps_per_epoch: int, last_update: int):
        return None

    def finish(self, summary: dict, export: Path, ok: bool = True) -> None:
        pass

    def fail(self) -> None:
        pass


class MlflowTracker(Tracker):
    def __init__(self, cfg, run_path: Path, config_text: str):
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(cfg.tracking.mlflow.uri)
        saved = run_path / RUN_ID_FILE
        if saved.exists():
            self.run_id = saved.read_text().strip()
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            experiment = self.client.get_experiment_by_name(cfg.tracking.mlflow.experiment)
            experiment_id = (experiment.experiment_id if experiment else
                             self.client.create_experiment(cfg.tracking.mlflow.experiment,
                                                           artifact_location(cfg.tracking.mlflow)))
            run = self.client.create_run(experiment_id, run_name=cfg.run.name,
                                         tags={"tftrain.run_dir": str(run_path.resolve())})
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in flat_params(cfg.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):            # MLflow takes 100 per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            self.client.log_text(self.run_id, config_text, "config.yaml")
            saved.write_text(self.run_id + "\n")

    def logged_steps(self, key: str) -> set[int]:
        return {m.step for m in self.client.get_metric_history(self.run_id, key)}

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def callback(self, stage: str, checkpointer, steps_per_epoch: int, last_update: int):
        return EpochMetrics(self, "" if stage == "train" else f"{stage}/", checkpointer,
                            steps_per_epoch, last_update)

    def finish(self, summary: dict, export: Path, ok: bool = True) -> None:
        """`ok`: every artifact passed its check (else the run ends FAILED)."""
        final = {f"final/{k}": v for k, v in summary.get("metrics", {}).items() if _number(v)}
        for name, entry in summary.get("artifacts", {}).items():
            final.update({f"export/{name}/{k}": entry[k] for k in
                          ("accuracy", "size_bytes", "gzip_bytes", "latency_ms")
                          if _number(entry.get(k))})
        self.log_metrics(final, 0)
        self.client.log_text(self.run_id, json.dumps(summary, indent=2), "summary.json")
        if export.exists():
            self.client.log_artifacts(self.run_id, str(export), "export")
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")

    def fail(self) -> None:
        """A failed or stopped run: marked KILLED (a restart sets it running again)."""
        self.client.set_terminated(self.run_id, "KILLED")


class EpochMetrics(keras.callbacks.Callback):
    """Logs each finished epoch's metrics (before the checkpointer in the callback list,
    so no kill can fall between a checkpoint and the log)."""

    def __init__(self, tracker: MlflowTracker, prefix: str, checkpointer, steps_per_epoch: int,
                 last_update: int):
        super().__init__()
        self.tracker, self.prefix, self.checkpointer = tracker, prefix, checkpointer
        self.steps_per_epoch, self.last_update = steps_per_epoch, last_update
        self.done = tracker.logged_steps(f"{prefix}loss")

    def on_epoch_end(self, epoch, logs=None):
        end = min((epoch + 1) * self.steps_per_epoch, self.last_update)
        if self.checkpointer.update < end or epoch in self.done:   # cut short, or logged
            return
        self.tracker.log_metrics({f"{self.prefix}{k}": float(v) for k, v in (logs or {}).items()
                                  if _number(v)}, epoch)
        self.done.add(epoch)


def _number(value) -> bool:
    try:
        return math.isfinite(float(value)) and not isinstance(value, bool)
    except (TypeError, ValueError):
        return False


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """`{"train": {"epochs": 3}}` -> `{"train.epochs": "3"}` (MLflow params are strings)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def artifact_location(mlflow_cfg) -> str | None:
    """`artifact_location`, else for a local SQLite store `mlartifacts/` beside the
    database (MLflow's own default there is ./mlruns in the working directory)."""
    if mlflow_cfg.artifact_location or not mlflow_cfg.uri.startswith("sqlite:///"):
        return mlflow_cfg.artifact_location
    return (Path(mlflow_cfg.uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()


def open_tracker(cfg, run_path: Path, config_text: str, chief: bool) -> Tracker:
    """The run's tracker: MLflow on the chief when configured, else none."""
    if chief and cfg.tracking.mlflow is not None:
        return MlflowTracker(cfg, run_path, config_text)
    return Tracker()
