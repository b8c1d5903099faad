"""Kill anything, anywhere: SIGKILL a run at random moments and check that it still ends
with the planned updates and the weights of an uninterrupted run.

Single process: the compression pipeline (train -> prune -> QAT -> export) is started,
SIGKILLed at a random moment, restarted, and so on for `--kills` kills spread over the
three stages (each once the restarted run trains again, up to 0.5 s after its first new
checkpoint: mid-batch, mid-save or mid-validation), then left to finish. Cluster: a
2-worker `tftrain.launch` run has one of its workers SIGKILLed at `--worker-kills`
such moments (the launcher stops the other, the launch is repeated).
Each ends compared with an uninterrupted run of the same command: planned updates per
stage, and every weight of the final checkpoint within 1e-6.

    python benchmarks/chaos.py [--kills 20] [--worker-kills 5] [--seed 0]
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import record

ROOT = Path(__file__).resolve().parents[1]
STAGED = [f"{ROOT}/configs/compress.yaml",
          "--set", "train.epochs=2", "--set", "compression.pruning.epochs=2",
          "--set", "compression.quantization.epochs=1", "--set", "model.params.dense=[64]",
          "--set", "train.checkpoint.every=2", "--set", "run.deterministic=true",
          "--set", "train.verbose=0"]
CLUSTER = [f"{ROOT}/configs/quickstart.yaml", "--set", "train.epochs=4",
           "--set", "train.checkpoint.every=5", "--set", "run.deterministic=true",
           "--set", "distribute.strategy=auto", "--set", "distribute.virtual_cpus=1",
           "--set", "export.tflite=none", "--set", "train.verbose=0"]     # 1 replica per worker
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def start(command):
    return subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def single(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tftrain.run", *STAGED, "--run-dir", str(run_dir)]


def launched(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tftrain.launch", "--workers", "2", *CLUSTER,
            "--run-dir", str(run_dir)]


def timed(command) -> float:
    began = time.perf_counter()
    proc = start(command)
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return time.perf_counter() - began


STAGES = (("train", ""), ("prune", "prune"), ("qat", "qat"))


def stage_of(run_path: Path) -> str:
    """Where the run was when killed: the newest stage with a checkpoint, or export."""
    if (run_path / "export").exists():
        return "export"
    for stage, sub in reversed(STAGES):
        if list((run_path / "checkpoints" / sub).glob("ckpt-*.index")):
            return stage
    return "start-up"


def children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(p) for p in found]


def progressed(proc, run_path: Path, stages: list[str], since: float) -> bool:
    """Wait until this attempt writes a checkpoint in one of `stages` (it is training
    there, past its start-up); False if it ended first."""
    folders = [run_path / "checkpoints" / sub for stage, sub in STAGES if stage in stages]
    while proc.poll() is None:
        for folder in folders:
            if any(_written_after(p, since) for p in folder.glob("ckpt-*.index")):
                return True
        time.sleep(0.05)
    return False


def _written_after(path: Path, since: float) -> bool:
    """Whether `path` was written after `since` (False once the run deleted it: the
    checkpoint manager keeps only the newest)."""
    try:
        return path.stat().st_mtime > since
    except FileNotFoundError:
        return False


def chaos(command, run_path: Path, kills: int, stages: list[str], rng, kill_worker=False) -> dict:
    """Kill `kills` times, the i-th once the run trains in stage i * len(stages) // kills
    (or a later one), at a random moment up to 0.5 s after its first new checkpoint there
    (mid-batch, mid-save, mid-validation alike); then let it finish."""
    where, attempts = [], 0
    while len(where) < kills:
        attempts += 1
        target = stages[len(where) * len(stages) // kills]
        later = stages[stages.index(target):]
        began = time.time()
        proc = start(command)
        if progressed(proc, run_path, later, began):
            time.sleep(rng.uniform(0.0, 0.5))
        if proc.poll() is None:
            if kill_worker:
                os.kill(rng.choice(children(proc.pid)), signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGKILL)
            where.append(stage_of(run_path))
        proc.communicate()
        if proc.returncode == 0:       # finished before the kill: no more to kill
            break
    if not (run_path / "summary.json").exists():
        proc = start(command)
        _, err = proc.communicate()
        assert proc.returncode == 0, err[-3000:]
    return {"kills": len(where), "attempts": attempts, "where": where}


def compare(ours: Path, reference: Path, stage: str) -> dict:
    import tensorflow as tf
    folder = "" if stage == "train" else stage
    a = tf.train.load_checkpoint(str(ours / "checkpoints" / folder))
    b = tf.train.load_checkpoint(str(reference / "checkpoints" / folder))
    names = [n for n in b.get_variable_to_shape_map() if n.startswith("model/")]
    diff = max(float(np.max(np.abs(a.get_tensor(n) - b.get_tensor(n)))) for n in names)
    mine, theirs = (json.loads((p / "summary.json").read_text()) for p in (ours, reference))
    updates = {k: v["updates"] for k, v in mine["stages"].items()}
    planned = {k: v["updates"] for k, v in theirs["stages"].items()}
    return {"max_weight_diff": diff, "updates": updates, "planned": planned,
            "equal": diff <= 1e-6 and updates == planned}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--worker-kills", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    results = {}
    with tempfile.TemporaryDirectory(prefix="tftrain-chaos-") as tmp:
        tmp = Path(tmp)
        seconds = timed(single(tmp / "reference"))
        report = chaos(single(tmp / "chaos"), tmp / "chaos" / "compress", args.kills,
                       ["train", "prune", "qat"], rng)
        report.update(compare(tmp / "chaos" / "compress", tmp / "reference" / "compress", "qat"))
        results["single"] = {**report, "uninterrupted_seconds": round(seconds, 1)}
        print(json.dumps({"single": results["single"]}), flush=True)
        if args.worker_kills:
            seconds = timed(launched(tmp / "cluster-reference"))
            report = chaos(launched(tmp / "cluster"), tmp / "cluster" / "quickstart",
                           args.worker_kills, ["train"], rng, kill_worker=True)
            report.update(compare(tmp / "cluster" / "quickstart",
                                  tmp / "cluster-reference" / "quickstart", "train"))
            results["cluster"] = {**report, "uninterrupted_seconds": round(seconds, 1)}
            print(json.dumps({"cluster": results["cluster"]}), flush=True)
    ok = all(r["equal"] for r in results.values())
    for name, r in results.items():
        stages = {s: r["where"].count(s) for s in dict.fromkeys(r["where"])}
        print(f"{name}: {r['kills']} SIGKILLs ({', '.join(f'{k} {v}' for k, v in stages.items())}); "
              f"updates {r['updates']} (planned {r['planned']}); largest weight difference "
              f"{r['max_weight_diff']:.1e} -> {'equal' if r['equal'] else 'DIFFERENT'}")
    names = {"single": "chaos: SIGKILLs of one process at random moments, each followed by a "
                       "restart, compression pipeline on digits (`run.deterministic: true`, "
                       "checkpoint every 2 updates)",
             "cluster": "chaos: SIGKILLs of one worker of a 2-worker `tftrain.launch` run, each "
                        "followed by a relaunch"}
    record.rows([(names[name], f"{r['kills']} kills: {r['updates']} of {r['planned']} planned "
                               f"updates, largest weight difference from an uninterrupted run "
                               f"{r['max_weight_diff']:.1e}")
                 for name, r in results.items()])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
