"""tftrain's training throughput against plain tf_keras `model.fit`, interleaved.

Same model (quickstart CNN), same data (digits), same strategy (mirrored over 2 virtual
CPUs), same optimizer. Each round times one epoch of training steps on each side (ABBA
order); the figure is the median over rounds of the per-round ratio, so machine noise
that hits both sides cancels.
Also prints bfloat16/float32 and float16/float32 throughput of tftrain's step.

    python benchmarks/overhead.py [--rounds 7] [--steps 60]
"""
import argparse
import statistics

import tftrain  # noqa: F401
from tftrain import data, strategy
from tftrain.config import load_config
from interleave import build_side, interleaved, median_ratio


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    cfg = load_config("configs/quickstart.yaml")
    strategy.configure_devices(cfg)
    strat = strategy.build_strategy(cfg)
    source = data.load_source(cfg.data, cfg.run.seed)
    plan = data.plan_batches(cfg, strat.num_replicas_in_sync)

    ours, plain = interleaved([build_side(cfg, source, plan, strat, True),
                               build_side(cfg, source, plan, strat, False)],
                              args.rounds, args.steps, plan.global_batch)
    ratio = median_ratio(ours, plain)
    print(f"tftrain / plain model.fit throughput: {ratio:.3f} (median of {args.rounds} "
          f"interleaved rounds; tftrain {statistics.median(ours):.0f} ex/s, plain "
          f"{statistics.median(plain):.0f} ex/s)")

    # Precision ratios on the quickstart CNN and on a compute-bound CNN (32x32x3 inputs).
    larger = load_config("configs/quickstart.yaml", [
        "data.name=synthetic", "data.params={shape: [32, 32, 3], num_examples: 4096}",
        "model.params={filters: [64, 128], dense: [256]}"])
    for name, c in (("quickstart CNN", cfg), ("CNN 64-128 on 32x32x3", larger)):
        src = data.load_source(c.data, c.run.seed)
        sides = [build_side(c, src, plan, strat, True, p)
                 for p in ("float32", "mixed_bfloat16", "mixed_float16")]
        steps = min(args.steps if c is cfg else 20, plan.steps_per_epoch(src.num_train))
        f32, bf16, f16 = interleaved(sides, args.rounds, steps, plan.global_batch)
        bf, fp = median_ratio(bf16, f32), median_ratio(f16, f32)
        print(f"{name}: mixed_bfloat16 / float32 throughput {bf:.2f}; "
              f"mixed_float16 / float32 throughput {fp:.2f}")


if __name__ == "__main__":
    main()
