"""Sources, batch arithmetic and the resumable input pipeline."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import ConfigError, load_config
from tftrain.data import (BatchPlan, DATASETS, EpochLayout, UserData, cache_choice, cached,
                          epoch_layout, label_spec, load_source, plan_batches, train_dataset,
                          val_dataset)
from tftrain.data.records import cached_counts, group_offsets


def cfg(*sets):
    return load_config(None, list(sets))


def labels_of(ds, n):
    return [b[1].numpy() for b in ds.take(n)]


def write_records(directory, shards=4, per_shard=25, sizes=None):
    """TFRecord shards of (x = [i, shard], y = i % 3); returns the glob."""
    directory.mkdir(exist_ok=True)
    for shard in range(shards):
        with tf.io.TFRecordWriter(str(directory / f"part-{shard}.tfrecord")) as w:
            for i in range(sizes[shard] if sizes else per_shard):
                ex = tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=[float(i), float(shard)])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 3]))}))
                w.write(ex.SerializeToString())
    return f"{directory}/part-*.tfrecord"


def record_cfg(pattern, *sets):
    return cfg("data.name=tfrecord", f"data.params={{files: '{pattern}', shape: [2], num_classes: 3}}",
               *sets).data


def ids(batches):
    """(value, shard) pairs of tfrecord examples, as ints."""
    return [tuple(int(v) for v in row) for b in batches for row in b[0].numpy()]


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


def test_epoch_layout_drop_and_pad():
    drop = EpochLayout((100,), 2, 32, pad=False)
    assert (drop.steps(), drop.dropped(), drop.share) == (3, 4, 16)
    pad = EpochLayout((100,), 2, 32, pad=True)
    assert pad.steps() == 4 and list(pad.real_per_update()) == [32, 32, 32, 4]
    np.testing.assert_allclose(pad.weights(), [1, 1, 1, 8])
    files = EpochLayout((30, 10), 2, 8, pad=True)         # FILE: uneven workers
    assert files.steps() == 8 and list(files.real_per_update()) == [8, 8, 6, 4, 4, 4, 4, 2]
    assert EpochLayout((30, 10), 2, 8, pad=False).steps() == 2


def test_a_global_batch_the_file_streams_do_not_divide_is_refused():
    """A run that began on 2 workers reads its files as 2 streams; resumed with another
    global batch (run.allow_batch_change), 63 examples per update cannot take the same
    number from each stream (it took 31 of each: an example every update dropped)."""
    with pytest.raises(ConfigError, match=r"train\.global_batch_size: 63 examples per update do "
                                          r"not split evenly over the 2 file streams .* use a "
                                          r"multiple of 2"):
        EpochLayout((30, 40), 1, 63, pad=False)
    assert EpochLayout((30, 40), 1, 62, pad=False).chunk == 31
    assert EpochLayout((70,), 1, 63, pad=False).steps() == 1      # one stream: any batch


def test_digits_split():
    source = load_source(cfg().data, seed=42)
    assert (source.num_train, source.num_val) == (1527, 270)
    assert source.spec.shape == (8, 8, 1) and source.spec.num_classes == 10
    x, y = next(iter(source.calibration(2000).batch(2000)))
    assert x.dtype == tf.float32 and float(tf.reduce_max(x)) == 1.0
    assert sorted(np.unique(y.numpy())) == list(range(10))
    again = load_source(cfg().data, seed=42)
    np.testing.assert_array_equal(next(iter(again.validation().batch(500)))[1],
                                  next(iter(source.validation().batch(500)))[1])


def test_synthetic_tokens_and_images():
    tokens = load_source(cfg("data.name=synthetic", "data.params={kind: tokens, num_examples: 200, seq_len: 12, vocab_size: 50}").data, 0)
    assert tokens.spec.vocab_size == 50 and tokens.spec.shape == (12,) and tokens.spec.dtype == "int32"
    images = load_source(cfg("data.name=synthetic", "data.params={num_examples: 300, shape: [4, 4, 2]}").data, 0)
    assert images.spec.shape == (4, 4, 2) and images.num_train + images.num_val == 300
    with pytest.raises(ConfigError, match="data.params.kind"):
        load_source(cfg("data.name=synthetic", "data.params={kind: audio}").data, 0)


def test_npz_and_its_bad_inputs(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.random.rand(100, 3).astype(np.float32), y=np.arange(100) % 4,
             short=np.arange(99), neg=np.arange(100) - 1)
    source = load_source(cfg("data.name=npz", f"data.params={{path: {path}}}").data, 0)
    assert source.spec.num_classes == 4 and source.num_train == 85
    with pytest.raises(ConfigError, match=r"data\.params: key 'feats' not in"):
        load_source(cfg("data.name=npz", f"data.params={{path: {path}, x_key: feats}}").data, 0)
    with pytest.raises(ConfigError, match=r"d\.npz: x has 100 examples but y has 99"):
        load_source(cfg("data.name=npz", f"data.params={{path: {path}, y_key: short}}").data, 0)
    with pytest.raises(ConfigError, match=r"label -1 is outside \[0, 99\)"):
        load_source(cfg("data.name=npz", f"data.params={{path: {path}, y_key: neg}}").data, 0)
    with pytest.raises(ConfigError, match=r"label 3 is outside \[0, 3\)"):
        load_source(cfg("data.name=npz", f"data.params={{path: {path}, num_classes: 3}}").data, 0)
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ConfigError, match=r"one\.npy holds a single array \(\.npy\), not a \.npz"):
        load_source(cfg("data.name=npz", f"data.params={{path: {tmp_path / 'one.npy'}}}").data, 0)


def test_record_counts_are_cached_by_name_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr("tftrain.data.records.CACHE", tmp_path / "cache")
    pattern = write_records(tmp_path / "r", sizes=[3, 5, 0, 7])
    paths = sorted(tf.io.gfile.glob(pattern))
    assert cached_counts(paths) == [3, 5, 0, 7]
    assert len(list((tmp_path / "cache").glob("counts-*.json"))) == 1
    monkeypatch.setattr("tftrain.data.records.count_records", lambda p: pytest.fail("counted again"))
    assert cached_counts(paths) == [3, 5, 0, 7]


def test_group_offsets_follow_round_robin():
    counts = [3, 1, 4]
    order = []                         # reference: round robin, exhausted files left out
    left = list(counts)
    while any(left):
        for i in range(3):
            if left[i]:
                order.append(i)
                left[i] -= 1
    for t in range(sum(counts)):
        read, nxt = group_offsets(counts, t)
        assert list(read) == [order[:t].count(i) for i in range(3)] and nxt == order[t]


def test_tfrecord_streams_every_example_once_and_resumes_anywhere(tmp_path):
    pattern = write_records(tmp_path / "r", shards=5, sizes=[23, 17, 30, 9, 21])
    data = record_cfg(pattern, "data.validation_fraction=0.2", "data.shuffle_buffer=16")
    source = load_source(data, 0)
    assert (source.num_train, source.num_val, source.spec.shape) == (77, 23, (2,))
    plan = BatchPlan(4, 1, 2)            # 8 per update: 9 updates per epoch
    full = ids(train_dataset(source, plan, data, seed=3).take(27))
    epoch0 = full[:72]
    assert len(set(epoch0)) == 72 and all(s != 0 for _, s in epoch0)     # shard 0 is validation
    assert full[72:144] != epoch0                                      # epochs differ
    for start in (1, 4, 7, 8, 13):
        resumed = ids(train_dataset(source, plan, data, seed=3, start_update=start).take(27 - start))
        assert resumed == full[start * 8:], start


def test_the_training_stream_says_it_never_ends(tmp_path):
    # a cluster's iterator asks every worker for data on each step (an all-reduce) unless
    # the input is known to be infinite
    pattern = write_records(tmp_path / "r", shards=2, sizes=[10, 10])
    data = record_cfg(pattern, "data.validation_fraction=0.5")
    source = load_source(data, 0)
    ds = train_dataset(source, BatchPlan(4, 1, 1), data, seed=0)
    assert int(ds.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    assert len(ids(ds.take(7))) == 7 * 4          # past the 10-example epoch: it goes on


def test_tfrecord_file_sharding_gives_disjoint_files(tmp_path):
    pattern = write_records(tmp_path / "r", shards=4, per_shard=25)
    data = record_cfg(pattern, "data.validation_fraction=0", "data.remainder=pad")
    source = load_source(data, 0)
    plan = BatchPlan(5, 2, 1)
    layout = epoch_layout(source, plan, data, workers=2)
    assert not layout.shared_stream and layout.steps() == 10
    seen = [ids(train_dataset(source, plan, data, 1, pipeline=(w, 2)).take(10)) for w in (0, 1)]
    shards = [{s for _, s in part} for part in seen]
    assert shards == [{0, 2}, {1, 3}]
    assert sorted(seen[0] + seen[1]) == sorted((i, s) for s in range(4) for i in range(25))


@pytest.mark.slow
def test_file_streams_are_reassigned_to_another_number_of_workers(tmp_path):
    """5 uneven files read as the 2 streams a 2-worker run began with, then on 1 worker
    (2 replicas), 2 workers of 2 replicas and 4 workers, from the start or resumed at
    update 3: every update holds the same examples with the same augmentation keys, and
    every example is read once per epoch."""
    pattern = write_records(tmp_path / "r", shards=5, sizes=[13, 7, 11, 3, 9])
    data = record_cfg(pattern, "data.validation_fraction=0", "data.remainder=pad",
                      "data.shuffle_buffer=4", "data.cache=none")
    source = load_source(data, 0)
    began = epoch_layout(source, BatchPlan(4, 2, 1), data, workers=2)
    # stream 0: files 0, 2, 4 (33 examples); stream 1: files 1, 3 (10); 4 of each per update
    assert (began.streams, began.sizes, began.chunk, began.steps()) == (2, (33, 10), 4, 9)

    def updates(plan, workers, start=0):
        """Per update: the sorted (value, file, augmentation key) of its real examples."""
        layout = epoch_layout(source, plan, data, workers, streams=2)
        per = plan.replicas // workers                      # elements per worker and update
        out = [[] for _ in range(began.steps() - start)]
        for w in range(workers):
            batches = train_dataset(source, plan, data, 7, start_update=start,
                                    pipeline=(w, workers), streams=2).take(per * len(out))
            for i, (x, _, weight) in enumerate(batches):
                j = start * layout.share + i * plan.replica_batch + np.arange(plan.replica_batch)
                keys = [layout.slot_key(w, int(k)) for k in j]
                out[i // per] += [(int(a), int(f), k) for (a, f), k, real
                                  in zip(x.numpy(), keys, weight.numpy() > 0) if real]
        return [sorted(u) for u in out]

    reference = updates(BatchPlan(4, 2, 1), 2)
    assert sorted((a, f) for u in reference for a, f, _ in u) == sorted(
        (i, f) for f, n in enumerate([13, 7, 11, 3, 9]) for i in range(n))  # each once
    assert len({k for u in reference for *_, k in u}) == 43
    assert updates(BatchPlan(4, 2, 1), 1) == reference                   # 1 worker, 2 replicas
    assert updates(BatchPlan(2, 4, 1), 2) == reference                   # 2 workers x 2 replicas
    assert updates(BatchPlan(2, 4, 1), 4) == reference                   # 4 workers, 1 stream half each
    assert updates(BatchPlan(2, 4, 1), 4, start=3) == reference[3:]      # resumed mid-epoch
    assert updates(BatchPlan(4, 2, 1), 1, start=3) == reference[3:]
    with pytest.raises(ConfigError, match="2 streams .* which 3 workers cannot split evenly"):
        epoch_layout(source, BatchPlan(2, 3, 1), data, 3, streams=2)


def test_data_sharding_takes_each_workers_share_of_every_update():
    data = cfg().data
    source = load_source(data, 0)
    plan = BatchPlan(8, 2, 1)
    one = [b[1].numpy() for b in train_dataset(source, plan, data, 5).take(40)]
    two = [[b[1].numpy() for b in train_dataset(source, plan, data, 5, pipeline=(w, 2)).take(20)]
           for w in (0, 1)]
    for u in range(20):        # update u: worker 0 has the first 8 of its 16, worker 1 the rest
        np.testing.assert_array_equal(np.concatenate([one[2 * u], one[2 * u + 1]]),
                                      np.concatenate([two[0][u], two[1][u]]))


@pytest.mark.parametrize("augment", ["random_crop", "mixup"])
def test_an_example_is_augmented_alike_whatever_the_number_of_workers(augment):
    """Seeds follow an example's place in the epoch, not the worker that reads it: the
    augmented inputs of every update are the same on one worker and on two, so a run can
    resume on another number of workers."""
    op = {"random_crop": "{random_crop: {padding: 1}}", "mixup": "{mixup: {alpha: 0.4}}"}[augment]
    data = cfg(f"data.augment=[{op}]", "data.remainder=pad").data
    source = load_source(data, 0)
    plan = BatchPlan(8, 2, 1)
    one = [b[0].numpy() for b in train_dataset(source, plan, data, 5).take(60)]
    two = [[b[0].numpy() for b in train_dataset(source, plan, data, 5,
                                                pipeline=(w, 2)).take(30)] for w in (0, 1)]
    for u in range(30):        # crosses an epoch's end (11 updates of 16 per epoch)
        np.testing.assert_array_equal(np.concatenate([one[2 * u], one[2 * u + 1]]),
                                      np.concatenate([two[0][u], two[1][u]]))
    assert not np.array_equal(one[0], one[22])             # augmented anew each epoch


@pytest.mark.parametrize("op", ["{mixup: {alpha: 0.4}}", "{cutmix: {alpha: 1.0}}"])
def test_batch_augmentation_pairs_within_micro_batches_alike_on_replicas_or_accumulating(op):
    """Two replicas of 8 and one device accumulating two micro-batches of 8 mix the same
    pairs with the same draws (pairs and draws belong to a micro-batch), so a mirrored
    step equals one device's accumulated step and a resume may move between them; a
    micro-batch's last example is paired with its first, not with the next micro-batch's."""
    data = cfg(f"data.augment=[{op}]", "data.params={image_size: 8, channels: 3}").data
    source = load_source(data, 0)
    mirrored = [b for b in train_dataset(source, BatchPlan(8, 2, 1), data, 5).take(6)]
    accumulated = [b for b in train_dataset(source, BatchPlan(8, 1, 2), data, 5).take(3)]
    for u in range(3):
        for part in (0, 1):            # inputs, soft labels
            np.testing.assert_array_equal(
                np.concatenate([mirrored[2 * u][part], mirrored[2 * u + 1][part]]),
                accumulated[u][part].numpy())
    plain = cfg("data.params={image_size: 8, channels: 3}").data
    x, _ = next(iter(train_dataset(source, BatchPlan(8, 1, 2), plain, 5)))
    mixed = accumulated[0][0].numpy()
    assert not np.array_equal(mixed[:8], x[:8]) and not np.array_equal(mixed[8:], x[8:])


def test_training_batches_resume_at_any_update():
    source = load_source(cfg().data, 0)
    plan = BatchPlan(32, 2, 1)
    data = cfg().data
    full = labels_of(train_dataset(source, plan, data, seed=3), 120)
    resumed = labels_of(train_dataset(source, plan, data, seed=3, start_update=37), 46)
    for a, b in zip(full[74:], resumed):
        np.testing.assert_array_equal(a, b)
    assert all(len(y) == 32 for y in full)                    # replica batches
    assert not np.array_equal(full[0], full[46])              # epochs shuffled differently
    other = labels_of(train_dataset(source, plan, data, seed=4), 1)
    assert not np.array_equal(full[0], other[0])


def test_pad_counts_every_example_once_with_weights():
    data = cfg("data.remainder=pad", "data.shuffle=false")
    source = load_source(data.data, 0)
    plan = BatchPlan(8, 2, 4)                  # 64 per update: 24 updates, the last has 55 real
    batches = list(train_dataset(source, plan, data.data, 0).take(48).as_numpy_iterator())
    x = np.concatenate([b[0] for b in batches])
    w = np.concatenate([b[2] for b in batches])
    assert (w > 0).sum() == 1527 and set(np.unique(w[:23 * 64])) == {1.0}
    np.testing.assert_allclose(w[23 * 64:][w[23 * 64:] > 0], 64 / 55)
    assert not x[w == 0].any()
    reference = np.concatenate([b[0] for b in source.calibration(1527).batch(2000).as_numpy_iterator()])
    np.testing.assert_array_equal(x[w > 0], reference)


def test_validation_keeps_every_example():
    source = load_source(cfg().data, 0)
    total = sum(int(tf.shape(y)[0]) for _, y in val_dataset(source, BatchPlan(32, 2, 1)))
    assert total == source.num_val


def test_seed_zero_and_process_seed_untouched():
    source = load_source(cfg().data, 0)
    tf.random.set_seed(0)
    before = tf.random.uniform([3]).numpy()
    tf.random.set_seed(0)
    first = labels_of(train_dataset(source, BatchPlan(32, 2, 1), cfg().data, seed=0), 2)
    after = tf.random.uniform([3]).numpy()
    np.testing.assert_array_equal(before, after)
    tf.random.set_seed(123)
    again = labels_of(train_dataset(source, BatchPlan(32, 2, 1), cfg().data, seed=0), 2)
    np.testing.assert_array_equal(first[1], again[1])         # order independent of the process seed


def make_images(root, classes=("cat", "dog"), n=5, size=6):
    for k, label in enumerate(classes):
        (root / label).mkdir(parents=True)
        for i in range(n):
            img = np.full((size, size, 3), 40 + 150 * k + i, np.uint8)
            tf.io.write_file(str(root / label / f"{i}.png"), tf.io.encode_png(img))


def test_image_folder_streams_and_caches_to_the_same_values(tmp_path):
    make_images(tmp_path / "imgs")
    data = cfg("data.name=image_folder", f"data.params={{path: {tmp_path / 'imgs'}, image_size: [4, 4]}}",
               "data.validation_fraction=0.2", "data.cache=none")
    source = load_source(data.data, 0)
    assert source.spec.shape == (4, 4, 3) and source.spec.num_classes == 2 and source.num_train == 8
    assert cache_choice(source, data.data) == "none"
    plan = BatchPlan(2, 1, 1)
    streamed = list(train_dataset(source, plan, data.data, 1).take(8).as_numpy_iterator())
    memory = cfg(*[f"{k}" for k in ()], "data.name=image_folder",
                 f"data.params={{path: {tmp_path / 'imgs'}, image_size: [4, 4]}}",
                 "data.validation_fraction=0.2", "data.cache=auto").data
    held = cached(source, memory)
    assert cache_choice(source, memory) == "memory" and not held.elementwise
    again = list(train_dataset(held, plan, memory, 1).take(8).as_numpy_iterator())
    for a, b in zip(streamed, again):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    small = cfg("data.name=image_folder", f"data.params={{path: {tmp_path / 'imgs'}}}",
                "data.cache_budget=100").data
    assert cache_choice(load_source(small, 0), small) == "none"


def test_image_folder_bad_files(tmp_path):
    make_images(tmp_path / "imgs")
    (tmp_path / "imgs" / "dog" / "9.jpg").write_text("not an image")
    params = f"data.params={{path: {tmp_path / 'imgs'}}}"
    with pytest.raises(ConfigError, match=r"dog/9\.jpg is not a PNG/JPEG/BMP/GIF image.*on_bad_record: skip"):
        load_source(cfg("data.name=image_folder", params).data, 0)
    skipped = load_source(cfg("data.name=image_folder", params, "data.on_bad_record=skip",
                              "data.validation_fraction=0").data, 0)
    assert skipped.num_train == 10
    (tmp_path / "imgs" / "bird").mkdir()
    with pytest.raises(ConfigError, match=r"class folder .*bird has no images"):
        load_source(cfg("data.name=image_folder", params, "data.on_bad_record=skip").data, 0)


def test_augmentation_is_seeded_and_validation_gets_only_the_deterministic_part():
    data = cfg("data.name=synthetic", "data.params={num_examples: 64, shape: [8, 8, 3]}",
               "data.augment=[{random_crop: {padding: 2}}, random_flip, {random_affine: {rotation: 0.1, zoom: 0.1, translation: 0.1}}, "
               "{random_resized_crop: {scale: [0.5, 1.0]}}, {color_jitter: {brightness: 0.1, contrast: 0.2, saturation: 0.2, hue: 0.05}}, "
               "{cutout: 3}, {normalize: {mean: 0.5, std: 0.25}}]").data
    source = load_source(data, 0)
    plan = BatchPlan(8, 1, 1)
    a = list(train_dataset(source, plan, data, 7).take(3).as_numpy_iterator())
    b = list(train_dataset(source, plan, data, 7, start_update=1).take(2).as_numpy_iterator())
    np.testing.assert_array_equal(a[1][0], b[0][0])          # same augmented batch after a resume
    plain = cfg("data.name=synthetic", "data.params={num_examples: 64, shape: [8, 8, 3]}").data
    raw = list(train_dataset(source, plan, plain, 7).take(1).as_numpy_iterator())
    assert a[0][0].shape == (8, 8, 8, 3) and not np.allclose(a[0][0], (raw[0][0] - 0.5) / 0.25)
    val = next(iter(val_dataset(source, plan, data)))[0].numpy()
    val_raw = next(iter(val_dataset(source, plan, plain)))[0].numpy()
    np.testing.assert_allclose(val, (val_raw - 0.5) / 0.25, rtol=1e-6)
    with pytest.raises(ConfigError, match=r"data\.augment: unknown augmentation 'random_flp'.*did you mean 'random_flip'"):
        train_dataset(source, plan, cfg("data.augment=[random_flp]").data, 0)
    with pytest.raises(ConfigError, match=r"data\.augment\[0\]\.random_crop\.pad: unknown parameter; did you mean padding"):
        train_dataset(source, plan, cfg("data.augment=[{random_crop: {pad: 2}}]").data, 0)


def test_an_augmentation_of_the_user_s_own_is_imported_seeded_and_checked(tmp_path, monkeypatch):
    (tmp_path / "my_aug.py").write_text(
        "import tensorflow as tf\n"
        "def shift(x, seed, by=1.0):\n"
        "    return x + by + tf.random.stateless_uniform([], seed)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    params = "data.params={num_examples: 64, shape: [8, 8, 3]}"
    data = cfg("data.name=synthetic", params, "data.augment=[{my_aug:shift: {by: 10.0}}]").data
    plain = cfg("data.name=synthetic", params).data
    source, plan = load_source(data, 0), BatchPlan(8, 1, 1)
    a = next(train_dataset(source, plan, data, 7).as_numpy_iterator())[0]
    raw = next(train_dataset(source, plan, plain, 7).as_numpy_iterator())[0]
    added = (a - raw).reshape(8, -1)
    assert np.all((added >= 10) & (added < 11))                       # by: 10 and the draw
    assert np.ptp(added, axis=1).max() < 1e-5 and np.ptp(added[:, 0]) > 0  # one draw per example
    again = next(train_dataset(source, plan, data, 7).as_numpy_iterator())[0]
    np.testing.assert_array_equal(a, again)                           # seeded
    val = next(iter(val_dataset(source, plan, data)))[0].numpy()
    np.testing.assert_array_equal(val, next(iter(val_dataset(source, plan, plain)))[0].numpy())
    with pytest.raises(ConfigError, match=r"data\.augment\[0\]\.my_aug:shift\.bi: unknown "
                                          r"parameter; valid: by"):
        train_dataset(source, plan, cfg("data.augment=[{my_aug:shift: {bi: 2}}]").data, 0)
    with pytest.raises(ConfigError, match=r"data\.augment\[0\]: cannot import module 'no_aug'"):
        train_dataset(source, plan, cfg("data.augment=[no_aug:shift]").data, 0)


def test_an_augmentation_that_cannot_take_the_inputs_is_refused_at_plan_time():
    from tftrain.data import augment

    def ops(*entries):
        return augment.build(list(entries))
    augment.check(ops("random_crop", "normalize", "mixup"), (8, 8, 3), "float32")
    augment.check(ops("spec_augment", "time_shift", "normalize", "mixup"), (16000,), "float32")
    with pytest.raises(ConfigError, match=r"data\.augment\[1\]: random_crop works on images "
                                          r"\(height, width, channels\), and the data gives "
                                          r"examples of shape \(16000,\)"):
        augment.check(ops("normalize", "random_crop"), (16000,), "float32")
    with pytest.raises(ConfigError, match=r"data\.augment\[0\]: spec_augment works on waveforms"):
        augment.check(ops("spec_augment"), (8, 8, 3), "float32")
    with pytest.raises(ConfigError, match=r"data\.augment\[0\]: mixup changes float inputs, and "
                                          r"the data gives int32 examples of shape \(64,\)"):
        augment.check(ops("mixup"), (64,), "int32")


def test_mixup_and_cutmix_give_soft_labels():
    for op in ("mixup: {alpha: 0.4}", "cutmix: {alpha: 1.0}"):
        data = cfg("data.name=synthetic", "data.params={num_examples: 64, shape: [8, 8, 3], num_classes: 4}",
                   f"data.augment=[{{{op}}}]").data
        source = load_source(data, 0)
        x, y = next(iter(train_dataset(source, BatchPlan(16, 1, 1), data, 0)))
        assert y.shape == (16, 4)
        np.testing.assert_allclose(tf.reduce_sum(y, -1), 1.0, rtol=1e-6)
        assert float(tf.reduce_max(y)) <= 1.0 and np.any((y.numpy() > 0) & (y.numpy() < 1)), op


@pytest.mark.parametrize("sets", [
    [], ["data.remainder=pad"], ["data.augment=[{mixup: {alpha: 0.4}}]"],
    ["data.augment=[{random_crop: {padding: 1}}, {cutmix: {alpha: 1.0}}]", "data.remainder=pad"],
    ["data.name=synthetic", "data.params={num_examples: 64, shape: [8, 8, 3], num_classes: 4}"],
    ["data.name=tfrecord"], ["data.name=tests.data.test_data:user_data"]])
def test_the_training_label_spec_is_known_without_building_the_pipeline(sets, tmp_path):
    """`label_spec`: the training batches' labels' dtype and shape but the batch axis,
    from the augmentation alone (soft labels where a batch op mixes), whatever the source
    (a user's validation labels are int64 here: training's are int32 all the same)."""
    if sets == ["data.name=tfrecord"]:
        data = record_cfg(write_records(tmp_path))
    else:
        data = cfg(*sets).data
    source = load_source(data, 0)
    plan = BatchPlan(8, 1, 1)
    spec = label_spec(source, data)
    trained = train_dataset(source, plan, data, 0).element_spec[1]
    assert (spec.dtype, spec.shape[1:]) == (trained.dtype, trained.shape[1:]), (spec, trained)


def user_data(n=40, seed=None):
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    y = np.arange(n) % 3
    ds = tf.data.Dataset.from_tensor_slices
    return UserData(ds((x, y)), ds((x[:6], y[:6])))


def user_pair(n=40):
    data = user_data(n)
    return data.train, data.validation


def user_broken():
    return tf.data.Dataset.range(3)


def test_user_dataset_function():
    data = cfg("data.name=tests.data.test_data:user_data", "data.params={n: 50}", "data.shuffle_buffer=8").data
    source = load_source(data, 0)
    assert (source.num_train, source.num_val, source.spec.shape, source.spec.num_classes) == (50, 6, (2,), 3)
    plan = BatchPlan(5, 1, 1)
    full = [b[0].numpy()[:, 0] for b in train_dataset(source, plan, data, 2).take(20)]
    assert sorted(np.concatenate(full[:10]).tolist()) == list(range(0, 100, 2))
    resumed = [b[0].numpy()[:, 0] for b in train_dataset(source, plan, data, 2, start_update=7).take(13)]
    np.testing.assert_array_equal(np.concatenate(full[7:]), np.concatenate(resumed))
    pair = load_source(cfg("data.name=tests.data.test_data:user_pair").data, 0)
    assert pair.num_train == 40
    with pytest.raises(ConfigError, match=r"data\.name: tests\.data\.test_data:user_broken returned DatasetV2|returned .*expected tftrain\.data\.UserData"):
        load_source(cfg("data.name=tests.data.test_data:user_broken").data, 0)
    with pytest.raises(ConfigError, match=r"data\.name: module 'tests\.data\.test_data' has no function 'nope'"):
        load_source(cfg("data.name=tests.data.test_data:nope").data, 0)


def test_tfds_dataset_prepared_here_is_read_offline(tmp_path):
    import tensorflow_datasets as tfds     # in the test extras: never skipped
    x = np.random.default_rng(0).integers(0, 255, (60, 8, 8, 3), dtype=np.uint8)
    y = np.arange(60) % 3
    builder = tfds.dataset_builders.TfDataBuilder(
        name="tftrain_tiny", version="1.0.0", data_dir=str(tmp_path),
        split_datasets={"train": tf.data.Dataset.from_tensor_slices({"image": x, "label": y}),
                        "test": tf.data.Dataset.from_tensor_slices({"image": x[:12], "label": y[:12]})},
        features=tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(8, 8, 3)),
                                             "label": tfds.features.ClassLabel(num_classes=3)}))
    builder.download_and_prepare()
    data = cfg("data.name=tfds:tftrain_tiny",
               f"data.params={{data_dir: {tmp_path}, x: image, y: label, validation_split: test}}").data
    source = load_source(data, 0)
    assert (source.num_train, source.num_val, source.spec.shape, source.spec.num_classes) == (60, 12, (8, 8, 3), 3)
    batches = list(train_dataset(source, BatchPlan(10, 1, 1), data, 0).take(6).as_numpy_iterator())
    seen = np.concatenate([b[0] for b in batches])
    np.testing.assert_allclose(np.sort(seen.reshape(60, -1), axis=0), np.sort(x.reshape(60, -1) / 255.0, axis=0), rtol=1e-6)
    with pytest.raises(ConfigError, match=r"tfds:missing_set is not prepared in .*never|tfds:missing_set is not prepared"):
        load_source(cfg("data.name=tfds:missing_set", f"data.params={{data_dir: {tmp_path}}}").data, 0)


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


def test_tfrecord_resume_where_a_worker_has_only_padding_left(tmp_path):
    pattern = write_records(tmp_path / "r", shards=2, sizes=[30, 6])
    data = record_cfg(pattern, "data.validation_fraction=0", "data.remainder=pad", "data.shuffle_buffer=4")
    source = load_source(data, 0)
    plan = BatchPlan(3, 2, 1)              # worker 1: 6 examples, then padding to 15 slots
    full = ids(train_dataset(source, plan, data, 0, pipeline=(1, 2)).take(8))
    assert full[6:15] == [(0, 0)] * 9
    resumed = ids(train_dataset(source, plan, data, 0, start_update=3, pipeline=(1, 2)).take(5))
    assert resumed == full[9:]


def user_digits(scale: float = 16.0):
    """A user dataset function: scikit-learn's digits through a tf.data map."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x, y = d.images.astype(np.float32)[..., None], d.target.astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices
    prep = lambda a, b: (a / scale, b)   # noqa: E731
    return UserData(ds((x[270:], y[270:])).map(prep), ds((x[:270], y[:270])).map(prep))


