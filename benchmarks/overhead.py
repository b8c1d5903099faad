"""tftrain's training throughput against plain tf_keras `model.fit`, interleaved.

Same model (quickstart CNN), same data (digits), same strategy (mirrored over 2 virtual
CPUs), same optimizer. Each round times one epoch of training steps on each side (ABBA
order); the figure is the median over rounds of the per-round ratio, so machine noise
that hits both sides cancels.
Also prints bfloat16/float32 and float16/float32 throughput of tftrain's step.

    python benchmarks/overhead.py [--rounds 7] [--steps 60]
"""
import argparse
import os
import statistics
import tempfile
import time

import tftrain  # noqa: F401
from tftrain import callbacks as cb
from tftrain import data, optim, precision, strategy, train_step
from tftrain._keras import keras
from tftrain.config import load_config
from tftrain.models import build_model

import tensorflow as tf


def make(cfg, source, plan, strat, tftrain_side: bool, policy="float32"):
    """A compiled model and its (dataset, callbacks) as tftrain or plain Keras would run it."""
    precision.apply_policy(policy)
    keras.utils.set_random_seed(0)
    with strat.scope():
        base = precision.float32_outputs(build_model(cfg.model, source.spec))
        model = train_step.TrainModel.wrap(base) if tftrain_side else base
        opt = optim.build_optimizer(cfg.train.optimizer, cfg.train.optimizer.learning_rate)
        model.compile(precision.wrap_optimizer(opt, policy, cfg.precision),
                      train_step.build_loss(cfg.train.loss), metrics=["accuracy"])
    if tftrain_side:
        ds = data.train_dataset(source, plan, cfg.data, cfg.run.seed)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                                             tempfile.mkdtemp(), 1)
        callbacks = [cb.Checkpointer(manager, 10**9, 10**9), cb.Throughput(plan.global_batch),
                     cb.LearningRateLogger()]
    else:
        ds = (source.train.cache().shuffle(source.num_train, seed=0).repeat()
              .batch(plan.global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
        callbacks = []
    return model, ds, callbacks


class StepTimer(keras.callbacks.Callback):
    """Times training steps only (from the end of the first step to the end of the last),
    so fit's set-up and tear-down (iterator creation, end-of-fit checkpoint) are left out
    on both sides alike."""

    _supports_tf_logs = True

    def on_epoch_begin(self, epoch, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def epoch_rate(side, steps, global_batch, epoch):
    model, ds, callbacks = side
    timer = StepTimer()
    model.fit(ds, epochs=epoch + 1, initial_epoch=epoch, steps_per_epoch=steps,
              callbacks=[*callbacks, timer], verbose=0)
    return (len(timer.ends) - 1) * global_batch / (timer.ends[-1] - timer.ends[0])


def interleaved(sides, rounds, steps, global_batch):
    for side in sides:                       # warm up: trace and compile
        epoch_rate(side, steps, global_batch, 0)
    rates = [[] for _ in sides]
    for r in range(rounds):
        order = list(range(len(sides)))
        for i in order if r % 2 == 0 else order[::-1]:   # ABBA: position effects cancel
            rates[i].append(epoch_rate(sides[i], steps, global_batch, r + 1))
    return rates


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

    ours, plain = interleaved([make(cfg, source, plan, strat, True),
                               make(cfg, source, plan, strat, False)],
                              args.rounds, args.steps, plan.global_batch)
    ratio = statistics.median(a / b for a, b in zip(ours, plain))
    print(f"tftrain / plain model.fit throughput: {ratio:.3f} (median of {args.rounds} "
          f"interleaved rounds; tftrain {statistics.median(ours):.0f} ex/s, plain "
          f"{statistics.median(plain):.0f} ex/s)")

    # Precision ratios on the quickstart CNN and on a compute-bound CNN (32x32x3 inputs).
    larger = load_config("configs/quickstart.yaml", [
        "data.name=synthetic", "data.params={shape: [32, 32, 3], num_examples: 4096}",
        "model.params={filters: [64, 128], dense: [256]}"])
    for name, c in (("quickstart CNN", cfg), ("CNN 64-128 on 32x32x3", larger)):
        src = data.load_source(c.data, c.run.seed)
        sides = [make(c, src, plan, strat, True, p)
                 for p in ("float32", "mixed_bfloat16", "mixed_float16")]
        steps = min(args.steps if c is cfg else 20, plan.steps_per_epoch(src.num_train))
        f32, bf16, f16 = interleaved(sides, args.rounds, steps, plan.global_batch)
        bf = statistics.median(a / b for a, b in zip(bf16, f32))
        fp = statistics.median(a / b for a, b in zip(f16, f32))
        print(f"{name}: mixed_bfloat16 / float32 throughput {bf:.2f}; "
              f"mixed_float16 / float32 throughput {fp:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
