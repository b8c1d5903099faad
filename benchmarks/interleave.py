"""Interleaved throughput measurement shared by the benchmarks.

Each round times one epoch of training steps of every side, in ABBA order; figures are
medians over rounds of per-round ratios, so noise that hits both sides cancels.

Python's garbage collector is kept out of the timed steps on every side alike: a full
collection scans every object of its process, and in these long-lived benchmark processes
(three models built and traced, each round's `fit` adding its objects) one took 0.5-2 s,
about every 30 s, in either process (11 and 10 of them over a 330-s run of
`overhead.py --models ResNet`): a pause landing in one side's 2-s epoch at random, worth
25-100% of it. Each timed epoch starts after a collection, with automatic collection off
until it ends.
"""
import gc
import statistics
import tempfile
import time

import tftrain  # noqa: F401
from tftrain.training import callbacks as cb
from tftrain import data
from tftrain.data import feed
from tftrain.runtime.strategy import local_devices
from tftrain.training import epoch_logs
from tftrain.training.input_wait import InputWait
from tftrain.optim import optimizers
from tftrain.runtime import precision
from tftrain.training import train_step
from tftrain.training.losses import build_loss
from tftrain.training import xla
from tftrain.core.keras import keras
from tftrain.models import build_model

import tensorflow as tf


