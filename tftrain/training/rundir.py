"""The run directory: created only once a run is known to be valid, written atomically.

`<run.dir>/<run.name>/` holds config.yaml, topology.json, metrics.csv, tensorboard/,
checkpoints/, export/ and, only when a run has completed, summary.json. A directory
without a completed summary is an interrupted run: the same command resumes it.

An interrupted run resumes with the same config, or on another topology: the keys that
say where it runs (`TOPOLOGY_KEYS`: the strategy, the devices, the all-reduce's dtype, the
per-replica batch and the accumulation steps) may change as long as the global batch stays, so that every
update takes the same examples (`topology.json` records what the checkpoints were
written under).
"""
from __future__ import annotations

import difflib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from tftrain.config import Config, ConfigError, dump_config
from tftrain.core import exit_codes


def atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# config keys that say where a run executes, not what it computes: free to change when an
# interrupted run resumes, as long as the global batch stays (checked on the topology)
TOPOLOGY_KEYS = {"distribute": ("strategy", "devices", "virtual_cpus", "all_reduce_dtype"),
                 "data": ("per_replica_batch_size",),
                 "train": ("accumulation_steps",),
                 # (a run directory moved or mounted elsewhere resumes where it is)
                 "run": ("allow_batch_change", "dir")}


@dataclass(frozen=True)
class RunDir:
    path: Path
    resumed: bool
    previous: dict | None = None     # the topology the run's checkpoints were written under

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def export(self) -> Path:
        return self.path / "export"


def run_path(cfg: Config, smoke: bool = False) -> Path:
    return Path(cfg.run.dir) / (cfg.run.name + ("-smoke" if smoke else ""))


def read_summary(path: Path) -> dict | None:
    """The summary of a completed run at `path`, else None."""
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return summary if summary.get("status") == exit_codes.COMPLETED else None


def completed(cfg: Config, smoke: bool = False) -> dict | None:
    """The summary of the completed run the config names, if there is one (None: not
    completed). A completed run given another config is a ConfigError naming the keys
    that differ: its results are not what this config asks for. Reads files only (no
    TensorFlow), so it answers before any planning."""
    path = run_path(cfg, smoke)
    done = read_summary(path)
    if done is None:
        return None
    try:
        old = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return done
    differ = [f"{key} ({_short(a)} -> {_short(b)})"
              for key, (a, b) in changed_keys(old, yaml.safe_load(dump_config(cfg))).items()
              if key != "run.dir"]
    if differ:
        raise ConfigError(
            f"run.name: {path} is a completed run with a different config: "
            f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}; its results are not "
            f"this config's. Use another run.name or --run-dir, or delete {path} to train again")
    return done


def changed_keys(old, new, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: (old value, new value)} of the leaves that differ between two configs."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = {}
        for key in list(old) + [k for k in new if k not in old]:
            found.update(changed_keys(old.get(key), new.get(key), f"{prefix}{key}."))
        return found
    return {} if old == new else {prefix.rstrip("."): (old, new)}


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else f"{text[:37]}..."


def open_run_dir(cfg: Config, smoke: bool = False, write: bool = True,
                 topology: dict | None = None) -> RunDir:
    """Create the run directory, or reopen an interrupted one with the same config, or
    with one that differs only in `TOPOLOGY_KEYS` and keeps the global batch (checked
    against the topology recorded when the run last started). `topology`: this run's
    (`RunPlan.topology`), recorded in `topology.json`.

    `write=False` (non-chief workers) checks the same things but writes nothing.
    """
    path = run_path(cfg, smoke)
    text = dump_config(cfg)
    saved = path / "config.yaml"
    if saved.exists():
        old = saved.read_text()
        previous = read_topology(path)
        changed = _changed_lines(old, text)
        # without a recorded topology (a run from before it) every key must be the same
        refused = changed if previous is None or topology is None else \
            _changed_lines(_free(old), _free(text))
        if refused:
            raise ConfigError(
                f"run.name: {path} already holds a run with a different config "
                f"({'; '.join(refused[:4])}); use another run.name or --run-dir, or delete {path}")
        if previous is not None and topology is not None:
            _check_resumable(path, previous, topology, cfg.run.allow_batch_change)
        if write and changed:
            atomic_write(saved, text)        # the config the checkpoints are written under now
        if write and topology is not None and topology != previous:
            write_topology(path, topology)
        return RunDir(path, resumed=True, previous=previous)
    if write:
        atomic_write(saved, text)
        if topology is not None:
            write_topology(path, topology)
    return RunDir(path, resumed=False)


