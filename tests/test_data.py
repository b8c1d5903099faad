"""Datasets, batch arithmetic and the resumable input pipeline."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import ConfigError, load_config
from tftrain.data import (BatchPlan, DATASETS, load_source, plan_batches, train_dataset,
                          val_dataset)


def cfg(*sets):
    return load_config(None, list(sets))


def test_batch_plan_arithmetic():
    plan = BatchPlan(per_replica=8, replicas=2, accumulation=4)
    assert plan.global_batch == 64 and plan.replica_batch == 32
    assert plan.steps_per_epoch(1527) == 23
    with pytest.raises(ConfigError, match=r"global batch 64 \(= 8 per replica x 2 replicas x 4"):
        plan.steps_per_epoch(50)


def test_global_batch_size_sets_per_replica():
    plan = plan_batches(cfg("train.global_batch_size=96", "train.accumulation_steps=3"), replicas=2)
    assert (plan.per_replica, plan.global_batch) == (16, 96)
    with pytest.raises(ConfigError, match=r"train\.global_batch_size: 100 is not divisible by replicas x accumulation_steps = 2 x 3; use a multiple of 6"):
        plan_batches(cfg("train.global_batch_size=100", "train.accumulation_steps=3"), replicas=2)


def test_digits_split():
    source = load_source(cfg().data, seed=42)
    assert (source.num_train, source.num_val) == (1527, 270)
    assert source.spec.shape == (8, 8, 1) and source.spec.num_classes == 10
    x, y = next(iter(source.train.batch(2000)))
    assert x.dtype == tf.float32 and float(tf.reduce_max(x)) == 1.0
    assert sorted(np.unique(y.numpy())) == list(range(10))
    again = load_source(cfg().data, seed=42)
    np.testing.assert_array_equal(next(iter(again.val.batch(500)))[1], next(iter(source.val.batch(500)))[1])


def test_synthetic_tokens_and_images():
    tokens = load_source(cfg("data.name=synthetic", "data.params={kind: tokens, num_examples: 200, seq_len: 12, vocab_size: 50}").data, 0)
    assert tokens.spec.vocab_size == 50 and tokens.spec.shape == (12,) and tokens.spec.dtype == "int32"
    images = load_source(cfg("data.name=synthetic", "data.params={num_examples: 300, shape: [4, 4, 2]}").data, 0)
    assert images.spec.shape == (4, 4, 2) and images.num_train + images.num_val == 300
    with pytest.raises(ConfigError, match="data.params.kind"):
        load_source(cfg("data.name=synthetic", "data.params={kind: audio}").data, 0)


def test_npz(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.random.rand(100, 3).astype(np.float32), y=np.arange(100) % 4)
    source = load_source(cfg("data.name=npz", f"data.params={{path: {path}}}").data, 0)
    assert source.spec.num_classes == 4 and source.num_train == 85
    with pytest.raises(ConfigError, match=r"data\.params: key 'feats' not in"):
        load_source(cfg("data.name=npz", f"data.params={{path: {path}, x_key: feats}}").data, 0)


def test_tfrecord(tmp_path):
    for shard in range(4):
        with tf.io.TFRecordWriter(str(tmp_path / f"part-{shard}.tfrecord")) as w:
            for i in range(25):
                ex = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=[float(i), 1.0])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3]))}))
                w.write(ex.SerializeToString())
    data = cfg("data.name=tfrecord", f"data.params={{files: '{tmp_path}/part-*.tfrecord', shape: [2]}}",
               "data.validation_fraction=0.25").data
    source = load_source(data, 0)
    assert (source.num_train, source.num_val, source.spec.shape, source.spec.num_classes) == (75, 25, (2,), 3)
    assert source.shard_policy == tf.data.experimental.AutoShardPolicy.FILE
    with pytest.raises(ConfigError, match=r"data\.params\.files: no file matches"):
        load_source(cfg("data.name=tfrecord", "data.params={files: /nope/*.tfrecord}").data, 0)


def test_image_folder(tmp_path):
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        for i in range(5):
            img = np.full((6, 6, 3), 40 if label == "cat" else 200, np.uint8)
            tf.io.write_file(str(tmp_path / label / f"{i}.png"), tf.io.encode_png(img))
    source = load_source(cfg("data.name=image_folder", f"data.params={{path: {tmp_path}, image_size: [4, 4]}}",
                             "data.validation_fraction=0.2").data, 0)
    assert source.spec.shape == (4, 4, 3) and source.spec.num_classes == 2 and source.num_train == 8


def test_keras_datasets_fail_clearly_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    import urllib.request

    def offline(*a, **k):
        raise OSError("network is unreachable")
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.setattr(urllib.request, "urlretrieve", offline)
    with pytest.raises(ConfigError, match=r"data\.name: could not load keras:mnist .*~/.keras/datasets/.*data\.name: npz"):
        DATASETS.get("keras:mnist")(0.1, 0)


def test_training_batches_resume_at_any_update():
    source = load_source(cfg().data, 0)
    plan = BatchPlan(32, 2, 1)
    data = cfg().data
    full = [y.numpy() for _, y in train_dataset(source, plan, data, seed=3).take(60)]
    resumed = [y.numpy() for _, y in train_dataset(source, plan, data, seed=3, start_update=37).take(23)]
    for a, b in zip(full[37:], resumed):
        np.testing.assert_array_equal(a, b)
    assert all(len(y) == 64 for y in full)                    # partial batches dropped
    assert not np.array_equal(full[0], full[23])              # epochs shuffled differently
    other = [y.numpy() for _, y in train_dataset(source, plan, data, seed=4).take(1)]
    assert not np.array_equal(full[0], other[0])


def test_validation_keeps_every_example():
    source = load_source(cfg().data, 0)
    total = sum(int(tf.shape(y)[0]) for _, y in val_dataset(source, BatchPlan(32, 2, 1)))
    assert total == source.num_val


def test_seed_zero_and_process_seed_untouched():
    source = load_source(cfg().data, 0)
    tf.random.set_seed(0)
    before = tf.random.uniform([3]).numpy()
    tf.random.set_seed(0)
    first = [y.numpy() for _, y in train_dataset(source, BatchPlan(32, 2, 1), cfg().data, seed=0).take(2)]
    after = tf.random.uniform([3]).numpy()
    np.testing.assert_array_equal(before, after)
    tf.random.set_seed(123)
    again = [y.numpy() for _, y in train_dataset(source, BatchPlan(32, 2, 1), cfg().data, seed=0).take(2)]
    np.testing.assert_array_equal(first[1], again[1])         # order independent of the process seed
