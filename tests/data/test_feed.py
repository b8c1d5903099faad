"""The device feed: batches gathered on each replica's device equal the host pipeline's."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import ConfigError, load_config
from tftrain.core.keras import keras
from tftrain.data import from_arrays, plan_batches, train_dataset
from tftrain.data import feed
from tftrain.models import MODELS
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel

DEVICES = ["/job:localhost/replica:0/task:0/device:CPU:0",
           "/job:localhost/replica:0/task:0/device:CPU:1"]


def cfg(*sets):
    return load_config(None, ["data.per_replica_batch_size=8", *sets])


def arrays(n=100, shape=(4,)):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, 3, n)


def mirrored():
    # as tftrain builds it on CPUs (the default, collectives, keys its instances per
    # process: two strategies' all-reduces of other shapes would collide)
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())


def fed_batches(fed, strategy, updates):
    """Each update's per-replica batches from the feed, as the train function takes them."""
    @tf.function
    def one():
        e, u = fed.indices()
        out = strategy.run(fed.batch, args=(e, u, fed.data))
        return [strategy.experimental_local_results(t) for t in tf.nest.flatten(out)]
    updates = [one() for _ in range(updates)]
    return [[[t[r].numpy() for t in update] for r in range(2)] for update in updates]


def host_batches(source, plan, data, seed, start, updates):
    it = iter(train_dataset(source, plan, data, seed, start_update=start))
    return [[[t.numpy() for t in next(it)] for _ in range(2)] for _ in range(updates)]


@pytest.mark.parametrize("sets,start", [
    ((), 0), ((), 9),                                    # 100 // 16 = 6 updates an epoch
    (("data.remainder=pad",), 4),                        # padding slots and their weights
    (("data.augment=[mixup]", "train.accumulation_steps=2"), 5),   # seeded batch op
    (("data.shuffle=false",), 3)])
def test_fed_batches_equal_the_host_pipelines_from_any_update(sets, start):
    c = cfg(*sets)
    x, y = arrays()
    source = from_arrays(x, y, 0.0, 0, num_classes=3, validation=(x[:4], y[:4]))
    strategy = mirrored()
    plan = plan_batches(c, strategy.num_replicas_in_sync)
    fed = feed.DeviceFeed(source, plan, c.data, 7, devices=DEVICES, strategy=strategy,
                          start_update=start)
    got = fed_batches(fed, strategy, 14)
    want = host_batches(source, plan, c.data, 7, start, 14)
    assert len(got[0][0]) == len(want[0][0]) == (3 if "pad" in str(sets) else 2)
    for update, (g, w) in enumerate(zip(got, want)):
        for replica in range(2):
            for a, b in zip(g[replica], w[replica]):
                np.testing.assert_array_equal(a, b, err_msg=f"update {start + update}")
    # the epoch's order is loaded once per epoch, not drawn again each step
    assert int(fed.loaded.numpy()) == (start + 13) // fed.steps


def test_a_feed_moved_back_gives_the_same_batches_again():
    c = cfg()
    x, y = arrays()
    source = from_arrays(x, y, 0.0, 0, num_classes=3, validation=(x[:4], y[:4]))
    strategy = mirrored()
    fed = feed.DeviceFeed(source, plan_batches(c, 2), c.data, 1, devices=DEVICES,
                          strategy=strategy)
    first = fed_batches(fed, strategy, 8)
    fed.start_at(2)                                      # a rollback to update 2
    again = fed_batches(fed, strategy, 6)
    for a, b in zip(first[2:], again):
        np.testing.assert_array_equal(a[1][0], b[1][0])


def weights_after(strategy, use_feed, updates=9, start=0):
    c = cfg("data.remainder=pad")
    x, y = arrays(n=90, shape=(8, 8, 1))
    source = from_arrays(x, y, 0.0, 0, num_classes=3, validation=(x[:4], y[:4]))
    plan = plan_batches(c, strategy.num_replicas_in_sync)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        net = TrainModel.wrap(MODELS.get("mlp")(source.spec))
        net.compile_step(keras.optimizers.Adam(0.01), build_loss("sparse_categorical_crossentropy"),
                         ["accuracy"], steps_per_execution=3)
    if use_feed:
        fed = feed.DeviceFeed(source, plan, c.data, 5, devices=DEVICES, strategy=strategy,
                              start_update=start)
        net.feed_from(fed)
        data = fed.stand_in()
    else:
        from tftrain.data import distribute
        data = distribute(strategy, source, plan, c.data, 5, start)
    net.fit(data, epochs=1, steps_per_epoch=updates, verbose=0)
    return net.get_weights()


@pytest.mark.parametrize("start", [0, 4])
def test_a_fed_model_trains_to_the_host_pipelines_weights_exactly(start):
    strategy = mirrored()
    fed = weights_after(strategy, True, start=start)
    host = weights_after(strategy, False, start=start)
    for a, b in zip(fed, host):
        np.testing.assert_array_equal(a, b)


def test_auto_feeds_in_memory_data_from_the_device_and_says_why_not_otherwise():
    x, y = arrays()
    source = from_arrays(x, y, 0.1, 0, num_classes=3)
    assert feed.choose(source, cfg().data, None, 2).device
    flip = cfg("data.augment=[{random_crop: {padding: 1}}]").data
    choice = feed.choose(source, flip, None, 2)
    assert not choice.device and "random_crop per example" in choice.reason
    # batch ops run on the device, per-example ones stay on the host's threads
    assert feed.choose(source, cfg("data.augment=[mixup]").data, None, 2).device
    # 90 training examples of 4 float32 and an int32 label: 1,800 bytes > 1/8 of 10 kB
    small = feed.choose(source, cfg().data, 10_000, 2)
    assert not small.device and small.reason == (
        "a copy of the 1.8 KiB training set per device is over 1.2 KiB (12.5% of a device)")
    assert feed.choose(source, cfg("data.feed=host").data, None, 2).line() == \
        "feed: host (data.feed: host)"


def test_device_feed_asked_for_where_it_cannot_serve_is_a_config_error():
    x, y = arrays()
    source = from_arrays(x, y, 0.1, 0, num_classes=3)
    with pytest.raises(ConfigError, match="data.feed: device cannot serve this run: data.augment "
                                          "runs random_crop per example on the host; set "
                                          "data.feed: auto or host"):
        feed.choose(source, cfg("data.feed=device", "data.augment=[{random_crop: {padding: 1}}]").data,
                    None, 2)
