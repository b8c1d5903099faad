"""Pipelined model parallelism: throughput for M = 1, 2, 4, 8 micro-batches over 2 stages.

Two logical CPU devices with one intra-op thread each (and two inter-op threads, so the
two stages can run at once). The same MLP is placed over both devices; M = 1 is
unpipelined placement. The measured bubble is the fraction of device time left idle:
1 - T_serial / (K x T_step), where T_serial is one device running the whole model alone;
it is compared with GPipe's (K-1)/(M+K-1). Sides are timed in interleaved rounds;
figures are medians of per-round ratios.

    python benchmarks/pipeline.py [--rounds 5]
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

import numpy as np  # noqa: E402

import tftrain  # noqa: E402,F401
import record  # noqa: E402
from tftrain.runtime.parallelism import Placed  # noqa: E402
from tftrain.runtime import placement
from tftrain.runtime import precision
from tftrain.training import train_step
from tftrain.training.losses import build_loss
from tftrain.core.keras import keras  # noqa: E402
from tftrain.config import load_config  # noqa: E402
from tftrain.data import InputSpec  # noqa: E402
from tftrain.models import MODELS  # noqa: E402
from tftrain.runtime.strategy import configure_devices  # noqa: E402

SPEC = InputSpec((32, 32, 1), "float32", 10)
HIDDEN = [1024] * 6
BATCH, STEPS = 256, 6


def build(micro: int | None):
    """micro=None: the whole model on /cpu:0 (the serial reference)."""
    keras.utils.set_random_seed(0)
    make = lambda: precision.float32_outputs(MODELS.get("mlp")(SPEC, hidden=HIDDEN))  # noqa: E731
    if micro is None:
        with tf.device("/cpu:0"):
            net = make()
        model = train_step.TrainModel.wrap(net)
    else:
        cfg = load_config(None, ["model.placement={devices: ['/cpu:0', '/cpu:1'], balance: flops, "
                                 f"microbatches: {micro}}}"]).model.placement
        parallel = Placed(placement=placement.plan(make(), cfg))
        net = parallel.build(make)
        model = train_step.TrainModel.wrap(net, micro, parallel=parallel)
    model.compile(keras.optimizers.SGD(0.01), build_loss("sparse_categorical_crossentropy"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, *SPEC.shape)).astype(np.float32)
    y = rng.integers(0, 10, len(x))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache().repeat()
    model.fit(ds, steps_per_epoch=2, verbose=0)             # trace
    return model, ds


def step_time(side) -> float:
    import time
    model, ds = side
    start = time.perf_counter()
    model.fit(ds, steps_per_epoch=STEPS, verbose=0)
    return (time.perf_counter() - start) / STEPS


def trace(side, out: str) -> str:
    """Profile one step of `side` (TensorBoard's trace under /tmp), draw its ops per
    compute thread by stage and micro-batch (`trace_svg`), and say how busy the threads
    were."""
    import tempfile
    import trace_svg
    model, ds = side
    logdir = tempfile.mkdtemp(prefix="tftrain-pipeline-trace-")
    tf.profiler.experimental.start(logdir)
    model.fit(ds, steps_per_epoch=1, verbose=0)
    tf.profiler.experimental.stop()
    stages = {layer.name: int(layer._tftrain_device.rsplit(":", 1)[-1])
              for layer in model.layers if getattr(layer, "_tftrain_device", None)}
    shares = trace_svg.draw(logdir, stages, out, "one training step, MLP 6x1024 placed over "
                            "/cpu:0 and /cpu:1 (2 stages), M = 4 micro-batches; rows: the "
                            "two compute threads")
    return (f"trace ({logdir}, drawn in {out}): both threads busy {shares['both']:.1f} ms, one "
            f"{shares['one']:.1f} ms, none {shares['idle']:.1f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trace", help="also write an SVG of one M = 4 step's profiler trace here")
    args = p.parse_args()
    configure_devices(load_config(None, ["distribute.virtual_cpus=2"]))
    sides = {"serial": build(None), **{m: build(m) for m in (1, 2, 4, 8)}}
    if args.trace:
        print(trace(sides[4], args.trace))
    times = {k: [] for k in sides}
    keys = list(sides)
    for r in range(args.rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            times[k].append(step_time(sides[k]))
    k_stages = 2
    print("| micro-batches M | throughput / unpipelined (M=1) | measured bubble | (K-1)/(M+K-1) |")
    print("|---|---|---|---|")
    for m in (1, 2, 4, 8):
        speed = statistics.median(a / b for a, b in zip(times[1], times[m]))
        bubble = statistics.median(1 - s / (k_stages * t) for s, t in zip(times["serial"], times[m]))
        print(f"| {m} | {speed:.2f} | {bubble:.2f} | {(k_stages - 1) / (m + k_stages - 1):.2f} |")
    serial = statistics.median(times["serial"])
    print(f"\nserial step (one device, whole model): {serial * 1e3:.1f} ms at batch {BATCH}; "
          f"{args.rounds} interleaved rounds")
    speeds = [statistics.median(a / b for a, b in zip(times[1], times[m])) for m in (2, 4, 8)]
    bubbles = [(m, statistics.median(1 - s / (k_stages * t)
                                     for s, t in zip(times["serial"], times[m])))
               for m in (1, 2, 4, 8)]
    record.rows([
        ("pipelined / unpipelined placement throughput, MLP 6×1024 over 2 virtual CPUs with "
         "one thread each, M = 2 / 4 / 8", " / ".join(f"{v:.2f}" for v in speeds)),
        ("measured bubble vs (K−1)/(M+K−1), M = 1 / 2 / 4 / 8",
         " / ".join(f"{b:.2f} vs {(k_stages - 1) / (m + k_stages - 1):.2f}" for m, b in bubbles))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
