"""Experiment tracking: `tracking.mlflow: {uri, experiment}` (extra `[mlflow]`).

The chief alone logs, once per run: the resolved config as params, each epoch's metrics
(the train stage's under their own names, later stages' as `STAGE/name`), the summary's
figures and file, and the exported artifacts. The MLflow run's id is kept in the run
directory (`mlflow_run_id`), so a restarted run logs into the same MLflow run.

Each epoch is logged once: when it ends, before its checkpoint is saved; an epoch cut
short by a stop is not logged (the restart finishes it), and an epoch already in the
MLflow run is not logged again when a restart from an earlier checkpoint redoes it (the
MLflow run keeps the first values; metrics.csv has both).

Tracking never stops training: a call that fails (the server down, the network) prints
one warning line and leaves `mlflow_pending` in the run directory; epochs MLflow missed
are logged from the metrics files at the next call that works, and a rerun of a
completed run's command finishes its MLflow run. The tracking URI is logged with its
password replaced by `***`.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from tftrain.core.keras import keras
from tftrain.core import console
from tftrain.training.rundir import dump_config
from tftrain.training.rundir import atomic_write

RUN_ID_FILE = "mlflow_run_id"
PENDING_FILE = "mlflow_pending"      # something was not logged: a rerun logs it
# An unreachable server fails a call after a few quick retries (MLflow's defaults retry
# for about 4 minutes, blocking training), then calls are skipped for RETRY_AFTER seconds.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
RETRY_AFTER = 60.0


class Tracker:
    """No tracking: the interface the pipeline calls."""

    def callback(self, stage: str, checkpointer, steps_per_epoch: int, last_update: int):
        return None

    def finish(self, summary: dict, export: Path, ok: bool = True) -> None:
        pass

    def fail(self) -> None:
        pass


class MlflowTracker(Tracker):
    """The chief's MLflow run. Tracking never stops training: a call that fails (server
    down, network) prints one warning line and marks the run directory (`mlflow_pending`);
    what was missed is logged from the run directory's metrics files at the next call that
    works, or by a rerun of the command once the run has completed."""

    def __init__(self, cfg, run_path: Path, config_text: str):
        import os

        from mlflow.tracking import MlflowClient

        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.cfg, self.run_path, self.config_text = cfg, run_path, config_text
        self.uri = cfg.tracking.mlflow.uri
        self.client = MlflowClient(self.uri)
        self.run_id: str | None = None
        self._down_until = 0.0
        self._logged: dict[str, set[int]] = {}
        self._missed = (run_path / PENDING_FILE).exists()     # epochs to log from the files
        self._call("starting the MLflow run", self._start)

    # -- calls that may fail --------------------------------------------------------------
    def _call(self, what: str, fn) -> bool:
        """Run `fn()`; False when MLflow failed (one warning line) or was down moments ago."""
        if time.monotonic() < self._down_until:
            self._pending()
            return False
        try:
            fn()
            return True
        except Exception as err:           # any failure of the tracking service
            self._down_until = time.monotonic() + RETRY_AFTER
            self._pending()
            first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            console.warn(f"MLflow at {redact(self.uri)}: {what} failed "
                         f"({type(err).__name__}: {first}); training goes on, and what was not "
                         "logged is logged later from the run directory")
            return False

    def _pending(self) -> None:
        self._missed = True
        (self.run_path / PENDING_FILE).touch()

    def _start(self) -> None:
        from mlflow.entities import Param, RunStatus

        saved = self.run_path / RUN_ID_FILE
        if saved.exists():
            self.run_id = saved.read_text().strip()
            self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            cfg = self.cfg
            experiment = self.client.get_experiment_by_name(cfg.tracking.mlflow.experiment)
            experiment_id = (experiment.experiment_id if experiment else
                             self.client.create_experiment(cfg.tracking.mlflow.experiment,
                                                           artifact_location(cfg.tracking.mlflow)))
            run = self.client.create_run(experiment_id, run_name=cfg.run.name,
                                         tags={"tftrain.run_dir": str(self.run_path.resolve())})
            # the password a database URI may hold is never logged
            params = [Param(k, redact(v)) for k, v in
                      flat_params(cfg.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):            # MLflow takes 100 per batch
                self.client.log_batch(run.info.run_id, params=params[i:i + 100])
            self.client.log_text(run.info.run_id,
                                 self.config_text.replace(self.uri, redact(self.uri)), "config.yaml")
            self.run_id = run.info.run_id
            atomic_write(saved, self.run_id + "\n")

    def _ready(self) -> bool:
        """An MLflow run to log into (started now if starting failed before)."""
        if self.run_id is None:
            self._call("starting the MLflow run", self._start)
        return self.run_id is not None

    # -- epochs ---------------------------------------------------------------------------
    def logged_steps(self, key: str) -> set[int]:
        """The steps MLflow holds for `key` (asked once, then kept up to date here)."""
        if key not in self._logged:
            def read():
                self._logged[key] = {m.step for m in
                                     self.client.get_metric_history(self.run_id, key)}
            if not self._call(f"reading {key}", read):
                return set()
        return self._logged[key]

    def log_epoch(self, prefix: str, epoch: int, logs: dict) -> bool:
        """Log one finished epoch of a stage (`prefix`: "" or "STAGE/"), once; then any
        earlier epoch the metrics files hold that MLflow missed. Whether it was logged."""
        if not self._ready():
            return False
        self._backfill(prefix, below=epoch)
        if epoch in self.logged_steps(f"{prefix}loss"):
            return True
        values = {f"{prefix}{k}": float(v) for k, v in logs.items() if _number(v)}
        if not self._call(f"logging epoch {epoch}", lambda: self.log_metrics(values, epoch)):
            return False
        self._logged.setdefault(f"{prefix}loss", set()).add(epoch)
        return True

    def _backfill(self, prefix: str, below: int | None = None) -> None:
        """Epochs of a stage's metrics file (the last row of each: a row of an epoch cut
        short is followed by the redone epoch's) that MLflow does not have yet."""
        if not self._missed:
            return
        name = "metrics.csv" if not prefix else f"metrics-{prefix[:-1]}.csv"
        for epoch, row in sorted(epoch_rows(self.run_path / name).items()):
            if below is not None and epoch >= below:
                break
            if epoch in self.logged_steps(f"{prefix}loss"):
                continue
            values = {f"{prefix}{k}": float(v) for k, v in row.items()
                      if k != "epoch" and _number(v)}
            if not self._call(f"logging epoch {epoch}",
                              lambda: self.log_metrics(values, epoch)):
                return
            self._logged.setdefault(f"{prefix}loss", set()).add(epoch)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def callback(self, stage: str, checkpointer, steps_per_epoch: int, last_update: int):
        return EpochMetrics(self, "" if stage == "train" else f"{stage}/", checkpointer,
                            steps_per_epoch, last_update)

    # -- the end --------------------------------------------------------------------------
    def finish(self, summary: dict, export: Path, ok: bool = True) -> None:
        """`ok`: every artifact passed its check (else the run ends FAILED). Logs every
        epoch MLflow missed first; the run stays pending (a rerun finishes it) if any call
        fails."""
        if not self._ready():
            return
        for stage in summary.get("stages", {}) or {"train": None}:
            self._backfill("" if stage == "train" else f"{stage}/")
        pending = self.run_path / PENDING_FILE
        if pending.exists():
            pending.unlink()            # every call below marks it again if it fails
        final = {f"final/{k}": v for k, v in summary.get("metrics", {}).items() if _number(v)}
        for name, entry in summary.get("artifacts", {}).items():
            final.update({f"export/{name}/{k}": entry[k] for k in
                          ("accuracy", "size_bytes", "gzip_bytes", "latency_ms")
                          if _number(entry.get(k))})
        steps = [
            ("logging the final metrics", lambda: self.log_metrics(final, 0)),
            ("uploading summary.json", lambda: self.client.log_text(
                self.run_id, json.dumps(summary, indent=2), "summary.json")),
            ("uploading the exported artifacts", lambda: export.exists() and
             self.client.log_artifacts(self.run_id, str(export), "export")),
            ("ending the MLflow run", lambda: self.client.set_terminated(
                self.run_id, "FINISHED" if ok else "FAILED"))]
        for what, fn in steps:
            if not self._call(what, fn):
                return

    def fail(self) -> None:
        """A failed or stopped run: marked KILLED (a restart sets it running again)."""
        if self.run_id is not None:
            self._call("marking the MLflow run stopped",
                       lambda: self.client.set_terminated(self.run_id, "KILLED"))


