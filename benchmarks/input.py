"""Input pipeline at scale, each figure against a baseline measured in the same run.

1. Throughput: an image folder of generated JPEGs (default 20,000, 96x96) decoded,
   resized to 64x64, random-resized-cropped, flipped, normalized and batched: tftrain's
   streaming pipeline vs `image_dataset_from_directory` followed by the tf.data guide's
   practice (parallel map, batch, prefetch) doing the same work. Interleaved rounds,
   median of per-round ratios.
2. Memory: peak RSS of a process streaming one epoch of that folder with a cache budget
   4x smaller than the decoded set (so nothing is cached), against budget + 1 GiB.
3. Start-up: time to the first batch for 10,000 vs 1,000,000 TFRecord records (record
   counts from `num_examples`, and from the cached count).
4. Resume: time to the first batch when resuming at 90% vs 10% of an epoch of the
   1,000,000 records.

    python benchmarks/input.py [--images 20000] [--records 1000000] [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import tftrain  # noqa: F401
import record
import tensorflow as tf

from tftrain.config import load_config
from tftrain.data import BatchPlan, load_source, train_dataset
from tftrain.data.augment import build

WORK = Path(os.environ.get("TFTRAIN_BENCH_DIR", "/tmp/tftrain-bench"))
AUGMENT = "[{random_resized_crop: {scale: [0.25, 1.0]}}, random_flip, {normalize: {mean: 0.5, std: 0.25}}]"
BATCH = 128


def make_images(n: int) -> Path:
    root = WORK / f"jpegs-{n}"
    if (root / ".done").exists():
        return root
    rng = np.random.default_rng(0)
    for c in range(10):
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
    base = rng.integers(0, 255, (10, 12, 12, 3)).astype(np.float32)
    for i in range(n):
        c = i % 10
        img = tf.image.resize(base[c][None], (96, 96))[0] + rng.normal(0, 20, (96, 96, 3))
        data = tf.io.encode_jpeg(tf.cast(tf.clip_by_value(img, 0, 255), tf.uint8), quality=90)
        tf.io.write_file(str(root / f"class_{c}" / f"{i:07d}.jpg"), data)
    (root / ".done").write_text("")
    return root


def make_records(n: int, shards: int = 64) -> str:
    root = WORK / f"records-{n}"
    if not (root / ".done").exists():
        root.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1000, 16)).astype(np.float32)
        for s in range(shards):
            with tf.io.TFRecordWriter(str(root / f"part-{s:03d}.tfrecord")) as w:
                for i in range(s, n, shards):
                    w.write(tf.train.Example(features=tf.train.Features(feature={
                        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i % 1000])),
                        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 10]))}))
                        .SerializeToString())
        (root / ".done").write_text("")
    return f"{root}/part-*.tfrecord"


def image_cfg(root: Path, *sets):
    return load_config(None, ["data.name=image_folder",
                              f"data.params={{path: {root}, image_size: [64, 64]}}",
                              "data.validation_fraction=0", "data.cache=none",
                              f"data.augment={AUGMENT}", *sets])


def ours(root: Path):
    cfg = image_cfg(root)
    source = load_source(cfg.data, 0)
    return train_dataset(source, BatchPlan(BATCH, 1, 1), cfg.data, 0)


def baseline(root: Path):
    from tftrain.core.keras import keras
    ops = build(load_config(None, [f"data.augment={AUGMENT}"]).data.augment)
    ds = keras.utils.image_dataset_from_directory(
        str(root), image_size=(64, 64), batch_size=None, shuffle=True, seed=0)
    gen = tf.random.Generator.from_seed(0)

    def augment(x, y):
        x = x / 255.0
        seed = gen.make_seeds(1)[:, 0]
        for i, op in enumerate(ops):
            x = op.fn(x, tf.random.experimental.stateless_fold_in(seed, i))
        return x, y
    return (ds.repeat().map(augment, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(BATCH, drop_remainder=True).prefetch(tf.data.AUTOTUNE))


def rate(dataset, batches: int) -> float:
    """Examples/s of a fresh iterator after 5 warm-up batches (one iterator alive at a
    time: an idle one would fill its buffers in the background and flatter itself)."""
    iterator = iter(dataset)
    for _ in range(5):
        next(iterator)
    began = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    elapsed = time.perf_counter() - began
    del iterator
    return batches * BATCH / elapsed


def throughput(root: Path, rounds: int, batches: int):
    sides = [ours(root), baseline(root)]
    results = [[], []]
    for r in range(rounds):
        for i in ([0, 1] if r % 2 == 0 else [1, 0]):
            results[i].append(rate(sides[i], batches))
    ratio = statistics.median(a / b for a, b in zip(*results))
    return ratio, statistics.median(results[0]), statistics.median(results[1])


STREAM = """
import resource, sys
import tftrain
from tftrain.config import load_config
from tftrain.data import BatchPlan, cache_choice, cached, load_source, train_dataset
cfg = load_config(None, sys.argv[1:])
source = load_source(cfg.data, 0)
choice = cache_choice(source, cfg.data)
source = cached(source, cfg.data)
n = 0
for x, y in train_dataset(source, BatchPlan(128, 1, 1), cfg.data, 0).take(source.num_train // 128):
    n += int(x.shape[0])
print(choice, n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(root: Path, n: int):
    decoded = n * 64 * 64 * 3 * 4
    budget = decoded // 4
    sets = [s for s in [f"data.cache_budget={budget}"]]
    cfg_sets = ["data.name=image_folder", f"data.params={{path: {root}, image_size: [64, 64]}}",
                "data.validation_fraction=0", "data.cache=auto", f"data.augment={AUGMENT}", *sets]
    out = subprocess.run([sys.executable, "-c", STREAM, *cfg_sets], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    choice, seen, rss = out.stdout.split()[-3:]
    return decoded, budget, choice, int(seen), int(rss)


def first_batch(pattern: str, n: int, start_update: int = 0, known: bool = True) -> float:
    params = f"{{files: '{pattern}', shape: [16], num_classes: 10" + (
        f", num_examples: {n}}}" if known else "}")
    cfg = load_config(None, ["data.name=tfrecord", f"data.params={params}",
                             "data.validation_fraction=0"])
    began = time.perf_counter()
    source = load_source(cfg.data, 0)
    next(iter(train_dataset(source, BatchPlan(BATCH, 1, 1), cfg.data, 0, start_update)))
    return time.perf_counter() - began


def timed_pairs(fn_a, fn_b, rounds: int):
    a, b = [], []
    for r in range(rounds):
        for side in ([0, 1] if r % 2 == 0 else [1, 0]):
            (a if side == 0 else b).append((fn_a if side == 0 else fn_b)())
    return statistics.median(a), statistics.median(b), statistics.median(y / x for x, y in zip(a, b))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=20_000)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=40)
    args = p.parse_args()
    results = {}
    root = make_images(args.images)
    ratio, a, b = throughput(root, args.rounds, args.batches)
    results["throughput_ratio"] = ratio
    print(f"image folder ({args.images} JPEGs 96x96 -> 64x64, random resized crop, flip, "
          f"normalize, batch {BATCH}): tftrain / image_dataset_from_directory + tf.data "
          f"practice = {ratio:.2f} (medians {a:,.0f} vs {b:,.0f} examples/s)", flush=True)
    decoded, budget, choice, seen, rss = peak_rss(root, args.images)
    results["peak_rss"] = {"decoded": decoded, "budget": budget, "rss": rss, "cache": choice}
    print(f"streaming {seen:,} examples ({decoded / 2**20:,.0f} MiB decoded, cache budget "
          f"{budget / 2**20:,.0f} MiB, cache: {choice}): peak RSS {rss / 2**20:,.0f} MiB, limit "
          f"budget + 1 GiB = {(budget + 2**30) / 2**20:,.0f} MiB", flush=True)
    small, large = make_records(10_000, 8), make_records(args.records)
    for known in (True, False):
        first_batch(large, args.records, known=known)        # count once (cached) and warm up
        t_small, t_large, r = timed_pairs(lambda: first_batch(small, 10_000, known=known),
                                          lambda: first_batch(large, args.records, known=known),
                                          args.rounds)
        how = "num_examples" if known else "cached count"
        results[f"first_batch_ratio_{'num_examples' if known else 'cached'}"] = r
        print(f"time to first batch ({how}): 10,000 records {t_small:.2f} s, "
              f"{args.records:,} records {t_large:.2f} s, ratio {r:.2f}", flush=True)
    steps = args.records // BATCH
    t10, t90, r = timed_pairs(lambda: first_batch(large, args.records, steps // 10),
                              lambda: first_batch(large, args.records, 9 * steps // 10), args.rounds)
    results["resume_ratio"] = r
    print(f"resume at 90% vs 10% of an epoch of {args.records:,} records: {t90:.2f} s vs "
          f"{t10:.2f} s, ratio {r:.2f}", flush=True)
    print(json.dumps(results))
    record.rows([
        (f"input: tftrain's streaming pipeline / `image_dataset_from_directory` + the tf.data "
         f"guide's practice, {args.images:,} JPEGs 96×96 → 64×64, random resized crop, flip, "
         f"normalize, batch {BATCH}", f"{ratio:.2f} (medians {a:,.0f} vs {b:,.0f} examples/s)"),
        (f"input: peak RSS streaming a folder of {decoded / 2**20:,.0f} MiB decoded with "
         f"`cache_budget` {budget / 2**20:,.0f} MiB (budget + 1 GiB = "
         f"{(budget + 2**30) / 2**20:,.0f} MiB)", f"{rss / 2**20:,.0f} MiB"),
        (f"input: time to the first batch, {args.records:,} / 10,000 TFRecord records, with "
         "`num_examples` / with the cached count",
         f"{results['first_batch_ratio_num_examples']:.2f} / {results['first_batch_ratio_cached']:.2f}"),
        (f"input: time to the first batch resuming at 90% / at 10% of an epoch of "
         f"{args.records:,} records", f"{r:.2f} ({t90:.2f} s vs {t10:.2f} s)")])


if __name__ == "__main__":
    main()
