"""tftrain's input alone (no model) against the `tf.data` pipeline Keras or the tf.data
guide builds from the same data, and against the rate a training step consumes batches.

1. Arrays in memory (digits, batches of 64): tftrain's device feed (each batch gathered by
   the train function: `data.feed: device`, what a run of in-memory data uses), tftrain's
   host pipeline (`data.feed: host`) and the pipeline `model.fit(x, y)` builds
   (tf_keras' `TensorLikeDataAdapter`: shuffled index batches, one gather each).
2. An image folder (2,000 JPEGs 96x96 decoded and resized to 64x64, batches of 128):
   tftrain's streaming pipeline against `image_dataset_from_directory` + map, batch and
   prefetch.
3. TFRecords (100,000 records of 16 floats in 16 files, batches of 128): tftrain's
   `tfrecord` source against `TFRecordDataset` interleaved, parsed, shuffled, batched and
   prefetched as the tf.data guide writes it.

Every side is consumed by the same loop inside a `tf.function` (as a train function takes
batches, without a step); sides are timed in interleaved rounds, figures are medians of
per-round ratios. The step's rate: the quickstart CNN's training step on the device feed
(2 virtual CPUs, mirrored), in examples per second.

    python benchmarks/input_alone.py [--rounds 7]
"""
import argparse
import statistics
import sys
import time


import tftrain  # noqa: F401
import record
import tensorflow as tf

from tftrain.config import load_config
from tftrain.data import BatchPlan, feed, load_source, train_dataset
from tftrain.runtime import strategy as strategies
from interleave import build_side, epoch_rate
from input import WORK, make_images, make_records  # noqa: F401

SECONDS = 1.0


def consumer(batches: int):
    """A function taking `batches` batches from an iterator, as a train function does."""
    @tf.function
    def take(iterator):
        def body(i):
            data = next(iterator)
            with tf.control_dependencies(tf.nest.flatten(data)):
                return i + 1
        return tf.while_loop(lambda i: i < batches, body, [tf.constant(0)])
    return take


def pipeline_rate(dataset, batch: int):
    """Examples/s of a dataset's iterator over about SECONDS (one iterator alive at a time:
    an idle one would fill its buffers in the background and flatter itself)."""
    iterator = iter(dataset)
    take = consumer(20)
    take(iterator)                               # trace, start the threads
    n, began = 0, time.perf_counter()
    while time.perf_counter() - began < SECONDS:
        take(iterator)
        n += 20
    return n * batch / (time.perf_counter() - began)


def feed_rate(fed, strat, batch: int):
    """Examples/s of the device feed's gathers, in the train function's loop."""
    @tf.function
    def take():
        def body(i):
            e, u = fed.indices()
            out = strat.run(fed.batch, args=(e, u, fed.data))
            with tf.control_dependencies(tf.nest.flatten(strat.experimental_local_results(out))):
                return i + 1
        return tf.while_loop(lambda i: i < 20, body, [tf.constant(0)])
    take()
    n, began = 0, time.perf_counter()
    while time.perf_counter() - began < SECONDS:
        take()
        n += 20
    return n * batch / (time.perf_counter() - began)


def interleaved(sides: dict, rounds: int) -> dict:
    rates = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rates[name].append(sides[name]())
    return rates


def ratio(rates, a, b) -> str:
    values = [x / y for x, y in zip(rates[a], rates[b])]
    return f"{statistics.median(values):.2f} (rounds {min(values):.2f}-{max(values):.2f})"


def in_memory(rounds: int):
    from tf_keras.src.engine import data_adapter
    cfg = load_config("configs/quickstart.yaml", ["distribute.virtual_cpus=2"])
    source = load_source(cfg.data, 0)
    x, y = (t.numpy() for t in source.load(tf.range(source.num_train)))
    one = tf.distribute.get_strategy()
    device = strategies.local_devices(one)
    batch = 64
    plan = BatchPlan(batch, 1, 1)
    fed = feed.DeviceFeed(source, plan, cfg.data, 0, devices=device, strategy=one)
    keras_side = data_adapter.TensorLikeDataAdapter(x, y, batch_size=batch, shuffle=True,
                                                    epochs=10**6).get_dataset()
    sides = {"feed": lambda: feed_rate(fed, one, batch),
             "host": lambda: pipeline_rate(train_dataset(source, plan, cfg.data, 0), batch),
             "keras": lambda: pipeline_rate(keras_side, batch)}
    return interleaved(sides, rounds)


