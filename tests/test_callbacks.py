"""Training hooks: resume point, checkpoint cadence, throughput, learning rate."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain._keras import keras
from tftrain.callbacks import Checkpointer, NonFiniteLoss, ResumePoint
from tftrain.epoch_logs import LearningRateLogger, Throughput


def tiny():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def fit(model, callbacks, epochs=2, steps=5, start=0):
    x, y = np.ones((10, 3), np.float32), np.zeros((10, 2), np.float32)
    model._training_state = ResumePoint(start)
    history = model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(), epochs=epochs,
                        steps_per_epoch=steps, callbacks=callbacks, verbose=0)
    model._training_state = None
    return history


def test_resume_point_maps_updates_to_epoch_and_step():
    assert ResumePoint(23).maybe_load_initial_counters_from_ckpt(10, 0) == (2, 3)


def test_fit_resumes_mid_epoch_and_runs_only_the_rest(tmp_path):
    model = tiny()
    fit(model, [], epochs=3, steps=5, start=7)
    assert int(model.optimizer.iterations.numpy()) == 15 - 7


def test_checkpoint_every_n_updates_and_at_end(tmp_path):
    model = tiny()
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=10)
    fit(model, [Checkpointer(manager, every=4, steps_per_epoch=5)], epochs=2, steps=5)
    numbers = sorted(int(p.name.split("-")[1].split(".")[0]) for p in tmp_path.glob("ckpt-*.index"))
    assert numbers == [4, 8, 10]


def test_throughput_and_lr_logged():
    model = tiny()
    throughput = Throughput(global_batch=10)
    history = fit(model, [throughput, LearningRateLogger()], epochs=3)
    assert len(throughput.per_epoch) == 3 and all(r > 0 for r in throughput.per_epoch)
    assert history.history["lr"] == [0.10000000149011612] * 3
    assert throughput.steady_rate() in throughput.per_epoch[1:]


def _saved_twice(tmp_path):
    model = tiny()
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=3)
    fit(model, [], epochs=1, steps=2)
    first = manager.save(checkpoint_number=2)
    weights = [w.copy() for w in model.get_weights()]
    fit(model, [], epochs=1, steps=3)
    latest = manager.save(checkpoint_number=5)
    return first, latest, weights


def test_truncated_latest_checkpoint_falls_back_to_previous(tmp_path):
    from tftrain.callbacks import restore_latest
    first, latest, weights = _saved_twice(tmp_path)
    data = tmp_path / f"{latest.split('/')[-1]}.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])      # crash mid-save
    fresh = tiny()
    checkpoint = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer)
    with pytest.warns(UserWarning, match="unreadable"):
        assert restore_latest(checkpoint, tmp_path) == first
    for a, b in zip(fresh.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    assert int(fresh.optimizer.iterations.numpy()) == 2


def test_no_readable_checkpoint_is_an_error(tmp_path):
    from tftrain.callbacks import restore_latest
    _saved_twice(tmp_path)
    for index in tmp_path.glob("*.index"):
        index.write_bytes(b"garbage")
    fresh = tiny()
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="no readable checkpoint"):
        restore_latest(tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer), tmp_path)
    assert restore_latest(tf.train.Checkpoint(model=fresh), tmp_path / "empty") is None


def manager_in(path):
    return tf.train.CheckpointManager(tf.train.Checkpoint(), str(path), max_to_keep=1)


def test_nan_check_raises_with_the_update(tmp_path):

    model = tiny()
    model.optimizer.learning_rate = 1e30                  # diverges to inf/nan within steps
    with pytest.raises(NonFiniteLoss) as info:
        fit(model, [Checkpointer(manager_in(tmp_path), every=100, steps_per_epoch=5)],
            epochs=3, steps=5)
    assert 1 <= info.value.update <= 15


def test_a_non_finite_update_on_a_checkpoint_boundary_is_never_saved(tmp_path):

    model = tiny()
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=10)
    fit(model, [Checkpointer(manager, every=1, steps_per_epoch=5)], epochs=1, steps=2)
    # The loss of update 3 is finite (it is computed with the weights before the update);
    # the update itself makes every weight infinite, and update 3 is a checkpoint boundary.
    model.optimizer.learning_rate.assign(np.float32(3e38))
    model.optimizer.learning_rate.assign(model.optimizer.learning_rate * 10)      # inf
    saver = Checkpointer(manager, every=1, steps_per_epoch=5, start_update=2)
    with pytest.raises(NonFiniteLoss, match="the weights or optimizer state became non-finite "
                                            "at update 3"):
        fit(model, [saver], epochs=1, steps=5, start=2)
    assert not np.isfinite(model.get_weights()[0]).all()
    numbers = sorted(int(p.name.split("-")[1].split(".")[0]) for p in tmp_path.glob("ckpt-*.index"))
    assert numbers == [1, 2]
    for number in numbers:
        reader = tf.train.load_checkpoint(str(tmp_path / f"ckpt-{number}"))
        assert all(np.isfinite(reader.get_tensor(n)).all()
                   for n in reader.get_variable_to_shape_map() if n.startswith("model/"))


def test_restore_skips_a_checkpoint_holding_non_finite_weights(tmp_path):
    from tftrain.callbacks import restore_latest
    model = tiny()
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=5)
    good = manager.save(checkpoint_number=1)
    kept = [w.copy() for w in model.get_weights()]
    model.layers[0].kernel.assign(tf.fill(model.layers[0].kernel.shape, np.nan))
    manager.save(checkpoint_number=2)               # written by something other than tftrain
    fresh = tiny()
    with pytest.warns(UserWarning, match=r"ckpt-2 is unreadable \(ValueError\)"):
        assert restore_latest(tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer),
                              tmp_path) == good
    for a, b in zip(fresh.get_weights(), kept):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make", ["early_stopping", "plateau"])
def test_plateau_and_early_stopping_counters_survive_a_restart(tmp_path, make):
    from tftrain.callbacks import EarlyStopping, ReduceLROnPlateau

    def callback(model):
        if make == "early_stopping":
            return EarlyStopping(model, monitor="loss", patience=50, min_delta=10.0,
                                 restore_best_weights=True)
        return ReduceLROnPlateau(monitor="loss", patience=50, min_delta=10.0)

    model = tiny()
    first = callback(model)
    fit(model, [first], epochs=3)          # min_delta 10: no epoch improves after the first
    assert first.wait == 2 and np.isfinite(first.best)
    ckpt = tf.train.Checkpoint(model=model, callbacks=[first.state])
    path = ckpt.save(str(tmp_path / "ckpt"))
    again = tiny()
    second = callback(again)
    tf.train.Checkpoint(model=again, callbacks=[second.state]).restore(path)
    second.set_model(again)
    second.on_train_begin()                    # Keras resets here; the saved state wins
    assert (second.wait, second.best) == (first.wait, pytest.approx(first.best))
    if make == "early_stopping":
        for a, b in zip(second.best_weights, first.best_weights):
            np.testing.assert_array_equal(a, b)
    fresh = callback(tiny())
    fresh.set_model(again)
    fresh.on_train_begin()
    assert fresh.wait == 0                     # nothing saved: Keras' own reset


def _host_bound(steps_per_execution="auto"):
    """A tiny TrainModel whose steps are far shorter than the host's work per call."""
    from tftrain.train_step import TrainModel
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model = TrainModel.wrap(base)
    model.resizable_calls = steps_per_execution == "auto"
    model.compile(keras.optimizers.SGD(0.1), "mse",
                  steps_per_execution=1 if steps_per_execution == "auto" else steps_per_execution)
    return model


