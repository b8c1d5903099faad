"""`python -m tftrain.search` on the quickstart's completed run: a size target met and
its file shipped, a target nothing meets (exit 3, the closest exported), a search killed
after its third candidate resumed without fine-tuning those again."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import start_run

pytestmark = pytest.mark.slow
QUICK = ["--target", "fine_tune_epochs=1", "--target", "qat_epochs=1"]


def copied(run_path: Path, tmp_path: Path) -> Path:
    """The shared quickstart run, copied: a search writes into its run directory."""
    copy = Path(shutil.copytree(run_path, tmp_path / run_path.name,
                                ignore=shutil.ignore_patterns("search")))
    config = copy / "config.yaml"
    config.write_text(config.read_text().replace(str(run_path.parent), str(tmp_path)))
    return copy


def search(run_dir, *args, timeout=900):
    proc = start_run(str(run_dir), *QUICK, *args, module="tftrain.search")
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def record_of(run_dir) -> dict:
    return json.loads((run_dir / "search" / "search.json").read_text())


def test_a_size_target_is_met_and_the_chosen_file_is_what_the_search_measured(
        quickstart_run, tmp_path):
    from tftrain.config import load_config
    from tftrain.data import BatchPlan, load_source, val_dataset
    from tftrain.export.artifacts import tflite_logits

    run_dir = copied(quickstart_run[0], tmp_path)
    # int8, dynamic and QAT at full width first (the mildest predicted within 60 KB: about
    # 60 KB each), then channel pruning with QAT; a miss skips what it rules out
    code, out, err = search(run_dir, "--target", "max_bytes=60KB", "--target", "candidates=5",
                            "--target", "refine=1")
    assert code == 0, err[-3000:]
    record = record_of(run_dir)
    assert record["met"] and record["chosen"] in record["front"]
    done = {n: c for n, c in record["candidates"].items() if c["status"] == "done"}
    ran = {n for n, c in record["candidates"].items() if c["status"] != "skipped"}
    assert len(ran) == 6 and set(done) == ran         # a skipped one's slot went to Optuna
    assert sum(record["candidates"][n]["origin"] == "optuna" for n in ran) >= 1
    assert all(record["candidates"][n]["launches"] == 1 for n in ran)
    chosen = record["candidates"][record["chosen"]]["figures"]
    assert chosen["bytes"] <= 60_000 and chosen["drop"] <= 0.01
    shipped = Path(record["chosen_file"])
    assert shipped.stat().st_size == chosen["bytes"]
    # the shipped file scores on the validation split what the search recorded
    cfg = load_config(run_dir / "config.yaml")
    source = load_source(cfg.data, cfg.run.seed)
    x, y = (np.concatenate(p) for p in zip(*val_dataset(source, BatchPlan(256, 1, 1), cfg.data)
                                           .as_numpy_iterator()))
    logits = tflite_logits(shipped.read_bytes(), x)[0]
    assert float(np.mean(np.argmax(logits, -1) == y)) == pytest.approx(chosen["accuracy"], abs=1e-9)
    # the dense reference is the float file every other was timed against
    assert record["candidates"]["float"]["figures"]["latency_ratio"] == 1.0
    assert record["dense"]["accuracy"] == pytest.approx(0.9963, abs=0.01)
    assert "estimate: about" in out
    assert sum(line.startswith("[candidate ") and "] done in " in line
               for line in out.splitlines()) == 6
    rows = (run_dir / "search" / "candidates.csv").read_text().splitlines()
    assert len(rows) == len(record["candidates"]) + 1 and rows[0].startswith("candidate,status,accuracy")
    assert '<div id="chart-6"' in (run_dir / "report.html").read_text()


def test_a_target_nothing_meets_writes_the_front_exports_the_closest_and_exits_3(
        quickstart_run, tmp_path):
    run_dir = copied(quickstart_run[0], tmp_path)
    code, out, err = search(run_dir, "--target", "max_bytes=2KB", "--target", "candidates=3",
                            "--target", "refine=0")
    assert code == 3, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("tftrain: target missed: no candidate meets it")
    record = record_of(run_dir)
    assert not record["met"] and record["front"] and record["chosen"]
    sizes = {n: c["figures"]["bytes"] for n, c in record["candidates"].items()}
    assert record["chosen"] == min(sizes, key=sizes.get)       # only the size misses: smallest
    assert Path(record["chosen_file"]).exists()
    assert "no candidate meets the target; the closest" in out


def test_a_search_killed_after_its_third_candidate_resumes_without_redoing_them(
        quickstart_run, tmp_path):
    """SIGKILL once three candidates are done (the dense file and two fine-tuned ones: a
    20 KB target puts channel pruning with QAT first); the rerun fine-tunes each of those
    zero more times and finishes the rest."""
    run_dir = copied(quickstart_run[0], tmp_path)
    args = [str(run_dir), *QUICK, "--target", "max_bytes=20KB", "--target", "candidates=4",
            "--target", "refine=0"]
    proc = start_run(*args, module="tftrain.search", session=True, stdout=None, stderr=None)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            done = [n for n, c in record_of(run_dir)["candidates"].items()
                    if c.get("status") == "done"]
        except (OSError, json.JSONDecodeError):
            done = []
        if len(done) >= 3 or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the search ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)               # the search alone: its candidate gets SIGTERM
    proc.wait()
    first = {n: dict(c) for n, c in record_of(run_dir)["candidates"].items()
             if c.get("status") == "done"}
    assert len(first) == 3
    tuned = [n for n in first if n != "float"]
    assert all(n.endswith("-qat") for n in tuned), tuned

    def fine_tunes(name):       # stage starts in the candidate's log, over every launch
        log = (run_dir / "search" / "runs" / f"{name}.log").read_text()
        return sum(log.count(f"[{stage}] ") for stage in ("channels", "qat")) // 2
    before = {n: fine_tunes(n) for n in tuned}
    code, out, err = search(run_dir, "--target", "max_bytes=20KB", "--target", "candidates=4",
                            "--target", "refine=0")
    assert code in (0, 3), err[-3000:]
    record = record_of(run_dir)
    assert all(record["candidates"][n]["launches"] == 1 for n in first)
    assert {n: fine_tunes(n) for n in tuned} == before              # not fine-tuned again
    assert all(c["status"] in ("done", "refused", "skipped")
               for c in record["candidates"].values())
    ran = [c for c in record["candidates"].values() if c["status"] != "skipped"]
    assert len(ran) == 5                               # the dense reference and 4


# --- where the search meets the other features: the kinds of dense runs it starts from ---
from test_bring_your_own import keras3_cnn_file  # noqa: E402,F401  (a fixture)

PARENTS = {
    # bfloat16 training; the candidates' QAT runs in float32 (tfmot's rule)
    "mixed_bfloat16": ["precision.policy=mixed_bfloat16", "train.epochs=3"],
    # gradients accumulated over 2 micro-batches on one device
    "accumulation": ["distribute.strategy=one_device", "train.accumulation_steps=2",
                     "data.per_replica_batch_size=32", "train.epochs=3"],
    # a Keras 3 file, not trained here (train.epochs: 0): the converted model is the dense one
    "keras3_file": ["train.epochs=0"],
}


@pytest.mark.parametrize("parent", list(PARENTS) + ["two_workers"])
def test_a_search_starts_from_every_kind_of_dense_run(parent, tmp_path, request):
    """The dense run trained under bfloat16, with accumulation, by a 2-worker launch (the
    candidates run in one process: the global batch is kept, an elastic resume), or a
    Keras 3 file taken as it is: the search fine-tunes its candidates from it, each
    finishing or refused at its plan (never failing), and exports a file."""
    from helpers import quick_config
    from tftrain.run import run

    if parent == "two_workers":
        from test_launch import launch
        proc = launch(tmp_path, "train.epochs=2", "export.tflite=float")
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        run_dir = tmp_path / "quickstart"
    else:
        sets = PARENTS[parent]
        if parent == "keras3_file":
            sets = [*sets, f"model={{name: 'file:{request.getfixturevalue('keras3_cnn_file')}'}}"]
        run(quick_config(tmp_path, *sets, "export.tflite=float"))
        run_dir = tmp_path / "quickstart"
    # 16 KB: channel pruning to a quarter with QAT first (predicted 15 KB): the joint
    # with the most of the dense run in it (its checkpoints, batch, precision, model)
    code, out, err = search(run_dir, "--target", "max_bytes=16KB", "--target", "candidates=1",
                            "--target", "refine=0")
    assert code in (0, 3), err[-3000:]
    record = record_of(run_dir)
    statuses = {n: c["status"] for n, c in record["candidates"].items()}
    assert len(statuses) == 2 and "failed" not in statuses.values(), record["candidates"]
    assert statuses["float"] == "done" and Path(record["chosen_file"]).exists()
    tuned = [n for n, s in statuses.items() if s == "done" and n != "float"]
    assert tuned, statuses
