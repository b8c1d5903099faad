"""What a topology change costs on resume: the time from starting the resumed process to
its first update's checkpoint, resumed on the topology it was written under (2 replicas
of 32) against another one (1 replica of 32 with 2 accumulation steps, the same global
batch of 64), interleaved, the median of per-round ratios.

One quickstart run (checkpoint after every update, deterministic) is SIGKILLed after
update 10 and kept as a template; each round copies it twice and resumes one copy per
topology, stopping each once the checkpoint of its first new update is written.

    python benchmarks/elastic.py [--rounds 5]
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
SETS = ["train.epochs=2", "train.checkpoint.every=1", "train.checkpoint.keep=2",
        "run.deterministic=true", "export.tflite=none", "export.preflight=false",
        "train.verbose=0"]
TOPOLOGY = {"same": ["distribute.virtual_cpus=2", "train.accumulation_steps=1"],
            "changed": ["distribute.virtual_cpus=1", "train.accumulation_steps=2"]}
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def start(run_dir: Path, topology: str) -> subprocess.Popen:
    sets = [a for s in SETS + TOPOLOGY[topology] for a in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "tftrain.run",
                             f"{ROOT}/configs/quickstart.yaml", "--run-dir", str(run_dir), *sets],
                            cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def newest(run_dir: Path) -> int:
    try:
        state = (run_dir / "quickstart" / "checkpoints" / "checkpoint").read_text()
    except OSError:
        return 0
    numbers = re.findall(r'all_model_checkpoint_paths: "ckpt-(\d+)"', state)
    return max(map(int, numbers), default=0)


def until_checkpoint(run_dir: Path, topology: str, beyond: int, timeout: float = 300) -> float:
    """Seconds from starting the run to a checkpoint numbered above `beyond`."""
    began = time.perf_counter()
    proc = start(run_dir, topology)
    try:
        while newest(run_dir) <= beyond:
            if proc.poll() is not None:
                raise SystemExit(f"the {topology} resume exited with {proc.returncode}")
            if time.perf_counter() - began > timeout:
                raise SystemExit(f"the {topology} resume wrote no checkpoint in {timeout} s")
            time.sleep(0.02)
        return time.perf_counter() - began
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "template"
        until_checkpoint(template, "same", 9)         # killed once update 10 is saved
        saved = newest(template)
        times = {"same": [], "changed": []}
        for r in range(args.rounds):
            order = ["same", "changed"] if r % 2 == 0 else ["changed", "same"]
            for topology in order:
                copy = Path(tmp) / f"{topology}-{r}"
                shutil.copytree(template, copy)
                config = copy / "quickstart" / "config.yaml"     # run.dir names the copy
                config.write_text(config.read_text().replace(str(template), str(copy)))
                times[topology].append(until_checkpoint(copy, topology, saved))
                shutil.rmtree(copy)
            print(f"round {r}: same {times['same'][-1]:.2f} s, "
                  f"changed {times['changed'][-1]:.2f} s", flush=True)
    ratios = [c / s for s, c in zip(times["same"], times["changed"])]
    record.rows([(
        "elastic resume: time from start to the first update's checkpoint, quickstart resumed "
        "after update 10 on another topology (1 replica x 32 x 2 accumulation) / on its own "
        f"(2 replicas x 32); CPU features: {record.cpu_features()}",
        f"{statistics.median(ratios):.2f} (medians {statistics.median(times['changed']):.1f} s vs "
        f"{statistics.median(times['same']):.1f} s, {args.rounds} rounds)")])


if __name__ == "__main__":
    main()