def image_folder(rounds: int):
    from tftrain.core.keras import keras
    root = make_images(2_000)
    cfg = load_config(None, ["data.name=image_folder", f"data.params={{path: {root}, "
                             "image_size: [64, 64]}", "data.validation_fraction=0",
                             "data.cache=none"])
    source = load_source(cfg.data, 0)

    def guide():
        ds = keras.utils.image_dataset_from_directory(str(root), image_size=(64, 64),
                                                      batch_size=None, shuffle=True, seed=0)
        return (ds.repeat().map(lambda a, b: (a / 255.0, b), num_parallel_calls=tf.data.AUTOTUNE)
                .batch(128, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    plan = BatchPlan(128, 1, 1)
    sides = {"tftrain": lambda: pipeline_rate(train_dataset(source, plan, cfg.data, 0), 128),
             "guide": lambda: pipeline_rate(guide(), 128)}
    return interleaved(sides, rounds)


def records(rounds: int):
    pattern = make_records(100_000, 16)
    cfg = load_config(None, ["data.name=tfrecord", f"data.params={{files: '{pattern}', shape: "
                             "[16], num_classes: 10, num_examples: 100000}",
                             "data.validation_fraction=0"])
    source = load_source(cfg.data, 0)
    spec = {"x": tf.io.FixedLenFeature([16], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(r):
        f = tf.io.parse_single_example(r, spec)
        return f["x"], tf.cast(f["y"], tf.int32)

    def guide():
        files = tf.data.Dataset.list_files(pattern, shuffle=True, seed=0)
        return (files.interleave(tf.data.TFRecordDataset, cycle_length=4,
                                 num_parallel_calls=tf.data.AUTOTUNE)
                .map(parse, num_parallel_calls=tf.data.AUTOTUNE).shuffle(10_000, seed=0)
                .repeat().batch(128, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    plan = BatchPlan(128, 1, 1)
    sides = {"tftrain": lambda: pipeline_rate(train_dataset(source, plan, cfg.data, 0), 128),
             "guide": lambda: pipeline_rate(guide(), 128)}
    return interleaved(sides, rounds)


def step_rate(rounds: int) -> float:
    """Examples/s of the quickstart CNN's training step (mirrored over 2 virtual CPUs)."""
    cfg = load_config("configs/quickstart.yaml")
    strat = strategies.build_strategy(cfg)
    source = load_source(cfg.data, cfg.run.seed)
    from tftrain.data import plan_batches
    plan = plan_batches(cfg, strat.num_replicas_in_sync)
    side = build_side(cfg, source, plan, strat, True, steps_per_execution=10)
    epoch_rate(side, 60, plan.global_batch, 0)
    return statistics.median(epoch_rate(side, 200, plan.global_batch, r + 1) for r in range(rounds))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    strategies.configure_devices(load_config("configs/quickstart.yaml"))
    memory = in_memory(args.rounds)
    step = step_rate(3)
    images, recs = image_folder(args.rounds), records(args.rounds)
    med = {k: statistics.median(v) for k, v in memory.items()}
    lines = [
        ("input alone, digits in memory, batches of 64: tftrain's device feed / the pipeline "
         "`model.fit(x, y)` builds; tftrain's host pipeline / it",
         f"{ratio(memory, 'feed', 'keras')}; {ratio(memory, 'host', 'keras')} (medians "
         f"{med['feed']:,.0f} / {med['host']:,.0f} / {med['keras']:,.0f} examples/s; the "
         f"quickstart CNN's mirrored step takes {step:,.0f})"),
        ("input alone, 2,000 JPEGs 96×96 → 64×64, batches of 128: tftrain's streaming "
         "pipeline / `image_dataset_from_directory` + map, batch, prefetch",
         f"{ratio(images, 'tftrain', 'guide')} (medians {statistics.median(images['tftrain']):,.0f}"
         f" / {statistics.median(images['guide']):,.0f} examples/s)"),
        ("input alone, 100,000 TFRecords of 16 floats in 16 files, batches of 128: tftrain's "
         "`tfrecord` source / the tf.data guide's interleave, parse, shuffle, batch, prefetch",
         f"{ratio(recs, 'tftrain', 'guide')} (medians {statistics.median(recs['tftrain']):,.0f}"
         f" / {statistics.median(recs['guide']):,.0f} examples/s)")]
    for name, value in lines:
        print(f"{name}: {value}", flush=True)
    record.rows([(name, f"{value}; CPU: {record.cpu_features()}") for name, value in lines])
    return 0


if __name__ == "__main__":
    sys.exit(main())
