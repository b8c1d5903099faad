"""tftrain's training throughput against plain tf_keras `model.fit`, interleaved.

Three models, each mirrored over 2 virtual CPUs with the same data, optimizer and
global batch on every side: the quickstart CNN on digits, an MLP on digits (host-bound:
its step is tiny, so per-step host work shows) and a ResNet-20 on synthetic 32x32x3
images. Sides:

- plain: `model.fit` as Keras users write it (one step per call, no XLA), in a process of
  its own with TensorFlow's default threads, as a user's script runs (tftrain's process
  shares the cores between its replicas, `strategy.share_cores`);
- plain at tftrain's steps per call: `model.fit` compiled with the `steps_per_execution`
  tftrain chose for this model (sized in a warm-up epoch first), so the gain splits into
  what running several steps per call gives and what tftrain's own step adds or costs;
- tftrain: tftrain's step and callbacks as a run uses them (`steps_per_execution: auto`,
  batched checks), without XLA;
- tftrain + XLA: the same with `jit_compile: auto` (XLA where it measured faster; the
  decision is printed).

Each round times one epoch of training steps of every side (ABBA order); the figures
are medians over rounds of the per-round ratios, so noise that hits all sides cancels.
Also prints bfloat16/float32 and float16/float32 throughput of tftrain's step.

    python benchmarks/overhead.py [--rounds 7] [--steps 60] [--json FILE]
"""
import argparse
import json
import statistics
import sys

import tftrain  # noqa: F401
from tftrain import data
from tftrain.runtime import strategy
from tftrain.config import load_config
import record
from interleave import (RemoteSide, Server, build_side, epoch_rate, input_wait, interleaved,
                        median_ratio, ratio_spread, serve)

MODELS = {
    "quickstart CNN on digits": ([], 1.0),
    "MLP 128-64 on digits": (["model={name: mlp, params: {hidden: [128, 64]}}"], 1.0),
    "ResNet-20 on 32x32x3": (["data.name=synthetic",
                              "data.params={shape: [32, 32, 3], num_examples: 4096}",
                              "model={name: resnet, params: {depth: 20, width: 16}}"], 0.4),
}


def plain_process():
    """What a user's own script gets: 2 logical CPU devices for MirroredStrategy and
    TensorFlow's default threads (tftrain's process shares the cores between its replicas:
    `strategy.share_cores`). The plain sides live in such a process (`--plain-server`)."""
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return strategy.build_strategy(load_config("configs/quickstart.yaml"))


def plain_side(strat, name: str, steps_per_execution: str):
    cfg = load_config("configs/quickstart.yaml", MODELS[name.replace("_", " ")][0])
    source = data.load_source(cfg.data, cfg.run.seed)
    plan = data.plan_batches(cfg, strat.num_replicas_in_sync)
    return (build_side(cfg, source, plan, strat, False,
                       steps_per_execution=int(steps_per_execution)), plan.global_batch)


def fit_overhead(rounds: int, steps: int, seconds: float = 2.0, only=None) -> list[dict]:
    """tftrain / plain fit for each model, without and with `jit_compile: auto`; each
    timed epoch lasts about `seconds` on the slowest side. The plain sides run in a process
    of their own with TensorFlow's default threads, as a user's script does; each side's
    epoch is timed while the other process waits. `only`: the models whose names contain
    one of these words (all when None)."""
    import sys
    rows = []
    cfg0 = load_config("configs/quickstart.yaml")
    strategy.configure_devices(cfg0)           # as tftrain runs: the cores shared by replicas
    strat = strategy.build_strategy(cfg0)
    server = Server([sys.executable, __file__, "--plain-server"])
    for name, (sets, share) in MODELS.items():
        if only and not any(word.lower() in name.lower() for word in only):
            continue
        cfg = load_config("configs/quickstart.yaml", sets)
        source = data.load_source(cfg.data, cfg.run.seed)
        plan = data.plan_batches(cfg, strat.num_replicas_in_sync)
        # steps of each timed epoch: ResNet-20's step is ~20x the CNN's, and 24 of them (2 s)
        # leave auto sizing room for several steps per call (a run's bound is its checkpoint
        # interval; here a sixth of the epoch, so each timed epoch has several calls)
        n = max(6, int(steps * share))
        print(f"{name}:", flush=True)
        key = name.replace(" ", "_")
        server.ask(f"side plain {key} 1")
        sides = [RemoteSide(server, "plain"),
                 build_side(cfg, source, plan, strat, True, steps_per_execution="auto", steps=n),
                 build_side(cfg, source, plan, strat, True, steps_per_execution="auto",
                            jit_compile="auto", steps=n)]
        epoch_rate(sides[1], n, plan.global_batch, 0)     # sizes tftrain's calls
        chosen = int(sides[1][0].steps_per_execution.numpy())
        server.ask(f"side plain_same {key} {chosen}")
        sides.append(RemoteSide(server, "plain_same"))
        plain, ours, xla, plain_same = interleaved(sides, rounds, n, plan.global_batch,
                                                   seconds=seconds)
        row = {"model": name, "tftrain_over_plain": median_ratio(ours, plain),
               "xla_auto_over_plain": median_ratio(xla, plain),
               "plain_same_calls_over_plain": median_ratio(plain_same, plain),
               "tftrain_over_plain_same_calls": median_ratio(ours, plain_same),
               "tftrain_over_plain_same_calls_spread": ratio_spread(ours, plain_same),
               "input_wait": input_wait(sides[1]),
               "feed": "device" if sides[1][0].feed is not None else "host",
               "plain_examples_per_sec": statistics.median(plain),
               "tftrain_examples_per_sec": statistics.median(ours),
               "xla_auto_examples_per_sec": statistics.median(xla),
               "steps_per_execution": chosen,
               "xla_compiled": bool(sides[2][0].jit_compile_gradients),
               "rounds": rounds}
        rows.append(row)
        print(f"  tftrain / plain model.fit throughput: {row['tftrain_over_plain']:.3f}; "
              f"with jit_compile auto: {row['xla_auto_over_plain']:.3f} (XLA "
              f"{'on' if row['xla_compiled'] else 'off'}; medians {row['tftrain_examples_per_sec']:.0f}"
              f" / {row['xla_auto_examples_per_sec']:.0f} vs plain {row['plain_examples_per_sec']:.0f}"
              f" ex/s; {row['steps_per_execution']} steps per call) [median of {rounds} rounds]",
              flush=True)
        low, high = row["tftrain_over_plain_same_calls_spread"]
        print(f"  tftrain / plain model.fit at the same steps per call: "
              f"{row['tftrain_over_plain_same_calls']:.3f} (rounds {low:.3f}-{high:.3f}); "
              f"batches fed from the {row['feed']}, input waits {row['input_wait'] or 0:.1%}",
              flush=True)
    server.close()
    return rows


