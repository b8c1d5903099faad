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
  rounds of one update each (the machine's speed moves by up to 2x over seconds:
  rounds of seconds read ratios from 0.5 to 2), the quartiles printed: the target is at
  most 1.35;
- the weights after 20 updates from the same start on the same batches: equal within
  1e-6 relative (the largest over the tensors of |a - b| / |b|, Frobenius norms).

Each comparison runs in a process of its own with its devices as a run of that setting
configures them: one device gets every core for each op, 2 mirrored replicas a core each.

Then a run that does not fit `distribute.device_memory` at its batch without recompute
(`python -m tftrain.run`, the ResNet at a global batch of 128): with `train.recompute:
auto` the plan picks recomputation at the whole micro-batch; with `none`, accumulation at
the micro-batch that fits. Each run's allocator peak must stay under the limit, and the
recomputing run's throughput is compared with the accumulating run's.

    python benchmarks/recompute.py --rounds 31
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
from tftrain.runtime.strategy import build_strategy, configure_devices
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
# each setting's devices as a run of it configures them (a process of its own: logical
# devices and threads are set once per process): one device gets every core for each op;
# 2 mirrored replicas on the 2 logical CPUs get a core each (`strategy.share_cores`)
DEVICES = {"one": ["distribute.strategy=one_device", "distribute.virtual_cpus=1"],
           "mirrored": ["distribute.strategy=mirrored", "distribute.virtual_cpus=2"]}
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
        self.strategy = build_strategy(load_config(None, DEVICES[kind]))
        precision.apply_policy(policy)
        keras.utils.set_random_seed(1)
        with self.strategy.scope():
            net = precision.float32_outputs(MODELS.get(name)(spec, **params))
            self.model = TrainModel.wrap(net, accumulation, recompute=recompute)
            self.model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                               build_loss("sparse_categorical_crossentropy"))
        precision.apply_policy("float32")
        self.data = batches(spec, batch, UPDATES)
        self.repeated = self.data.repeat()

    def train(self, updates):
        """`updates` updates on the first batches (a fresh pass over them)."""
        self.model.fit(self.data.take(updates), epochs=1, verbose=0)

    def timed(self, steps) -> float:
        """Seconds per update over `steps` updates, each a call of the train function
        (traced before) on the next batch."""
        if not hasattr(self, "iterator"):
            self.model.make_train_function()
            self.iterator = iter(self.strategy.experimental_distribute_dataset(self.repeated))
        start = time.perf_counter()
        for _ in range(steps):
            logs = self.model.train_function(self.iterator)
        float(tf.nest.flatten(logs)[0])
        return (time.perf_counter() - start) / steps

    def weights(self):
        return [w.numpy().astype(np.float64) for w in self.model.weights]


def compare(case, setting, rounds, steps):
    keras.backend.experimental.enable_tf_random_generator()
    plain, again = Side(case, setting, None), Side(case, setting, ("blocks", None))
    # the weights after UPDATES updates (the first also traces each side's step)
    plain.train(UPDATES)
    again.train(UPDATES)
    # the largest relative difference of a weight tensor (its norm's)
    worst = max(float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))
                for a, b in zip(again.weights(), plain.weights()))
    peaks = {}
    for side in (plain, again):
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        side.train(1)
        peaks[side] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
    ratios = []
    for side in (plain, again):
        side.timed(1)                     # the repeated input's first pass (traced)
    for r in range(rounds):
        order = (plain, again) if r % 2 == 0 else (again, plain)
        seconds = {side: side.timed(steps) for side in order}
        ratios.append(seconds[again] / seconds[plain])
    return {"peak_ratio": peaks[again] / peaks[plain], "peak_plain": peaks[plain],
            "peak_recompute": peaks[again], "time_ratio": statistics.median(ratios),
            "time_spread": tuple(np.percentile(ratios, [25, 75])), "weights_rel": worst,
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
    """The ResNet at global batch 128 under `distribute.device_memory`: the planner's
    choice (`auto`), recomputation forced (`blocks`, the whole batch in one micro-batch)
    and accumulation (`none`: the largest micro-batch that fits without)."""
    base = ["model={name: resnet, params: {depth: 50, width: 16}}",
            "data.params={image_size: 32, channels: 3}",
            "train.global_batch_size=128", "data.per_replica_batch_size=128",
            "distribute.strategy=one_device", f"distribute.device_memory={limit_mib * 2**20}",
            "train.epochs=3", "export.tflite=none", "export.saved_model=false",
            "train.recalibrate_batch_norm=off", "train.verbose=0"]
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for how in ("auto", "blocks", "none"):
            summary, plan = run_cli(Path(tmp) / how, base + [f"train.recompute={how}"])
            found[how] = summary
            print(f"train.recompute: {how}:", *plan, sep="\n  ", flush=True)
    return found


def child(case, setting, rounds, steps, out):
    """One comparison in this process, its devices configured as the setting's run would."""
    configure_devices(load_config(None, DEVICES[SETTINGS[setting][0]]))
    r = compare(case, setting, rounds, steps)
    Path(out).write_text(json.dumps(r))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=3, metavar=("CASE", "SETTING", "JSON"), help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--steps", type=int, default=1, help="updates per side and round")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--limit-mib", type=int, default=450,
                   help="distribute.device_memory of the run that does not fit")
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.rounds, args.steps, args.child[2])
    print(f"CPU: {record.cpu_features()}")
    figures = []
    for case in args.cases:
        for setting in SETTINGS:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds),
                                "--steps", str(args.steps), "--child", case, setting, str(out)],
                               check=True, cwd=ROOT)
                r = json.loads(out.read_text())
            label = f"recompute (blocks) / none, {CASES[case][0]}, {setting}"
            lo, hi = r["time_spread"]
            figures.append((label, (
                f"allocator peak {r['peak_ratio']:.2f} ({r['peak_recompute'] / 2**20:,.0f} / "
                f"{r['peak_plain'] / 2**20:,.0f} MiB); step time {r['time_ratio']:.2f} "
                f"(median of {args.rounds} interleaved rounds, quartiles {lo:.2f}-{hi:.2f}); weights "
                f"after {UPDATES} updates {r['weights_rel']:.1e} relative (norm); {r['segments']} "
                f"segments; CPU {record.cpu_features()}")))
            print(figures[-1][0], figures[-1][1], sep=": ", flush=True)
    runs = does_not_fit(args.limit_mib)
    limit = args.limit_mib * 2**20

    def way(s):
        peak = max(s["memory"]["peak_bytes"].values())
        return (f"recompute {s['recompute']}, micro-batch {s['per_replica_batch_size']} x "
                f"{s['accumulation_steps']}, allocator peak {peak / 2**20:,.0f} MiB"
                f"{'' if peak <= limit else ' (OVER the limit)'}, "
                f"{s['throughput']['examples_per_sec']:.1f} ex/s")
    rate = {k: s["throughput"]["examples_per_sec"] for k, s in runs.items()}
    figures.append((
        f"a ResNet-50-depth step that does not fit distribute.device_memory {args.limit_mib} MiB "
        "at global batch 128 (python -m tftrain.run, 3 epochs of digits at 32x32x3)",
        f"auto chose {way(runs['auto'])}; blocks: {way(runs['blocks'])}; none: "
        f"{way(runs['none'])}; recompute / accumulation throughput "
        f"{rate['blocks'] / rate['none']:.2f}; CPU {record.cpu_features()}"))
    record.rows(figures)


if __name__ == "__main__":
    main()