def build_side(cfg, source, plan, strat, tftrain_side: bool, policy="float32",
               steps_per_execution=1, jit_compile=False, steps=60):
    """A compiled model and its (dataset, callbacks) as tftrain or plain Keras would run it.
    tftrain's side takes `steps_per_execution` (`"auto"`: sized by `ExecutionSizer` as a
    run does) and `jit_compile` (`"auto"`: decided by `tftrain.training.xla` as a run does; the
    decision is printed). `steps`: the steps of each timed epoch (auto sizing leaves at
    least five calls in it, so that the time from the first call's end is measured)."""
    precision.apply_policy(policy)
    keras.utils.set_random_seed(0)
    auto = steps_per_execution == "auto"
    # as a run's stage has it: loss scaling in the step where the optimizer scales
    numerics = precision.Precision.for_strategy(policy=policy, config=cfg.precision,
                                                distribute=cfg.distribute, strategy=strat)
    with strat.scope():
        base = precision.float32_outputs(build_model(cfg.model, source.spec))
        model = (train_step.TrainModel.wrap(base, plan.accumulation,
                                            cfg.distribute.all_reduce_dtype, precision=numerics)
                 if tftrain_side else base)
        opt = optimizers.build_optimizer(cfg.train.optimizer, cfg.train.optimizer.learning_rate)
        if tftrain_side:        # compiled as a run's stage compiles it (`Stage.compile`)
            model.resizable_calls = auto
            model.log_local_metrics()
            model.compile_step(numerics.wrap_optimizer(opt), build_loss(cfg.train.loss),
                               ["accuracy"], 1 if auto else steps_per_execution)
        else:
            model.compile(precision.wrap_optimizer(opt, policy, cfg.precision),
                          build_loss(cfg.train.loss), metrics=["accuracy"],
                          steps_per_execution=steps_per_execution)
    if tftrain_side:
        if jit_compile is not False:
            batch = next(iter(data.train_dataset(source, plan, cfg.data, 0, ops=[])))
            decision = xla.decide(jit_compile, model, strat, batch)
            model.jit_compile_gradients = decision.compiled
            print(f"  XLA: {decision.reason}", flush=True)
        ds = training_input(model, cfg, source, plan, strat)
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                                             tempfile.mkdtemp(), 1)
        callbacks = [epoch_logs.GlobalMetrics(), epoch_logs.Throughput(plan.global_batch),
                     InputWait(),
                     *([epoch_logs.ExecutionSizer(steps, most=max(1, steps // 6))] if auto else []),
                     epoch_logs.LearningRateLogger(), cb.Checkpointer(manager, 10**9, steps)]
    else:
        ds = (source.calibration(source.num_train).cache().shuffle(source.num_train, seed=0).repeat()
              .batch(plan.global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
        callbacks = []
    return model, ds, callbacks


def training_input(model, cfg, source, plan, strat):
    """What a run trains `model` on: the device feed where the run's plan chooses it
    (`data.feed`), else the host pipeline."""
    devices = local_devices(strat)
    if feed.choose(source, cfg.data, None, len(devices)).device:
        fed = feed.DeviceFeed(source, plan, cfg.data, cfg.run.seed, devices=devices, strategy=strat)
        model.feed_from(fed)
        return fed.stand_in()
    return data.distribute(strat, source, plan, cfg.data, cfg.run.seed)


class StepTimer(keras.callbacks.Callback):
    """Times training steps only (from the end of the first step to the end of the last),
    so fit's set-up and tear-down (iterator creation, end-of-fit checkpoint) are left out
    on both sides alike."""

    _supports_tf_logs = True

    def on_epoch_begin(self, epoch, logs=None):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((batch, time.perf_counter()))   # several steps per call: the last


def epoch_rate(side, steps, global_batch, epoch):
    if isinstance(side, RemoteSide):
        return side.epoch_rate(steps, epoch)
    model, ds, callbacks = side
    timer = StepTimer()
    gc.collect()               # (not in the timed steps: see the module's docstring)
    gc.disable()
    try:
        model.fit(ds, epochs=epoch + 1, initial_epoch=epoch, steps_per_epoch=steps,
                  callbacks=[*callbacks, timer], verbose=0)
    finally:
        gc.enable()
    (first, began), (last, ended) = timer.ends[0], timer.ends[-1]
    return (last - first) * global_batch / (ended - began)


def interleaved(sides, rounds, steps, global_batch, seconds: float = 0.0):
    """Examples/s of each side per round; `global_batch` is one number or one per side.
    `seconds`: lengthen each timed epoch (in steps of 10) until the slowest side's lasts
    about this long (a 60 ms epoch of a small model is mostly jitter)."""
    batches = global_batch if isinstance(global_batch, (list, tuple)) else [global_batch] * len(sides)
    warm = [epoch_rate(side, steps, batch, 0)       # warm up: trace and compile
            for side, batch in zip(sides, batches)]
    if seconds:
        slowest = min(rate / batch for rate, batch in zip(warm, batches))   # steps per second
        steps = max(steps, 10 * round(seconds * slowest / 10))
    rates = [[] for _ in sides]
    for r in range(rounds):
        order = list(range(len(sides)))
        for i in order if r % 2 == 0 else order[::-1]:   # ABBA: position effects cancel
            rates[i].append(epoch_rate(sides[i], steps, batches[i], r + 1))
    return rates


def median_ratio(a, b) -> float:
    """Median over rounds of a[r] / b[r]."""
    return statistics.median(x / y for x, y in zip(a, b))


def ratio_spread(a, b) -> tuple[float, float]:
    """Lowest and highest per-round ratio a[r] / b[r]."""
    ratios = [x / y for x, y in zip(a, b)]
    return min(ratios), max(ratios)


def input_wait(side) -> float | None:
    """The tftrain side's input wait (its `InputWait` callback's steady share)."""
    waits = [c for c in side[2] if isinstance(c, InputWait)]
    return waits[0].fraction() if waits else None


class RemoteSide:
    """A side that lives in another process (`serve`): its epochs are timed there, when
    asked, while this process waits (one process runs at a time, as in one process)."""

    def __init__(self, server, key: str):
        self.server, self.key = server, key

    def epoch_rate(self, steps: int, epoch: int) -> float:
        return float(self.server.ask(f"rate {self.key} {steps} {epoch}"))


class Server:
    """A benchmark process of its own, serving sides one command line at a time (its
    answers are the lines that start with `@@ `)."""

    def __init__(self, command: list[str]):
        import subprocess
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        for out in self.proc.stdout:
            if out.startswith("@@ "):
                return out[3:].strip()
        raise RuntimeError(f"the side server ended (exit {self.proc.wait()}) on: {line}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def serve(build) -> None:
    """Answer `side KEY ARGS...` (`build(*ARGS)` makes (side, global batch)) and `rate KEY
    STEPS EPOCH` (examples/s of that epoch) lines from stdin until it closes."""
    import sys
    sides = {}
    for line in sys.stdin:
        verb, key, *args = line.split()
        if verb == "side":
            sides[key] = build(*args)
            print("@@ ok", flush=True)
        elif verb == "rate":
            side, batch = sides[key]
            print(f"@@ {epoch_rate(side, int(args[0]), batch, int(args[1]))}", flush=True)
