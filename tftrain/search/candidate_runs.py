"""A candidate's own run: its directory seeded with the dense run's finished stages
(`prepare`), `python -m tftrain.run` on it with its output in a log (`launch`), and
what it left (`summary_of`, `last_error`)."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from tftrain.config import dump_config


def prepare(search_dir: Path, dense_dir: Path, dense_stages: dict, name: str,
            config: dict) -> Path:
    """Candidate `name`'s run directory under `search_dir/runs/` with the dense stages
    finished in it (its checked `config`, links to the dense run's checkpoints of
    `dense_stages`, their results); as it is when it exists."""
    from tftrain.config.loading import validate
    from tftrain.training.rundir import atomic_write

    runs = search_dir / "runs"
    config["run"].update(dir=str(runs), name=name)
    cfg = validate(config, f"candidate {name}")
    path = runs / name
    (search_dir / "configs").mkdir(parents=True, exist_ok=True)
    atomic_write(search_dir / "configs" / f"{name}.yaml", dump_config(cfg))
    if (path / "config.yaml").exists():
        return path
    staging = runs / f".{name}.new"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "checkpoints").mkdir(parents=True)
    atomic_write(staging / "config.yaml", dump_config(cfg))
    shutil.copy(dense_dir / "topology.json", staging / "topology.json")
    source = dense_dir / "checkpoints"
    # a run that trained nothing (`train.epochs: 0`, a file's model taken as it is)
    # kept no checkpoint: the candidate takes the model as it did (seconds, no update)
    if source.is_dir():
        atomic_write(staging / "stages.json", json.dumps(dense_stages, indent=2) + "\n")
    for item in source.iterdir() if source.is_dir() else ():
        if item.is_file():
            link(item, staging / "checkpoints" / item.name)
        elif item.name in dense_stages:
            shutil.copytree(item, staging / "checkpoints" / item.name, copy_function=link)
    os.replace(staging, path)
    return path


def launch(search_dir: Path, name: str, entry: dict, path: Path, fork: bool, save) -> int:
    """`python -m tftrain.run` on candidate `name`'s config (forked where `fork`), its
    output in a log, its pid in `entry` (then `save()`); the exit code. A run left by a
    search killed before (signalled when its parent died) is waited for first."""
    from tftrain.runtime import forking

    wait_for(entry.get("pid"))
    log = open(path.parent / f"{name}.log", "a")
    proc = forking.start("tftrain.run", [str(search_dir / "configs" / f"{name}.yaml")],
                         fork=fork, stdout=log, setup=lambda: forking.worker_setup(None))
    entry["launches"] += 1
    entry["pid"] = proc.pid
    save()
    try:
        return proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    finally:
        log.close()


def summary_of(path: Path) -> dict | None:
    try:
        return json.loads((path / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def last_error(log: Path) -> str:
    """The line a failed or refused candidate run ended with."""
    try:
        lines = [line for line in log.read_text().splitlines() if line.startswith("tftrain: ")]
    except OSError:
        return "no log"
    return lines[-1].removeprefix("tftrain: ") if lines else f"see {log}"


def link(source, target) -> None:
    """A hard link where the file system allows one, else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def wait_for(pid: int | None, timeout: float = 120.0) -> None:
    """Wait while a candidate run a killed search left (SIGTERMed when it died) saves and
    exits."""
    if not pid:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tftrain" not in f.read():
                    return                     # the pid is another process's now
        except (OSError, ProcessLookupError):
            return
        time.sleep(0.5)
