"""Weight averaging (EMA): the recurrence, once per update made, per replica, applied."""
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.optim.averaging import WeightAverage
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel

SPEC = InputSpec((8, 8, 1), "float32", 10)


def averaged_training(strategy, updates=6, decay=0.9, accumulation=2):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * updates, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, len(x))
    with strategy.scope():
        net = MODELS.get("cnn")(SPEC, filters=[4], dense=[8])
        average = WeightAverage(net, decay)
        model = TrainModel.wrap(net, accumulation, update_hooks=[average])
        model.compile(keras.optimizers.SGD(0.1), build_loss("sparse_categorical_crossentropy"))
    seen = [[w.numpy().copy() for w in average.weights]]
    probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(
        [w.numpy().copy() for w in average.weights]))
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0,
              callbacks=[probe])
    return average, seen


def expected(seen, decay):
    ema = [w.copy() for w in seen[0]]
    for n, weights in enumerate(seen[1:], start=1):
        d = min(decay, (1 + n) / (10 + n))
        ema = [d * a + (1 - d) * w for a, w in zip(ema, weights)]
    return ema


def test_the_average_follows_the_recurrence_under_replicas_and_accumulation():
    # reduction to one device, as the pipeline uses on CPUs (collectives keyed per strategy
    # collide between strategies made in one process)
    average, seen = averaged_training(tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()))
    assert int(average.count.numpy()) == 6
    for got, want in zip(average.averages, expected(seen, 0.9)):
        for replica in got.values:              # every replica's copy alike
            np.testing.assert_allclose(replica.numpy(), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(average.averages[0].numpy(), seen[-1][0])    # not just the weights
    average.apply()
    for got, avg in zip(average.weights, average.averages):
        np.testing.assert_array_equal(got.numpy(), avg.numpy())


def test_a_skipped_update_leaves_the_average_alone():
    from tftrain.runtime import precision
    from tftrain.config import load_config
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        mixed = precision.Precision(policy="mixed_float16", config=load_config().precision)
        net = precision.float32_outputs(MODELS.get("mlp")(SPEC, hidden=[8]))
        average = WeightAverage(net, 0.5)
        model = TrainModel.wrap(net, 1, update_hooks=[average], precision=mixed)
        model.compile(mixed.wrap_optimizer(keras.optimizers.SGD(0.1)),
                      build_loss("sparse_categorical_crossentropy"))
        x, y = np.ones((8, 8, 8, 1), np.float32), np.zeros(8, np.int64)
        model.fit(x, y, batch_size=8, verbose=0)
        before = [a.numpy().copy() for a in average.averages]
        assert int(average.count.numpy()) == 1
        x[3] = np.inf                            # the update is skipped by loss scaling
        model.fit(x, y, batch_size=8, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 1 == int(average.count.numpy())
        for a, b in zip(average.averages, before):
            np.testing.assert_array_equal(a.numpy(), b)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_batch_norm_statistics_are_averaged_too():
    keras.utils.set_random_seed(0)
    net = MODELS.get("resnet")(InputSpec((8, 8, 3), "float32", 10), depth=8)
    average = WeightAverage(net, 0.99)
    names = {w.name for w in average.weights}
    assert any("moving_mean" in n for n in names) and any("moving_variance" in n for n in names)
    assert len(average.weights) == len([w for w in net.weights if w.dtype.is_floating])


@pytest.mark.parametrize("decay", [0.0, 1.0])
def test_decay_must_be_between_0_and_1(decay):
    from tftrain.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"train\.ema\.decay: "):
        load_config(None, [f"train.ema={{decay: {decay}}}"])


@pytest.mark.parametrize("mirrored,count", [(False, 4), (True, 4), (True, 12)])
def test_batch_norm_statistics_are_re_estimated_for_the_averaged_weights(mirrored, count):
    """The plain mean of each batch's statistics, over 4 batches (run eagerly) and 12 (past
    `EAGER_BATCHES`, through one traced function)."""
    from tftrain.optim.averaging import recalibrate_batch_norm
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()) \
        if mirrored else tf.distribute.get_strategy()
    with strategy.scope():
        inputs = keras.Input((3,))
        bn = keras.layers.BatchNormalization(momentum=0.99)
        model = keras.Model(inputs, bn(inputs))
    rng = np.random.default_rng(0)
    batches = [rng.normal(loc=i, scale=1 + i, size=(16, 3)).astype(np.float32)
               for i in range(count)]
    # each replica reads and updates its own copies: no statistic is reduced across the
    # replicas (under MultiWorkerMirrored, a collective per variable and batch)
    reduced, reduce_to = [], type(strategy.extended)._reduce_to

    def counted(self, *args, **kwargs):
        reduced.append(args)
        return reduce_to(self, *args, **kwargs)
    with mock.patch.object(type(strategy.extended), "_reduce_to", counted):
        assert recalibrate_batch_norm(model, [(b, None) for b in batches]) == count
    assert reduced == []
    means = np.mean([b.mean(0) for b in batches], axis=0)
    variances = np.mean([b.var(0) for b in batches], axis=0)     # as Keras keeps them
    for variable in ([bn.moving_mean] if not mirrored else bn.moving_mean.values):
        np.testing.assert_allclose(np.asarray(variable), means, rtol=1e-5)
    np.testing.assert_allclose(bn.moving_variance.numpy(), variances, rtol=1e-4)
    assert bn.momentum == 0.99
    assert recalibrate_batch_norm(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                                  [batches[0]]) == 0


def test_frozen_batch_norm_keeps_its_statistics():
    from tftrain.optim.averaging import has_batch_norm, recalibrate_batch_norm
    inputs = keras.Input((3,))
    frozen, live = keras.layers.BatchNormalization(), keras.layers.BatchNormalization()
    model = keras.Model(inputs, live(frozen(inputs)))
    frozen.moving_mean.assign([1.0, 2.0, 3.0])
    frozen.trainable = False
    batch = np.random.default_rng(1).normal(size=(8, 3)).astype(np.float32)
    assert has_batch_norm(model) and recalibrate_batch_norm(model, [batch]) == 1
    np.testing.assert_array_equal(frozen.moving_mean.numpy(), [1.0, 2.0, 3.0])
    expected = (batch - [1.0, 2.0, 3.0]) / np.sqrt(1.0 + frozen.epsilon)   # frozen: inference
    np.testing.assert_allclose(live.moving_mean.numpy(), expected.mean(0), rtol=1e-4, atol=1e-6)
