"""Per-epoch measurement and logging: throughput, learning rate, steps per call, global metrics."""
import math

import numpy as np
import pytest
import tensorflow as tf

from helpers import fit, tiny
from tftrain.core.keras import keras
from tftrain.training.epoch_logs import (ExecutionSizer, GlobalMetrics, LearningRateLogger,
                                         Throughput, validated)
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel


def test_throughput_and_lr_logged():
    model = tiny()
    throughput = Throughput(global_batch=10)
    history = fit(model, [throughput, LearningRateLogger()], epochs=3)
    assert len(throughput.per_epoch) == 3 and all(r > 0 for r in throughput.per_epoch)
    assert history.history["lr"] == [0.10000000149011612] * 3
    assert throughput.steady_rate() in throughput.per_epoch[1:]


def _host_bound(steps_per_execution="auto"):
    """A tiny TrainModel whose steps are far shorter than the host's work per call."""
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model = TrainModel.wrap(base)
    model.resizable_calls = steps_per_execution == "auto"
    model.compile(keras.optimizers.SGD(0.1), "mse",
                  steps_per_execution=1 if steps_per_execution == "auto" else steps_per_execution)
    return model


def test_execution_sizer_keeps_host_work_under_two_percent_of_step_time():
    model = _host_bound()
    sizer = ExecutionSizer(steps_per_epoch=40)
    fit(model, [sizer], epochs=3, steps=40)
    assert sizer.chosen is not None and sizer.chosen > 1      # host-bound: more steps per call
    want = math.ceil(sizer.host_seconds / (0.02 * sizer.step_seconds))
    assert sizer.chosen == max(1, min(want, int(sizer.max_seconds // sizer.step_seconds), 40))
    assert int(model.steps_per_execution.numpy()) == sizer.chosen
    assert int(model.optimizer.iterations.numpy()) == 3 * 40        # no step lost or added


def test_execution_sizer_takes_the_value_the_workers_agree_on():
    proposals = []

    def mean(values):               # another worker proposed 3 more steps per call
        proposals.append(values[0])
        return [values[0] + 1.5, values[1]]     # (and whether a trace pays: as this one)

    sizer = ExecutionSizer(steps_per_epoch=40, mean=mean, most=30)
    fit(_host_bound(), [sizer], epochs=2, steps=40)
    assert len(proposals) == 1 and proposals[0] <= 30
    assert sizer.chosen == int(np.ceil(proposals[0] + 1.5))


def test_execution_sizer_never_exceeds_the_checkpoint_interval():
    model = _host_bound()
    sizer = ExecutionSizer(steps_per_epoch=40, most=5)
    fit(model, [sizer], epochs=2, steps=40)
    assert sizer.chosen == 5 < int(np.ceil(sizer.host_seconds / (0.02 * sizer.step_seconds)))


class _Settling:
    """What `ExecutionSizer._choose` touches of a model: its steps per call, and the
    trace without the loop (`TrainModel.settle_calls`), counted."""

    def __init__(self):
        self.steps_per_execution, self.settled = tf.Variable(4), []

    def settle_calls(self, steps):
        self.settled.append(steps)


def test_a_call_settled_at_one_step_is_traced_again_only_where_the_steps_left_pay_for_it():
    """Settled at one step a call, the loop costs about `LOOP_SHARE` of each step left;
    a trace costs the first call's seconds (less a step). A smoke run's last update, or a
    short stage's, keeps the loop; a long one is traced without it; in a cluster the
    workers' mean decides, so every worker traces alike."""
    def chosen(remaining, first_call=5.0, step=0.1, mean=None):
        sizer = ExecutionSizer(steps_per_epoch=40, mean=mean)
        model = _Settling()
        sizer.set_model(model)
        sizer._first_call = first_call
        sizer._choose(host=0.0, step=step, remaining=remaining)
        assert sizer.chosen == 1 == int(model.steps_per_execution.numpy())
        assert sizer.retraced == bool(model.settled)
        return sizer.retraced
    # a trace of 4.9 s against 0.02 x 0.1 s a step: it pays from 2,450 steps on
    assert not chosen(1) and not chosen(2_450) and chosen(2_451)
    assert chosen(None)                                   # steps left unknown: as before
    assert chosen(10, first_call=0.1)                     # a trace cheaper than a step
    agreed = []

    def mean(values):                                     # the other worker's trace is dear
        agreed.append(values)
        return [values[0], (values[1] + 0.0) / 2 - 0.1]
    assert not chosen(10**6, mean=mean) and agreed == [[1.0, 1.0]]


def test_global_metrics_log_every_replica_while_the_step_logs_its_own():
    # no collectives (see tests/training/test_xla.py's `mirrored`)
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 3)).astype(np.float32), rng.integers(0, 2, 256)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    def history(local: bool):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = TrainModel.wrap(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
            model.compile(keras.optimizers.SGD(0.1), build_loss("sparse_categorical_crossentropy"),
                          metrics=["accuracy"])
        if local:
            model.log_local_metrics()
        steps = []

        class Seen(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                steps.append(float(logs["loss"]))
        got = model.fit(ds, epochs=2, validation_data=ds, verbose=0,
                        callbacks=[GlobalMetrics(), Seen()] if local else [Seen()])
        return got.history, steps

    synced, synced_steps = history(False)
    local, local_steps = history(True)
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(local[key], synced[key], rtol=1e-6)
    # the step's own logs are one replica's (16 of 32 examples): not the global values
    assert not np.allclose(local_steps, synced_steps, rtol=1e-6)


def test_a_stage_takes_its_last_epochs_validation_unless_weights_were_set_after_it():
    """`validated`: fit's last epoch validated the model as it ends the stage, so the
    stage does not evaluate it again; unless early stopping restores its best weights
    (then the model is not the one last validated), or fit did not run (no history)."""
    model = _host_bound(1)
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(64, 2)).astype(np.float32)
    history = model.fit(x, y, validation_data=(x[:16], y[:16]), epochs=2, verbose=0).history
    again = model.evaluate(x[:16], y[:16], return_dict=True, verbose=0)
    found = validated(history, [])
    assert found.keys() == {"val_loss", "val_mae"}
    assert found == pytest.approx({f"val_{k}": v for k, v in again.items()}, rel=1e-6)
    best = keras.callbacks.EarlyStopping(restore_best_weights=True)
    assert validated(history, [best]) is None and validated({}, []) is None
    assert validated(history, [keras.callbacks.EarlyStopping()]) == found

