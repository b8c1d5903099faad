"""The train step: data-parallel and accumulated updates equal large-batch updates."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain._keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.train_step import TrainModel, build_loss

SPEC = InputSpec((8, 8, 1), "float32", 10)


def _data(n=640, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def train_weights(strategy, global_batch, accumulation=1, steps=10, optimizer="sgd", model="mlp"):
    """Weights after `steps` updates of `global_batch` examples from the same init."""
    x, y = _data(global_batch * steps)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        net = TrainModel.wrap(MODELS.get(model)(SPEC), accumulation)
        opt = (keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd"
               else keras.optimizers.Adam(0.01))
        net.compile(opt, build_loss("sparse_categorical_crossentropy"), metrics=["accuracy"])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    history = net.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    return [w.copy() for w in net.get_weights()], int(net.optimizer.iterations.numpy()), history


def one_device():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def assert_weights_close(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        np.testing.assert_allclose(wa, wb, rtol=rtol, atol=atol)


def test_mirrored_two_replicas_equals_one_device_double_batch():
    ref, ref_steps, _ = train_weights(one_device(), 64)
    got, steps, _ = train_weights(mirrored(), 64)      # 32 per replica x 2 replicas
    assert ref_steps == steps == 10
    assert_weights_close(got, ref)
    init, _, _ = train_weights(one_device(), 64, steps=1)
    assert max(np.max(np.abs(a - b)) for a, b in zip(init, ref)) > 1e-3  # training moved them


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_accumulation_equals_large_batch(optimizer):
    ref, ref_steps, _ = train_weights(one_device(), 64, optimizer=optimizer)
    got, steps, _ = train_weights(mirrored(), 64, accumulation=4, optimizer=optimizer)
    assert ref_steps == steps == 10          # iterations count updates, not micro-batches
    assert_weights_close(got, ref)


def test_metrics_cover_every_micro_batch():
    _, _, ref = train_weights(one_device(), 64)
    _, _, got = train_weights(one_device(), 64, accumulation=4)
    np.testing.assert_allclose(got.history["loss"], ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(got.history["accuracy"], ref.history["accuracy"], rtol=1e-6)


def test_non_finite_micro_batch_skips_update_under_float16():
    from tftrain import precision
    from tftrain.config import load_config
    precision.apply_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    with one_device().scope():
        net = TrainModel.wrap(precision.float32_outputs(MODELS.get("mlp")(SPEC)), accumulation_steps=4)
        opt = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16",
                                       load_config().precision)
        net.compile(opt, build_loss("sparse_categorical_crossentropy"))
    x, y = _data(64)
    net.fit(x, y, batch_size=64, epochs=1, verbose=0)         # one good update
    before = [w.copy() for w in net.get_weights()]
    scale = float(opt.loss_scale)
    x[40] = np.inf                                            # micro-batch 2 of 4 goes non-finite
    net.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert_weights_close(net.get_weights(), before, rtol=0, atol=0)
    assert float(opt.loss_scale) == scale / 2


def test_schedule_position_counts_updates_not_micro_batches():
    from tftrain.optim import Warmup, Constant, current_lr
    rates = []
    for accumulation in (1, 4):
        keras.utils.set_random_seed(1)
        net = TrainModel.wrap(MODELS.get("mlp")(SPEC), accumulation)
        net.compile(keras.optimizers.SGD(Warmup(Constant(0.1), 20, 0.1)),
                    build_loss("sparse_categorical_crossentropy"))
        x, y = _data(64 * 7)
        net.fit(x, y, batch_size=64, epochs=1, verbose=0)
        rates.append((int(net.optimizer.iterations.numpy()), current_lr(net.optimizer)))
    assert rates[0] == rates[1] == (7, pytest.approx(0.1 * 8 / 20))