def _changed_lines(old: str, new: str) -> list[str]:
    return [line for line in difflib.unified_diff(old.splitlines(), new.splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def _free(config_text: str) -> str:
    """A dumped config without the values of `TOPOLOGY_KEYS`."""
    config = yaml.safe_load(config_text)
    for section, keys in TOPOLOGY_KEYS.items():
        for key in keys:
            config.get(section, {}).pop(key, None)
    return yaml.safe_dump(config, sort_keys=False)


def _check_resumable(path: Path, previous: dict, topology: dict, allow_batch_change: bool) -> None:
    """A resume on another topology must keep the examples of every update (or be
    allowed to change them: `run.allow_batch_change`)."""
    if previous.get("global_batch") != topology["global_batch"] and not allow_batch_change:
        # bandit reads "update ... from" in this message as SQL (B608): it is a message
        raise ConfigError(
            f"resuming {path} would change the global batch from {previous['global_batch']} "  # nosec B608
            f"to {topology['global_batch']} examples per update (its checkpoints count updates "
            f"of {previous['global_batch']}); keep it: set train.global_batch_size: "
            f"{previous['global_batch']} (the per-replica batch and accumulation steps are "
            "derived from it) or the old data.per_replica_batch_size and "
            "train.accumulation_steps; or set run.allow_batch_change: true to continue with "
            "the learning rate scaled to the new batch (not the same result)")
    bound = topology.get("micro_batch_bound") or previous.get("micro_batch_bound")
    if bound and previous.get("per_replica_batch") != topology["per_replica_batch"] \
            and not allow_batch_change:
        # (B608 as above: a message, no SQL)
        raise ConfigError(
            f"resuming {path} would compute each update over micro-batches of "  # nosec B608
            f"{topology['per_replica_batch']} examples, not {previous['per_replica_batch']}, and "
            f"{', '.join(bound)} computes over a micro-batch (not the same result); keep "
            f"data.per_replica_batch_size: {previous['per_replica_batch']} (with replicas x "
            "accumulation steps making the global batch), or set run.allow_batch_change: true")
    if streams_of(previous) != topology["streams"]:
        raise ConfigError(
            f"resuming {path} would read its files as {topology['streams']} stream(s), not "
            f"the {streams_of(previous)} it began with (data.cache or data.shard_policy "
            "decides the sharding); keep them as they were")


def streams_of(topology: dict) -> int:
    """The file streams of a recorded topology (older records: one per worker with FILE
    sharding, else one)."""
    if "streams" in topology:
        return topology["streams"]
    return 1 if topology.get("shared_stream", True) else topology.get("workers", 1)


def recorded_streams(path: Path) -> int | None:
    """The file streams an interrupted run at `path` began with, if it recorded them."""
    previous = read_topology(path)
    return None if previous is None else streams_of(previous)


def read_topology(path: Path) -> dict | None:
    """The topology an interrupted run's checkpoints were written under, if recorded."""
    try:
        return json.loads((Path(path) / "topology.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_topology(path: Path, topology: dict) -> None:
    atomic_write(Path(path) / "topology.json", json.dumps(topology, indent=2) + "\n")


def describe_topology(t: dict) -> str:
    """One line: workers, replicas, batch arithmetic, precision wire."""
    return (f"{t['workers']} worker(s), {t['replicas']} replica(s) x {t['per_replica_batch']} "
            f"x {t['accumulation_steps']} accumulation = global batch {t['global_batch']}, "
            f"{t['precision']} with a {t['all_reduce']} all-reduce"
            + (", loss scaled" if t.get("loss_scaled") else "")
            + (f", files read as {streams_of(t)} streams" if streams_of(t) > 1 else ""))


def write_summary(run: RunDir, summary: dict) -> None:
    atomic_write(run.summary_path, json.dumps(summary, indent=2, sort_keys=False) + "\n")
