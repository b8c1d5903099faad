"""Activation recomputation (`train.recompute: blocks`) against the same step without it.

Two models at a batch where activations dominate a step's memory: a ResNet of ResNet-50's
depth (the CIFAR form, 6n + 2 = 50 layers of convolution, width 16, 32 x 32 images,
batch 64) and a 12-layer transformer (dimension 64, 4 heads, 128 tokens, batch 32,
dropout 0.1). Each in two settings: one device in float32, and 2 mirrored replicas (the
2 logical CPU devices) in mixed_bfloat16 with 2 accumulation steps. For each:

- the allocator's peak during one update, with / without recompute (TensorFlow's BFC
  allocator statistics; the logical CPU devices share one allocator, so the mirrored
  figure is both replicas'): the target is at most 0.4;
- the step's time with / without, as the median of per-round ratios over interleaved
  rounds (the spread printed): the target is at most 1.35;
- the weights after 20 updates from the same start on the same batches: equal within
  1e-6 relative (the largest difference over a tensor's largest value).

Then a run that does not fit `distribute.device_memory` at its batch without recompute
(`python -m tftrain.run`, the ResNet at a global batch of 128): with `train.recompute:
auto` the plan picks recomputation at the whole micro-batch; with `none`, accumulation at
the micro-batch that fits. Each run's allocator peak must stay under the limit, and the
recomputing run's throughput is compared with the accumulating run's.

    python benchmarks/recompute.py --rounds 5
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")   # before TensorFlow loads

import numpy as np

import tftrain  # noqa: F401
import record
from tftrain.config import load_config
from tftrain.core.keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.runtime import precision
from tftrain.runtime.strategy import configure_devices
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel

import tensorflow as tf

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "resnet": ("ResNet-50 depth (CIFAR form, width 16, 32x32, batch 64)", "resnet",
               {"depth": 50, "width": 16}, InputSpec((32, 32, 3), "float32", 10), 64),
    "transformer": ("transformer 12 layers (dim 64, 4 heads, 128 tokens, batch 32)",
                    "transformer", {"num_layers": 12, "embed_dim": 64, "num_heads": 4,
                                    "mlp_dim": 256, "dropout": 0.1},
                    InputSpec((128,), "int32", 4, 1000), 32),
}
SETTINGS = {"one device, float32": ("one", "float32", 1),
            "2 mirrored replicas, mixed_bfloat16, accumulation 2": ("mirrored", "mixed_bfloat16", 2)}
UPDATES = 20


def batches(spec, batch, n, seed=0):
    rng = np.random.default_rng(seed)
    if spec.vocab_size:
        x = rng.integers(1, spec.vocab_size, (batch * n, *spec.shape)).astype(np.int32)
    else:
        x = rng.normal(size=(batch * n, *spec.shape)).astype(np.float32)
    y = rng.integers(0, spec.num_classes, batch * n).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


class Side:
    """One side of the comparison: the model trained with or without recompute."""

    def __init__(self, case, setting, recompute):
        _, name, params, spec, batch = CASES[case]
        kind, policy, accumulation = SETTINGS[setting]
        self.strategy = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) if kind == "mirrored"
                         else tf.distribute.OneDeviceStrategy("/cpu:0"))
        precision.apply_policy(policy)
        keras.utils.set_random_seed(1)
        with self.strategy.scope():
            net = precision.float32_outputs(MODELS.get(name)(spec, **params))
            self.model = TrainModel.wrap(net, accumulation, recompute=recompute)
            self.model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                               build_loss("sparse_categorical_crossentropy"))
        precision.apply_policy("float32")
        self.data = batches(spec, batch, UPDATES)

    def train(self, updates):
        self.model.fit(self.data.take(updates), epochs=1, verbose=0)

    def weights(self):
        return [w.numpy().astype(np.float64) for w in self.model.weights]


def compare(case, setting, rounds):
    keras.backend.experimental.enable_tf_random_generator()
    plain, again = Side(case, setting, None), Side(case, setting, ("blocks", None))
    # the weights after UPDATES updates (the first also traces each side's step)
    plain.train(UPDATES)
    again.train(UPDATES)
    worst = max(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))
                for a, b in zip(again.weights(), plain.weights()))
    peaks = {}
    for side in (plain, again):
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        side.train(1)
        peaks[side] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
    ratios = []
    steps = 3
    for r in range(rounds):
        seconds = {}
        for side in ((plain, again) if r % 2 == 0 else (again, plain)):
            start = time.perf_counter()
            side.train(steps)
            seconds[side] = (time.perf_counter() - start) / steps
        ratios.append(seconds[again] / seconds[plain])
    return {"peak_ratio": peaks[again] / peaks[plain], "peak_plain": peaks[plain],
            "peak_recompute": peaks[again], "time_ratio": statistics.median(ratios),
            "time_spread": (min(ratios), max(ratios)), "weights_rel": worst,
            "segments": len(again.model.recompute.segments)}


def run_cli(directory, sets):
    """summary.json of `python -m tftrain.run` on the quickstart config with `sets`."""
    args = [sys.executable, "-m", "tftrain.run", str(ROOT / "configs" / "quickstart.yaml"),
            "--run-dir", str(directory)]
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true"}
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    plan = [line for line in out.stdout.splitlines() if "planner" in line or "    " in line[:6]]
    return json.loads((Path(directory) / "quickstart" / "summary.json").read_text()), plan


def does_not_fit(limit_mib):
    """The ResNet at global batch 128 under `distribute.device_memory`: recompute (auto)
    against accumulation (none)."""
    base = ["model={name: resnet, params: {depth: 50, width: 16}}", "data.params={image_size: 32, channels: 3}",
            "train.global_batch_size=128", "data.per_replica_batch_size=128",
            "distribute.strategy=one_device", f"distribute.device_memory={limit_mib * 2**20}",
            "train.epochs=2", "export.tflite=none", "export.saved_model=false",
            "train.recalibrate_batch_norm=off", "train.verbose=0"]
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for how in ("auto", "none"):
            summary, plan = run_cli(Path(tmp) / how, base + [f"train.recompute={how}"])
            found[how] = summary
            print(f"train.recompute: {how}:", *plan, sep="\n  ")
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--limit-mib", type=int, default=450,
                   help="distribute.device_memory of the run that does not fit")
    args = p.parse_args()
    configure_devices(load_config(None, ["distribute.virtual_cpus=2"]))
    print(f"CPU: {record.cpu_features()}")
    figures = []
    for case in args.cases:
        for setting in SETTINGS:
            r = compare(case, setting, args.rounds)
            label = f"recompute (blocks) / none, {CASES[case][0]}, {setting}"
            lo, hi = r["time_spread"]
            figures.append((label, (
                f"allocator peak {r['peak_ratio']:.2f} ({r['peak_recompute'] / 2**20:,.0f} / "
                f"{r['peak_plain'] / 2**20:,.0f} MiB); step time {r['time_ratio']:.2f} "
                f"(median of {args.rounds} interleaved rounds, {lo:.2f}-{hi:.2f}); weights "
                f"after {UPDATES} updates {r['weights_rel']:.1e} relative; {r['segments']} "
                f"segments; CPU {record.cpu_features()}")))
            print(figures[-1][0], figures[-1][1], sep=": ", flush=True)
    runs = does_not_fit(args.limit_mib)
    auto, none = runs["auto"], runs["none"]
    limit = args.limit_mib * 2**20

    def peak(s):
        return max(s["memory"]["peak_bytes"].values())
    figures.append((
        f"a ResNet-50-depth step that does not fit distribute.device_memory {args.limit_mib} MiB "
        "at global batch 128: recompute (auto) / accumulation (none)",
        f"plan: recompute {auto['recompute']}, micro-batch {auto['per_replica_batch_size']} x "
        f"{auto['accumulation_steps']} against micro-batch {none['per_replica_batch_size']} x "
        f"{none['accumulation_steps']}; allocator peak {peak(auto) / 2**20:,.0f} and "
        f"{peak(none) / 2**20:,.0f} MiB (under the limit: {peak(auto) <= limit} and "
        f"{peak(none) <= limit}); throughput {auto['throughput']['examples_per_sec']:.1f} / "
        f"{none['throughput']['examples_per_sec']:.1f} ex/s = "
        f"{auto['throughput']['examples_per_sec'] / none['throughput']['examples_per_sec']:.2f}; "
        f"CPU {record.cpu_features()}"))
    record.rows(figures)


if __name__ == "__main__":
    main()
