"""Activation recomputation (`train.recompute: blocks`) against the same step without it.

Two models at a batch where activations dominate a step's memory: a ResNet of ResNet-50's
depth (the CIFAR form, 6n + 2 = 50 layers of convolution, width 16, 32 x 32 images,
batch 64) and a 12-layer transformer (dimension 64, 4 heads, 128 tokens, batch 32,
dropout 0.1). Each in two settings: one device in float32, and 2 mirrored replicas (the
2 logical CPU devices) in mixed_bfloat16 with 2 accumulation steps. For each:

- the allocator's peak during one update, with / without recompute (TensorFlow's BFC
  allocator statistics; the logical CPU devices share one allocator, so the mirrored
  figure is both replicas'), the median of 7 interleaved updates per side: the target
  is at most 0.4;
- the step's time with / without, as the median of per-round ratios over interleaved
  rounds of one update each (the machine's speed moves by up to 2x over seconds:
  rounds of seconds read ratios from 0.5 to 2), the quartiles printed: the target is at
  most 1.35;
- the weights after 20 updates from the same start on the same batches: equal within
  1e-6 relative (|a - b| / |b| over all weights as one vector), checked as well on 2
  mirrored replicas in float32 with 2 accumulation steps (in bfloat16, where one
  rounding is 2^-8, the figure is printed for what it is).

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
            "2 mirrored replicas, mixed_bfloat16, accumulation 2": ("mirrored", "mixed_bfloat16", 2),
            # the weights alone: mirrored accumulation in float32, where 1e-6 is a bound
            # rounding leaves room for (bfloat16 rounds each product to 2^-8)
            "2 mirrored replicas, float32, accumulation 2": ("mirrored", "float32", 2)}
WEIGHTS_ONLY = {"2 mirrored replicas, float32, accumulation 2"}
# each setting's devices as a run of it configures them (a process of its own: logical
# devices and threads are set once per process): one device gets every core for each op;
# 2 mirrored replicas on the 2 logical CPUs get a core each (`strategy.share_cores`)
DEVICES = {"one": ["distribute.strategy=one_device", "distribute.virtual_cpus=1"],
           "mirrored": ["distribute.strategy=mirrored", "distribute.virtual_cpus=2"]}
UPDATES = 20
PEAK_ROUNDS = 7         # updates per side whose allocator peak is taken (the median)


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
    # the weights' relative difference, all tensors as one vector (a tensor whose gradient
    # is zero but for rounding, as attention's key bias, ~1e-11, differs by 100% of itself)
    ours, theirs = (np.concatenate([w.ravel() for w in side.weights()]) for side in (again, plain))
    worst = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
    if not rounds:
        return {"weights_rel": worst, "segments": len(again.model.recompute.segments)}
    # the peak of one update, interleaved PEAK_ROUNDS times: 2 replicas sharing the one
    # CPU allocator peak at 0.35-0.41 of the plain step from update to update, as their
    # threads happen to overlap; the median of each side is compared
    found = {plain: [], again: []}
    for r in range(PEAK_ROUNDS):
        for side in ((plain, again) if r % 2 == 0 else (again, plain)):
            tf.config.experimental.reset_memory_stats("CPU:0")
            base = tf.config.experimental.get_memory_info("CPU:0")["current"]
            side.train(1)
            found[side].append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - base)
    peaks = {side: statistics.median(values) for side, values in found.items()}
    ratios = []
    for side in (plain, again):
        side.timed(1)                     # the repeated input's first pass (traced)
    for r in range(rounds):
        order = (plain, again) if r % 2 == 0 else (again, plain)
        seconds = {side: side.timed(steps) for side in order}
        ratios.append(seconds[again] / seconds[plain])
    return {"peak_ratio": peaks[again] / peaks[plain], "peak_plain": peaks[plain],
            "peak_recompute": peaks[again], "peak_spread": {
                name: (min(found[side]), max(found[side]))
                for name, side in (("plain", plain), ("recompute", again))}, "time_ratio": statistics.median(ratios),
            "time_spread": tuple(np.percentile(ratios, [25, 75])), "weights_rel": worst,
            "segments": len(again.model.recompute.segments)}


def _mib_range(pair) -> str:
    return f"{pair[0] / 2**20:,.0f}-{pair[1] / 2**20:,.0f} MiB"


def run_cli(directory, sets, config="quickstart.yaml"):
    """summary.json of `python -m tftrain.run` on `config` with `sets`, and the plan's
    planner lines."""
    args = [sys.executable, "-m", "tftrain.run", str(ROOT / "configs" / config),
            "--run-dir", str(directory), "--set", "run.name=quickstart"]
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


# the planner's pick against the ways it compares, measured: 3 models, each at 2
# limits of distribute.device_memory (shares of the planner's estimate of the configured
# step without recompute, which then does not fit), one device in float32
GRID_SETS = ["distribute.strategy=one_device", "distribute.virtual_cpus=1",
             "precision.policy=float32", "export.tflite=none", "export.saved_model=false",
             "train.recalibrate_batch_norm=off", "train.verbose=0"]
GRID = {
    "ResNet-50 depth, batch 128": ("quickstart.yaml", 602.6, [
        "model={name: resnet, params: {depth: 50, width: 16}}",
        "data.params={image_size: 32, channels: 3}", "train.global_batch_size=128",
        "data.per_replica_batch_size=128", "train.epochs=2"]),
    "transformer 12 layers, 128 tokens, batch 64": ("transformer_tokens.yaml", 858.9, [
        "model.params={embed_dim: 64, num_heads: 4, num_layers: 12, mlp_dim: 256, dropout: 0.1}",
        "data.params={kind: tokens, num_examples: 1024, seq_len: 128, vocab_size: 1000}",
        "train.global_batch_size=64", "data.per_replica_batch_size=64", "train.epochs=2",
        "train.early_stopping=null"]),
    # (a batch where activations outweigh the host pipeline's buffers, which share the CPU
    # allocator: at 128 examples the same run's peak moved between 67 and 92 MiB)
    "MobileNetV2 (alpha 0.5, 32x32), batch 512": ("resnet_synthetic.yaml", None, [
        "model={name: 'keras_applications:MobileNetV2', params: {alpha: 0.5}}",
        "train.global_batch_size=512", "data.per_replica_batch_size=512",
        "train.accumulation_steps=1", "train.epochs=2", "train.ema=null",
        "train.checkpoint={every: 1 epochs}"]),
}
GRID_SHARES = (0.75, 0.5)
GRID_WAYS = ("none", "blocks")        # accumulation alone; recomputation (and accumulation)


def planned_mib(config, sets) -> float:
    """The planner's estimate (MiB) of the configured step, from `--dry-run --full`."""
    args = [sys.executable, "-m", "tftrain.run", str(ROOT / "configs" / config), "--dry-run",
            "--full", *[a for s in sets for a in ("--set", s)]]
    out = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, check=True).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("device 0:"))
    return float(line.split(":", 1)[1].split("MiB")[0].replace(",", ""))