def test_digits_upscaled_for_imagenet_backbones():
    plain = load_source(cfg().data, 0)
    big = load_source(cfg("data.params={image_size: 32, channels: 3}").data, 0)
    assert big.spec.shape == (32, 32, 3) and big.num_train == plain.num_train
    x = big.load(tf.constant([0, 1]))[0].numpy()
    assert 0.0 <= x.min() and x.max() <= 1.0
    np.testing.assert_array_equal(x[..., 0], x[..., 2])             # grey repeated
    small = plain.load(tf.constant([0]))[0].numpy()[0, ..., 0]
    np.testing.assert_allclose(x[0, ::4, ::4, 0].mean(), small.mean(), atol=0.05)
    with pytest.raises(ConfigError, match=r"data\.params\.channels: 2; expected 1 or 3"):
        load_source(cfg("data.params={channels: 2}").data, 0)


def test_a_recipe_whose_data_is_not_made_yet_names_the_command_that_makes_it(tmp_path):
    from tftrain.config import load_config
    from helpers import CONFIGS
    for recipe, command in (("speech_digits.yaml", "python scripts/make_speech_digits.py --out "),
                            ("text_classification.yaml", "python scripts/make_fortunes_text.py --out ")):
        cfg = load_config(CONFIGS / recipe)
        missing = tmp_path / cfg.data.params["path"]
        data = load_config(CONFIGS / recipe, [f"data.params.path={missing}"]).data
        with pytest.raises(ConfigError, match=rf"data\.params\.path: {missing} does not exist; make "
                                              rf"it first: {command}{missing}$"):
            load_source(data, 0)