def test_execution_sizer_keeps_host_work_under_two_percent_of_step_time():
    import math
    from tftrain.epoch_logs import ExecutionSizer
    model = _host_bound()
    sizer = ExecutionSizer(steps_per_epoch=40)
    fit(model, [sizer], epochs=3, steps=40)
    assert sizer.chosen is not None and sizer.chosen > 1      # host-bound: more steps per call
    want = math.ceil(sizer.host_seconds / (0.02 * sizer.step_seconds))
    assert sizer.chosen == max(1, min(want, int(sizer.max_seconds // sizer.step_seconds), 40))
    assert int(model.steps_per_execution.numpy()) == sizer.chosen
    assert int(model.optimizer.iterations.numpy()) == 3 * 40        # no step lost or added


def test_execution_sizer_takes_the_value_the_workers_agree_on():
    from tftrain.epoch_logs import ExecutionSizer
    proposals = []

    def mean(values):               # another worker proposed 3 more steps per call
        proposals.append(values[0])
        return [values[0] + 1.5]

    sizer = ExecutionSizer(steps_per_epoch=40, mean=mean, most=30)
    fit(_host_bound(), [sizer], epochs=2, steps=40)
    assert len(proposals) == 1 and proposals[0] <= 30
    assert sizer.chosen == int(np.ceil(proposals[0] + 1.5))


def test_execution_sizer_never_exceeds_the_checkpoint_interval():
    from tftrain.epoch_logs import ExecutionSizer
    model = _host_bound()
    sizer = ExecutionSizer(steps_per_epoch=40, most=5)
    fit(model, [sizer], epochs=2, steps=40)
    assert sizer.chosen == 5 < int(np.ceil(sizer.host_seconds / (0.02 * sizer.step_seconds)))


def test_checks_are_batched_every_n_updates_and_at_epoch_ends(tmp_path):
    model = tiny()
    saver = Checkpointer(manager_in(tmp_path), every=100, steps_per_epoch=10, check_every=4)
    fit(model, [saver], epochs=2, steps=10)
    # batch ends at updates 4, 8, 10 (an epoch's last), 12, 16, 20; one at each epoch end
    assert saver.checks == 6 + 2


def test_a_non_finite_loss_between_checks_is_caught_at_the_next_one(tmp_path):
    model = tiny()

    class Diverge(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:          # update 5: every later loss is infinite
                self.model.optimizer.learning_rate.assign(1e30)

    saver = Checkpointer(manager_in(tmp_path), every=100, steps_per_epoch=10, check_every=4)
    with pytest.raises(NonFiniteLoss, match="loss became non-finite by update 8"):
        fit(model, [Diverge(), saver], epochs=1, steps=10)


def test_checks_agree_on_both_flags_in_one_call(tmp_path):
    from tftrain.preemption import Preemption
    calls = []

    def agree(*flags):          # another worker was asked to stop: the stop flag is set
        calls.append(flags)
        return (flags[0], True) if len(flags) > 1 else True

    model = tiny()
    saver = Checkpointer(manager_in(tmp_path), every=100, steps_per_epoch=10, agree=agree,
                         stop=Preemption(), check_every=3)
    fit(model, [saver], epochs=1, steps=10)
    assert calls[0] == (False, False)          # (non-finite loss, stop) in one exchange
    assert saver.preempted and int(model.optimizer.iterations.numpy()) == 3   # stopped at 3


def test_global_metrics_log_every_replica_while_the_step_logs_its_own():
    from tftrain.epoch_logs import GlobalMetrics
    from tftrain.train_step import TrainModel, build_loss
    # no collectives (see tests/test_xla.py's `mirrored`)
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