def planner_grid(repeats, only=()):
    """For each model and limit: the plan's pick (`train.recompute: auto`), and each way
    it compares run `repeats` times, interleaved: the pick must fit (its allocator peak
    under the limit) and reach 0.9 of the fastest way that fits (medians of throughput)."""
    rows = []
    for label, (config, estimate_mib, sets) in GRID.items():
        if only and not any(word in label for word in only):
            continue
        estimate_mib = estimate_mib or planned_mib(config, GRID_SETS + sets)
        for share in GRID_SHARES:
            limit = int(estimate_mib * share * 2**20)
            base = GRID_SETS + sets + [f"distribute.device_memory={limit}"]
            rates, peaks, shapes = {}, {}, {}
            with tempfile.TemporaryDirectory() as tmp:
                for r in range(repeats):
                    for how in (("auto", *GRID_WAYS) if r == 0 else GRID_WAYS):
                        summary, _ = run_cli(Path(tmp) / f"{how}{r}",
                                             base + [f"train.recompute={how}"], config)
                        rates.setdefault(how, []).append(
                            summary["throughput"]["examples_per_sec"])
                        peaks[how] = max(peaks.get(how, 0), max(
                            summary["memory"]["peak_bytes"].values()))
                        shapes[how] = (summary["recompute"], summary["per_replica_batch_size"],
                                       summary["accumulation_steps"])
            picked = next(how for how in GRID_WAYS if shapes[how] == shapes["auto"])
            median = {how: statistics.median(rates[how]) for how in GRID_WAYS}
            fitting = [how for how in GRID_WAYS if peaks[how] <= limit] or list(GRID_WAYS)
            ways = "; ".join(
                f"{shapes[h][0]} at {shapes[h][1]} x {shapes[h][2]}: {median[h]:.1f} ex/s "
                f"({', '.join(f'{x:.1f}' for x in rates[h])}), peak {peaks[h] / 2**20:,.0f} MiB"
                for h in GRID_WAYS)
            best = max(fitting, key=median.get)
            verdict = (f"picked {shapes['auto'][0]} (peak {peaks['auto'] / 2**20:,.0f} MiB, "
                       f"{'fits' if peaks['auto'] <= limit else 'OVER the limit'}), "
                       f"{median[picked] / median[best]:.2f} of the fastest that fits")
            rows.append((f"planner pick, {label}, distribute.device_memory "
                         f"{limit / 2**20:,.0f} MiB ({share:.0%} of the step's estimate)",
                         f"{verdict}; the ways: {ways}; CPU {record.cpu_features()}"))
            print(*rows[-1], sep=": ", flush=True)
    return rows


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
    p.add_argument("--grid-repeats", type=int, default=2,
                   help="runs of each way the planner compares, per model and limit")
    p.add_argument("--no-grid", action="store_true", help="leave out the planner's grid")
    p.add_argument("--grid-models", nargs="+", help="only the grid's models whose label has a word")
    p.add_argument("--only-grid", action="store_true", help="the planner's grid alone")
    p.add_argument("--no-fit", action="store_true",
                   help="leave out the run that does not fit distribute.device_memory")
    args = p.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.rounds, args.steps, args.child[2])
    print(f"CPU: {record.cpu_features()}")
    figures = []
    for case in ([] if args.only_grid else args.cases):
        for setting in SETTINGS:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                rounds = 0 if setting in WEIGHTS_ONLY else args.rounds
                subprocess.run([sys.executable, __file__, "--rounds", str(rounds),
                                "--steps", str(args.steps), "--child", case, setting, str(out)],
                               check=True, cwd=ROOT)
                r = json.loads(out.read_text())
            label = f"recompute (blocks) / none, {CASES[case][0]}, {setting}"
            if not rounds:
                figures.append((label, f"weights after {UPDATES} updates {r['weights_rel']:.1e} "
                                f"relative (all weights' norm); {r['segments']} segments"))
                print(figures[-1][0], figures[-1][1], sep=": ", flush=True)
                continue
            lo, hi = r["time_spread"]
            figures.append((label, (
                f"allocator peak {r['peak_ratio']:.2f} ({r['peak_recompute'] / 2**20:,.0f} / "
                f"{r['peak_plain'] / 2**20:,.0f} MiB, medians of {PEAK_ROUNDS} updates; ranges "
                f"{_mib_range(r['peak_spread']['recompute'])} / "
                f"{_mib_range(r['peak_spread']['plain'])}); step time {r['time_ratio']:.2f} "
                f"(median of {args.rounds} interleaved rounds, quartiles {lo:.2f}-{hi:.2f}); weights "
                f"after {UPDATES} updates {r['weights_rel']:.1e} relative (all weights' norm); "
                f"{r['segments']} "
                f"segments; CPU {record.cpu_features()}")))
            print(figures[-1][0], figures[-1][1], sep=": ", flush=True)
    if args.only_grid or not args.no_grid:
        grid = planner_grid(args.grid_repeats, args.grid_models or ())
        if args.only_grid:
            return record.rows(grid)
        figures += grid
    if args.no_fit:
        return record.rows(figures)
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