def epoch_rows(path: Path) -> dict[int, dict]:
    """A metrics CSV's rows by epoch, the last row of each epoch kept."""
    import csv

    try:
        with open(path, newline="") as f:
            return {int(row["epoch"]): row for row in csv.DictReader(f) if row.get("epoch")}
    except OSError:
        return {}


def finish_pending(cfg, run_path: Path, summary: dict, chief: bool) -> None:
    """A completed run whose tracking missed something (the server was down): log what
    is missing and end the MLflow run, now that the command is run again."""
    if chief and cfg.tracking.mlflow is not None and (run_path / PENDING_FILE).exists():

        failed = any(not entry.get("verified", True)
                     for entry in summary.get("artifacts", {}).values())
        MlflowTracker(cfg, run_path, dump_config(cfg)).finish(
            summary, run_path / "export", ok=not failed)


class EpochMetrics(keras.callbacks.Callback):
    """Logs each finished epoch's metrics (before the checkpointer in the callback list,
    so no kill can fall between a checkpoint and the log)."""

    def __init__(self, tracker: MlflowTracker, prefix: str, checkpointer, steps_per_epoch: int,
                 last_update: int):
        super().__init__()
        self.tracker, self.prefix, self.checkpointer = tracker, prefix, checkpointer
        self.steps_per_epoch, self.last_update = steps_per_epoch, last_update

    def on_epoch_end(self, epoch, logs=None):
        end = min((epoch + 1) * self.steps_per_epoch, self.last_update)
        if self.checkpointer.update < end:           # cut short: the restart redoes it
            return
        self.tracker.log_epoch(self.prefix, epoch, logs or {})


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


def redact(text: str) -> str:
    """A URI with its password (or a token given as its user) replaced by `***`
    (`postgresql://user:secret@db/mlflow` -> `postgresql://user:***@db/mlflow`); anything
    else as it is."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(text)
    except ValueError:
        return text
    if not parts.scheme or "@" not in parts.netloc:
        return text
    host = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***" if parts.password is not None else "***"   # a token alone
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


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
