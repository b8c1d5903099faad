"""Training hooks: resume point, checkpoint cadence, throughput, learning rate."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain._keras import keras
from tftrain.callbacks import Checkpointer, LearningRateLogger, ResumePoint, Throughput


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


def test_nan_guard_raises_with_the_update():
    from tftrain.callbacks import NaNGuard, NonFiniteLoss
    model = tiny()
    model.optimizer.learning_rate = 1e30                  # diverges to inf/nan within steps
    with pytest.raises(NonFiniteLoss) as info:
        fit(model, [NaNGuard(steps_per_epoch=5)], epochs=3, steps=5)
    assert 1 <= info.value.update <= 15