def precision_ratios(rounds: int, steps: int) -> list[dict]:
    """bfloat16/float32 and float16/float32 throughput of tftrain's step on the quickstart
    CNN and on a compute-bound CNN (32x32x3 inputs)."""
    cfg = load_config("configs/quickstart.yaml")
    strat = strategy.build_strategy(cfg)
    plan = data.plan_batches(cfg, strat.num_replicas_in_sync)
    larger = load_config("configs/quickstart.yaml", [
        "data.name=synthetic", "data.params={shape: [32, 32, 3], num_examples: 4096}",
        "model.params={filters: [64, 128], dense: [256]}"])
    rows = []
    for name, c in (("quickstart CNN", cfg), ("CNN 64-128 on 32x32x3", larger)):
        src = data.load_source(c.data, c.run.seed)
        sides = [build_side(c, src, plan, strat, True, p)
                 for p in ("float32", "mixed_bfloat16", "mixed_float16")]
        n = min(steps if c is cfg else 20, plan.steps_per_epoch(src.num_train))
        f32, bf16, f16 = interleaved(sides, rounds, n, plan.global_batch)
        row = {"model": name, "bfloat16_over_float32": median_ratio(bf16, f32),
               "float16_over_float32": median_ratio(f16, f32), "rounds": rounds}
        rows.append(row)
        print(f"{name}: mixed_bfloat16 / float32 throughput {row['bfloat16_over_float32']:.2f}; "
              f"mixed_float16 / float32 throughput {row['float16_over_float32']:.2f}", flush=True)
    return rows


def main():
    if sys.argv[1:] == ["--plain-server"]:
        strat = plain_process()
        serve(lambda name, spe: plain_side(strat, name, spe))
        return
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seconds", type=float, default=2.0,
                   help="length of each timed epoch on the slowest side")
    p.add_argument("--skip-precision", action="store_true")
    p.add_argument("--models", nargs="+", metavar="WORD",
                   help="only the models whose names contain one of these words (CNN, MLP, "
                        "ResNet); nothing is recorded then")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    out = {"fit_overhead": fit_overhead(args.rounds, args.steps, args.seconds, args.models)}
    if not args.skip_precision:
        out["precision"] = precision_ratios(args.rounds, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.models:
        return
    figures = []
    for r in out["fit_overhead"]:
        figures.append((
            f"tftrain / plain tf_keras `model.fit` throughput, {r['model']}, mirrored over 2 "
            "virtual CPUs; with `jit_compile: auto` / plain fit without XLA",
            f"{r['tftrain_over_plain']:.3f}; {r['xla_auto_over_plain']:.3f} (XLA "
            f"{'on' if r['xla_compiled'] else 'off'}; {r['tftrain_examples_per_sec']:,.0f} / "
            f"{r['xla_auto_examples_per_sec']:,.0f} vs {r['plain_examples_per_sec']:,.0f} ex/s; "
            f"{r['steps_per_execution']} steps per call)"))
        figures.append((
            f"plain `model.fit` at tftrain's steps per call / at Keras' default of 1; tftrain / "
            f"plain at the same steps per call, {r['model']}, mirrored over 2 virtual CPUs",
            f"{r['plain_same_calls_over_plain']:.3f}; {r['tftrain_over_plain_same_calls']:.3f} "
            f"(rounds {r['tftrain_over_plain_same_calls_spread'][0]:.3f}-"
            f"{r['tftrain_over_plain_same_calls_spread'][1]:.3f}; {r['steps_per_execution']} "
            f"steps per call; batches fed from the {r['feed']}, input waits "
            f"{r['input_wait'] or 0:.1%}; CPU: {record.cpu_features()})"))
    for r in out.get("precision", []):
        figures.append((f"mixed_bfloat16 / float32 and mixed_float16 / float32 throughput, "
                        f"{r['model']}",
                        f"{r['bfloat16_over_float32']:.2f} / {r['float16_over_float32']:.2f}"))
    record.rows(figures)


if __name__ == "__main__":
    main()
