"""Python's garbage collector while fitting and converting (`tftrain.training.heap`)."""
import gc

import numpy as np
import pytest
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.stages.runner import fit
from tftrain.training import heap


def tiny():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices((x, np.zeros(64, "int32"))).batch(8).repeat()


class Frozen(keras.callbacks.Callback):
    """The number of frozen objects at each training step's end."""

    def __init__(self):
        super().__init__()
        self.counts = []

    def on_train_batch_end(self, batch, logs=None):
        self.counts.append(gc.get_freeze_count())


@pytest.mark.parametrize("steps", [heap.MIN_STEPS - 1, heap.MIN_STEPS])
def test_a_long_fit_freezes_what_lives_after_its_first_call_and_nothing_after(steps):
    model, ds = tiny()
    seen = Frozen()
    fit(model, ds, None, 0, 1, steps, [seen], {"verbose": 0})
    assert len(seen.counts) == steps
    if steps < heap.MIN_STEPS:               # a short fit: nothing frozen
        assert seen.counts == [0] * steps
    else:     # frozen at the first step's end (after this callback), the model in it
        assert seen.counts[0] == 0 and min(seen.counts[1:]) > 10_000
    assert gc.get_freeze_count() == 0


def test_the_callback_leaves_a_fits_logs_on_the_device():
    """Keras copies every call's logs to the host when a callback with batch hooks does
    not take tensors; the freezing callback takes them (it reads none)."""
    callbacks = keras.callbacks.CallbackList([heap.FrozenWhileFitting(heap.MIN_STEPS)],
                                             model=tiny()[0])
    assert callbacks._batch_hooks_support_tf_logs


def test_a_fit_that_raises_leaves_nothing_frozen():
    class Fails(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                assert gc.get_freeze_count() > 0
                raise RuntimeError("a bug in a callback")
    model, ds = tiny()
    with pytest.raises(RuntimeError, match="a bug in a callback"):
        fit(model, ds, None, 0, 1, heap.MIN_STEPS, [Fails()], {"verbose": 0})
    assert gc.get_freeze_count() == 0


def test_objects_made_inside_a_conversion_are_collected_older_ones_passed_over():
    before = len(gc.get_objects())
    with heap.older_objects_frozen():
        assert gc.get_freeze_count() >= before
        made = [[]]
        made[0].append(made)
        del made
        assert gc.collect() >= 2            # the new cycle found and freed
    assert gc.get_freeze_count() == 0
