"""Gradient accumulation: throughput, peak memory and bytes reduced, measured in one run.

1. Throughput per example of (N=4, micro-batch 32) over (N=1, batch 128) per replica,
   CNNs on synthetic images, mirrored over 2 virtual CPUs, interleaved rounds; with the
   ratio (N=1, batch 32) / (N=1, batch 128) that the smaller micro-batch costs by itself,
   and the ceiling: bare gradients of 4 micro-batches over those of one large batch.
2. Peak memory of a ResNet at 64x64 on one device with (micro-batch 16, N=8) over
   (batch 128, N=1), read from TensorFlow's allocator (`get_memory_info`), medians of
   alternating measurements.
3. Bytes all-reduced per update with `all_reduce_dtype: float16` over float32, counted
   by a reduction that counts what it executes.

    python benchmarks/accumulation.py [--rounds 7] [--memory-rounds 5]
"""
import argparse
import os

# the CPU allocator keeps statistics (peak memory) only as a BFC allocator: before TF loads
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
import statistics
import time

import numpy as np

import tftrain  # noqa: F401
from tftrain import data
from tftrain.runtime import precision
from tftrain.runtime import strategy
from tftrain.training import train_step
from tftrain.training.losses import build_loss
from tftrain.core.keras import keras
from tftrain.config import load_config
from tftrain.models import build_model
import record
from interleave import build_side, interleaved, median_ratio

import tensorflow as tf

BASE = ["distribute.virtual_cpus=2", "distribute.strategy=mirrored", "precision.policy=float32",
        "data.name=synthetic", "data.params={shape: [16, 16, 1], num_examples: 8192}",
        "model.params={filters: [32, 64], dense: [128]}", "train.optimizer.name=sgd"]


# name: (settings, steps timed per round: a few seconds of training)
MODELS = {
    "CNN 32-64 on 16x16x1": ([], 80),
    "CNN 64-128 on 32x32x3": (["data.params={shape: [32, 32, 3], num_examples: 8192}",
                               "model.params={filters: [64, 128], dense: [256]}"], 20),
}


def throughput(rounds: int) -> list[tuple[str, str]]:
    """(N=4, micro 32) and (N=1, batch 32) against (N=1, batch 128) per replica: the
    second ratio is what the smaller micro-batch alone costs, without accumulation. Steps
    per call are sized as a run sizes them (`train.steps_per_execution: auto`)."""
    figures = []
    for name, (extra, steps) in MODELS.items():
        cfgs = [load_config(None, BASE + extra + sets) for sets in (
            ["data.per_replica_batch_size=32", "train.accumulation_steps=4"],
            ["data.per_replica_batch_size=128"], ["data.per_replica_batch_size=32"])]
        strat = strategy.build_strategy(cfgs[0])
        source = data.load_source(cfgs[0].data, 0)
        plans = [data.plan_batches(c, strat.num_replicas_in_sync) for c in cfgs]
        sides = [build_side(c, source, p, strat, True, steps_per_execution="auto", steps=steps)
                 for c, p in zip(cfgs, plans)]
        accumulated, large, small = interleaved(sides, rounds, steps,
                                                [p.global_batch for p in plans])
        figures.append((
            f"accumulation: throughput per example, (N=4, micro 32) / (N=1, batch 128), {name}, "
            "mirrored over 2 virtual CPUs; the micro-batch size alone, (N=1, batch 32) / "
            "(N=1, batch 128)",
            f"{median_ratio(accumulated, large):.3f} ({statistics.median(accumulated):,.0f} vs "
            f"{statistics.median(large):,.0f} ex/s); {median_ratio(small, large):.3f} "
            f"[median of {rounds} rounds]"))
    return figures


