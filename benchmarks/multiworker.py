"""Multi-worker scaling on localhost: 2 workers pinned to one core each against 1 worker
pinned to one core, same per-replica batch, real processes over gRPC collectives.

Rounds alternate the sides (ABBA); figures are medians over rounds. The all-reduce
time per update is the step time of the 2-worker run minus that of the 1-worker run
(each replica does the same work per step, so the difference is communication and sync).
At the first batch size a third side runs 2 workers with `distribute.pack_bytes` (the
gradient all-reduce in packs launched as their gradients exist) against one pack, and
a fourth the machine's ceiling: two independent 1-worker runs at once, one per core
(what sharing the machine's memory bandwidth and caches costs, with no communication).

    python benchmarks/multiworker.py [--rounds 3] [--pack-bytes 65536]
"""
import argparse
import json
import os
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


def _launch(out: str, workers: int, batch: int, pack_bytes: int | None, cpu: int | None):
    """A launch writing into `out`; the launcher (and so its workers) on core `cpu`
    when given, else each worker on its own core."""
    args = [sys.executable, "-m", "tftrain.launch", "--workers", str(workers),
            "--cpus-per-worker", "1", str(ROOT / "configs" / "quickstart.yaml"),
            "--run-dir", out, "--set", f"data.per_replica_batch_size={batch}",
            "--set", f"distribute.pack_bytes={pack_bytes or 'null'}",
            *[a for s in SETS for a in ("--set", s)]]
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=pin)


def _summary(out: str, proc) -> tuple[float, int, dict]:
    log, _ = proc.communicate()
    if proc.returncode:
        sys.exit(f"launch failed:\n{log[-3000:]}")
    summary = json.loads((Path(out) / "quickstart" / "summary.json").read_text())
    return (summary["throughput"]["examples_per_sec"], summary["global_batch_size"],
            summary["throughput"]["host"])


def throughput(workers: int, batch: int, pack_bytes: int | None = None) -> tuple[float, int, dict]:
    """(examples/s, global batch, host figures) of one launch with `workers` workers, one
    core each, the gradient all-reduce in packs of `pack_bytes` (None: one pack)."""
    with tempfile.TemporaryDirectory() as out:
        return _summary(out, _launch(out, workers, batch, pack_bytes, None))


def side_by_side(batch: int) -> tuple[float, int, dict]:
    """The machine's ceiling for two workers: two independent one-worker runs at once,
    one per core, nothing exchanged; their summed examples/s."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        procs = [(out, _launch(out, 1, batch, None, cpu)) for out, cpu in zip((a, b), cpus)]
        results = [_summary(out, proc) for out, proc in procs]
    return sum(r[0] for r in results), results[0][1], results[0][2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128],
                   help="per-replica batch sizes")
    p.add_argument("--pack-bytes", type=int, default=65536,
                   help="pack size of the packed side at the first batch size (0: no such side)")
    args = p.parse_args()
    figures = []
    for batch in args.batches:
        one, two, ratios, reduce_ms, steps, host_ms, packed, apart = [], [], [], [], [], [], [], []
        first = batch == args.batches[0]       # the extra sides at the first batch size only
        pack = args.pack_bytes if first else 0
        for r in range(args.rounds):
            order = ["one", "two"] + (["packed"] if pack else []) + (["apart"] if first else [])
            measured = {side: (side_by_side(batch) if side == "apart" else throughput(
                *{"one": (1, batch), "two": (2, batch), "packed": (2, batch, pack)}[side]))
                        for side in (order if r % 2 == 0 else order[::-1])}
            (rate1, batch1, _), (rate2, batch2, host) = measured["one"], measured["two"]
            if pack:
                packs = measured["packed"][2]["step_collectives"]
                packed.append((measured["packed"][0] / rate2, len(packs)))
            if first:
                apart.append(measured["apart"][0] / rate1)
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
        if apart:
            figures.append((
                f"the machine's ceiling for 2 workers, {batch} per replica: two independent "
                "1-worker runs at once, one core each, nothing exchanged / 1 worker alone",
                f"{statistics.median(apart):.2f}× ({args.rounds} rounds)"))
        if packed:
            figures.append((
                f"2 localhost workers, {batch} per replica: gradient all-reduce in packs of "
                f"`distribute.pack_bytes: {pack}` / one pack, throughput (median of rounds)",
                f"{statistics.median(r for r, _ in packed):.2f} ({packed[0][1]} collectives "
                f"per update; {args.rounds} rounds)"))
    record.rows(figures)


if __name__ == "__main__":
    main()
