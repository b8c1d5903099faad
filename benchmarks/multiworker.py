"""Multi-worker scaling on localhost: 2 workers pinned to one core each against 1 worker
pinned to one core, same per-replica batch, real processes over gRPC collectives.

Rounds alternate the two sides (ABBA); figures are medians over rounds. The all-reduce
time per update is the step time of the 2-worker run minus that of the 1-worker run
(each replica does the same work per step, so the difference is communication and sync).

    python benchmarks/multiworker.py [--rounds 3]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
SETS = ["distribute.strategy=auto", "distribute.virtual_cpus=null", "precision.policy=float32",
        "data.name=synthetic", "data.params={shape: [32, 32, 3], num_examples: 8192}",
        "model={name: resnet, params: {depth: 8, width: 16}}",
        # the same step on both sides: XLA's measured choice could differ between them
        "train.jit_compile=false",
        "train.epochs=3", "export.saved_model=false", "export.tflite=none", "train.verbose=0"]


def throughput(workers: int, batch: int) -> tuple[float, int, dict]:
    """(examples/s, global batch, host figures) of one launch with `workers` workers, one
    core each."""
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "tftrain.launch", "--workers", str(workers),
                "--cpus-per-worker", "1", str(ROOT / "configs" / "quickstart.yaml"),
                "--run-dir", out, "--set", f"data.per_replica_batch_size={batch}",
                *[a for s in SETS for a in ("--set", s)]]
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"launch failed:\n{proc.stdout[-3000:]}")
        summary = json.loads((Path(out) / "quickstart" / "summary.json").read_text())
        return (summary["throughput"]["examples_per_sec"], summary["global_batch_size"],
                summary["throughput"]["host"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128],
                   help="per-replica batch sizes")
    args = p.parse_args()
    figures = []
    for batch in args.batches:
        one, two, ratios, reduce_ms, steps, host_ms = [], [], [], [], [], []
        for r in range(args.rounds):
            order = [1, 2] if r % 2 == 0 else [2, 1]
            measured = {w: throughput(w, batch) for w in order}
            (rate1, batch1, _), (rate2, batch2, host) = measured[1], measured[2]
            # the host's work per update in the cluster: per call, over the steps per call
            host_ms.append(1e3 * host["host_seconds_per_call"] / host["steps_per_execution"])
            one.append(rate1)
            two.append(rate2)
            ratios.append(rate2 / rate1)
            steps.append((1e3 * batch2 / rate2, 1e3 * batch1 / rate1))
            reduce_ms.append(steps[-1][0] - steps[-1][1])
        step2, step1 = (statistics.median(s) for s in zip(*steps))
        figures += [
            (f"2 workers / 1 worker throughput, one core each, ResNet-8 on 32×32×3, {batch} per "
             "replica (median of interleaved pairs)",
             f"{statistics.median(ratios):.2f}× ({statistics.median(two):.0f} vs "
             f"{statistics.median(one):.0f} ex/s; {args.rounds} pairs)"),
            (f"2 localhost workers, {batch} per replica: all-reduce and sync per update (step "
             "time of 2 workers minus 1 worker); host work per update outside the steps",
             f"{statistics.median(reduce_ms):.1f} ms (step {step2:.1f} vs {step1:.1f} ms); "
             f"{statistics.median(host_ms):.2f} ms ({host['steps_per_execution']} steps per "
             f"call)")]
    record.rows(figures)


if __name__ == "__main__":
    main()