def gradient_ceiling(rounds: int, calls: int = 20) -> list[tuple[str, str]]:
    """The most accumulation could give on this machine: per-example throughput of the
    bare gradients of 4 micro-batches of 32 (unrolled, summed; no loop, loss tracking,
    metrics or update) over the gradients of one batch of 128, per replica, interleaved."""
    figures = []
    strat = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=keras.losses.Reduction.NONE)
    for name, (extra, _) in MODELS.items():
        cfg = load_config(None, BASE + extra)
        source = data.load_source(cfg.data, 0)
        with strat.scope():
            model = build_model(cfg.model, source.spec)
        x = tf.random.uniform([256, *source.spec.shape])
        y = tf.random.uniform([256], 0, 10, tf.int32)
        batches = strat.experimental_distribute_values_from_function(
            lambda ctx: (x[ctx.replica_id_in_sync_group * 128:][:128],
                         y[ctx.replica_id_in_sync_group * 128:][:128]))

        def sides(n, size=128):
            def replica(xs, ys):
                total = None
                for i in range(n):
                    with tf.GradientTape() as tape:
                        part = slice(i * size // n, (i + 1) * size // n)
                        loss = tf.reduce_mean(loss_fn(ys[part], model(xs[part], training=True))) / n
                    grads = tape.gradient(loss, model.trainable_variables)
                    total = grads if total is None else [a + b for a, b in zip(total, grads)]
                return total

            @tf.function
            def run(xs, ys):
                return strat.run(replica, (xs, ys))
            return run

        def rate(fn):
            tf.nest.map_structure(lambda t: t.numpy(), strat.experimental_local_results(
                fn(*batches)))
            began = time.perf_counter()
            for _ in range(calls):
                out = fn(*batches)
            strat.experimental_local_results(out)[0][0].numpy()
            return calls * 256 / (time.perf_counter() - began)

        micro, large = sides(4), sides(1)
        rate(micro), rate(large)                               # trace
        rates = {"micro": [], "large": []}
        for r in range(rounds):
            order = [("micro", micro), ("large", large)]
            for key, fn in order if r % 2 == 0 else order[::-1]:
                rates[key].append(rate(fn))
        figures.append((f"accumulation's ceiling: bare gradients of 4 × 32 / 1 × 128 per "
                        f"replica, {name}, mirrored over 2 virtual CPUs",
                        f"{median_ratio(rates['micro'], rates['large']):.3f} "
                        f"[median of {rounds} rounds]"))
    return figures


def peak_memory(micro: int, n: int, steps: int = 2) -> int:
    """Peak allocator bytes while training a ResNet at 64x64, one device, `steps` updates."""
    precision.apply_policy("float32")
    spec = data.InputSpec((64, 64, 3), "float32", 10)
    with tf.device("/cpu:0"):
        model = train_step.TrainModel.wrap(build_model(
            load_config(None, ["model.name=resnet", "model.params={depth: 8, width: 16}"]).model,
            spec), n)
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                      build_loss("sparse_categorical_crossentropy"))
        x = np.random.rand(micro * n * steps, 64, 64, 3).astype(np.float32)
        y = np.random.randint(0, 10, len(x))
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro * n)
        model.fit(ds.take(1), verbose=0)                  # trace and build outside the window
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.fit(ds, verbose=0)
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def reduced_bytes(dtype: str) -> float:
    """Bytes each replica sends per update, counted as the reductions run."""
    counter = strategy.CountingReduction()
    strat = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counter)
    cfg = load_config(None, BASE + [f"distribute.all_reduce_dtype={dtype}",
                                    "train.accumulation_steps=4", "data.per_replica_batch_size=16"])
    source = data.load_source(cfg.data, 0)
    plan = data.plan_batches(cfg, 2)
    model, ds, _ = build_side(cfg, source, plan, strat, True)
    model.fit(ds, steps_per_epoch=5, verbose=0)
    return int(counter.bytes.numpy()) / int(counter.calls.numpy())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--memory-rounds", type=int, default=5)
    args = p.parse_args()
    strategy.configure_devices(load_config(None, BASE).distribute)
    record.rows(throughput(args.rounds))        # each part is reported as it is measured
    record.rows(gradient_ceiling(args.rounds))
    # The allocator's peak moves from one measurement to the next (which free chunk a
    # tensor gets, what runs beside what): alternate the sides, take medians.
    peaks = [(peak_memory(16, 8), peak_memory(128, 1)) for _ in range(args.memory_rounds)]
    accumulated, large = (statistics.median(p) for p in zip(*peaks))
    record.rows([("accumulation: peak memory, ResNet-8 at 64×64, (micro 16, N=8) / (batch "
                    "128, N=1)", f"{accumulated / large:.3f} ({accumulated / 2**20:.0f} vs "
                                 f"{large / 2**20:.0f} MiB; medians of {len(peaks)}, micro "
                                 f"{min(a for a, _ in peaks) / 2**20:.0f}–"
                                 f"{max(a for a, _ in peaks) / 2**20:.0f} MiB)")])
    f16, f32 = reduced_bytes("float16"), reduced_bytes("float32")
    record.rows([("bytes all-reduced per update, `all_reduce_dtype: float16` / float32",
                    f"{f16 / f32:.3f} ({f16:.0f} vs {f32:.0f} bytes per replica, one reduction "
                    "per update)")])


if __name__ == "__main__":
    main()
