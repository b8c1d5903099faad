"""Activation recomputation: the same training as without it (weights, batch-norm
statistics, dropout masks), on one device and on mirrored replicas, in float32 and
mixed precision with accumulation; less memory kept."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import load_config
from tftrain.runtime.strategy import build_strategy

from tftrain.core import internals
from tftrain.core.keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.runtime import precision
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel

IMAGES = InputSpec((16, 16, 3), "float32", 10)
TOKENS = InputSpec((12,), "int32", 4, vocab_size=50)


def dropout_resnet(spec):
    """A pre-activation residual net with dropout in every block (randomness and
    batch-norm updates inside recomputed segments)."""
    inputs = keras.Input(spec.shape)
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    for _ in range(4):
        y = keras.layers.BatchNormalization()(x)
        y = keras.layers.ReLU()(y)
        y = keras.layers.Conv2D(8, 3, padding="same")(y)
        y = keras.layers.Dropout(0.3)(y)
        y = keras.layers.BatchNormalization()(y)
        y = keras.layers.Conv2D(8, 3, padding="same")(y)
        x = keras.layers.Add()([x, y])
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))


BUILDERS = {"dropout_resnet": (dropout_resnet, IMAGES),
            "resnet": (lambda s: MODELS.get("resnet")(s, depth=8, width=8), IMAGES),
            "transformer": (lambda s: MODELS.get("transformer")(
                s, embed_dim=16, num_heads=2, num_layers=2, mlp_dim=32, dropout=0.2), TOKENS)}


def _data(spec, n, seed=0):
    rng = np.random.default_rng(seed)
    if spec.dtype == "int32":
        x = rng.integers(1, 50, (n, *spec.shape)).astype(np.int32)
    else:
        x = rng.normal(size=(n, *spec.shape)).astype(np.float32)
    return x, rng.integers(0, spec.num_classes, n).astype(np.int32)


def train(model, recompute, strategy=None, accumulation=1, policy="float32", steps=4,
          batch=16):
    """(weights, non-trainable weights, generator states) after `steps` SGD updates from
    the same initial weights."""
    strategy = strategy or tf.distribute.OneDeviceStrategy("/cpu:0")
    precision.apply_policy(policy)
    with tf_random_generators():
        builder, spec = BUILDERS[model]
        x, y = _data(spec, batch * steps)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            net = TrainModel.wrap(precision.float32_outputs(builder(spec)), accumulation,
                                  recompute=recompute)
            net.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                        build_loss("sparse_categorical_crossentropy"))
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
        net.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
        generators = [g.state.numpy() for g in (internals.random_generator(layer)
                                                for layer in internals.all_layers(net))
                      if g is not None]
        precision.apply_policy("float32")
        return ([w.numpy() for w in net.trainable_weights],
                [w.numpy() for w in net.non_trainable_weights], generators, net)


@contextlib.contextmanager
def tf_random_generators():
    """Dropout drawing from `tf.random.Generator`s (as `tftrain.plan` sets for a run),
    for this test only: the switch is the process's, and the tests sharing this process
    build models without it."""
    before = keras.backend.experimental.is_tf_random_generator_enabled()
    keras.backend.experimental.enable_tf_random_generator()
    try:
        yield
    finally:
        precision.apply_policy("float32")
        if not before:
            keras.backend.experimental.disable_tf_random_generator()


def assert_same(a, b, rtol):
    """Each tensor within `rtol` of the reference, relative to its norm (a transformer
    accumulating in a loop rounds a few sums differently: 1e-7 of a weight's norm)."""
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        assert np.linalg.norm(wa - wb) <= rtol * max(float(np.linalg.norm(wb)), 1e-30)


@pytest.mark.parametrize("model,recompute", [("dropout_resnet", ("blocks", None)),
                                             ("dropout_resnet", ("every", 3)),
                                             ("resnet", ("blocks", None)),
                                             ("transformer", ("blocks", None))])
def test_recomputed_training_ends_at_the_same_weights_statistics_and_masks(model, recompute):
    plain, plain_stats, plain_rng, _ = train(model, None)
    again, stats, rng, net = train(model, recompute)
    assert len(net.recompute.segments) > 1 and again       # (at least one recomputed)
    assert_same(again, plain, 1e-6)
    assert bool(stats) == (model != "transformer")
    assert_same(stats, plain_stats, 1e-6)       # batch-norm moving statistics: once a step
    for a, b in zip(rng, plain_rng):            # the generators drew as often
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet", "transformer"])
def test_recompute_on_mirrored_replicas_with_bfloat16_and_accumulation(model):
    """The transformer's layer normalizations in a loop of micro-batches: a segment's first
    run keeps the kernels of the plain step (`recompute._statistics_read`; without it
    oneDNN fused them into one that rounds otherwise: 1e-4 of the weights here)."""
    # the replicas' strategy as a run builds it on CPU devices
    mirrored = build_strategy(load_config(None, ["distribute.strategy=mirrored"]))
    plain, plain_stats, _, _ = train(model, None, mirrored, accumulation=2,
                                     policy="mixed_bfloat16")
    again, stats, _, _ = train(model, ("blocks", None), mirrored, accumulation=2,
                               policy="mixed_bfloat16")
    # the same bfloat16 ops on the same values: equal but for the order XLA-free kernels sum in
    assert_same(again, plain, 1e-6)
    assert_same(stats, plain_stats, 1e-6)


def test_bfloat16_dropout_masks_kept_as_bits_replay_the_same_training():
    """A 16-bit tensor's keep-masks are kept packed to bits (a byte would be half of it):
    the same weights as without recompute."""
    plain, _, _, _ = train("dropout_resnet", None, policy="mixed_bfloat16")
    again, _, _, net = train("dropout_resnet", ("blocks", None), policy="mixed_bfloat16")
    assert len(net.recompute.segments) > 2
    assert_same(again, plain, 1e-6)


def test_a_different_mask_would_be_seen(monkeypatch):
    """The check above can fail, and the recomputation drops what the recorded masks say:
    replayed inverted, they move the weights."""
    from tftrain.training import recompute as module
    replaying = module._replaying

    def inverted(masks):
        flipped = {key: [tf.logical_not(m) if m.dtype == tf.bool else tf.bitwise.invert(m)
                         for m in kept] for key, kept in masks.items()}
        return replaying(flipped)
    plain, _, _, _ = train("dropout_resnet", None)
    monkeypatch.setattr(module, "_replaying", inverted)
    again, _, _, _ = train("dropout_resnet", ("blocks", None))
    with pytest.raises(AssertionError):
        assert_same(again, plain, 1e-6)


def _peak(step) -> int:
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - base


def test_recompute_keeps_less_memory():
    builder, spec = BUILDERS["dropout_resnet"]
    x, y = (tf.constant(a) for a in _data(spec, 64))
    keras.utils.set_random_seed(1)
    with tf_random_generators():
        model = builder(spec)
    loss = build_loss("sparse_categorical_crossentropy")
    peaks = {}
    for how in (None, ("blocks", None)):
        net = TrainModel.wrap(model, recompute=how)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                y_pred = net.recompute(x) if net.recompute else net(x, training=True)
                value = loss(y, y_pred)
            return tape.gradient(value, net.trainable_variables)
        step()
        # the allocator is the process's: what another thread of the process allocates
        # meanwhile (a previous test's input pipeline winding down) only adds to a peak,
        # so the least of five steps is the step's own
        peaks[how] = min(_peak(step) for _ in range(5))
    assert peaks[("blocks", None)] < 0.7 * peaks[None], peaks


@pytest.mark.parametrize("shape", [(3, 5, 7), (16,), (2, 4, 8, 8)])
def test_a_mask_packed_to_bits_unpacks_to_itself(shape):
    from tftrain.training.recompute import _packed, _unpacked
    mask = tf.constant(np.random.default_rng(0).random(shape) < 0.3)
    packed = _packed(mask)
    assert packed.dtype == tf.uint8 and packed.shape == (-(-int(np.prod(shape)) // 8),)
    np.testing.assert_array_equal(_unpacked(packed, tf.constant(shape)).numpy(), mask.numpy())
