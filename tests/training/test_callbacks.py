"""Training hooks: resume point, checkpoint cadence, batched checks, restarts."""
import numpy as np
import pytest
import tensorflow as tf

from helpers import fit, tiny
from tftrain.core.keras import keras
from tftrain.training.callbacks import Checkpointer, NonFiniteLoss, ResumePoint


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
    from tftrain.training.callbacks import restore_latest
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


def test_a_worker_restores_the_checkpoint_the_chief_chose_or_stops_naming_it(tmp_path):
    """A cluster's workers load the chief's choice, not each its own newest: a worker
    whose directory lacks that checkpoint stops with its path instead of training from
    other weights."""
    from tftrain.training.callbacks import checkpoint_number, restore_chosen, restore_latest
    first, latest, weights = _saved_twice(tmp_path / "chief")
    (tmp_path / "worker").mkdir()
    for f in (tmp_path / "chief").glob(f"{first.split('/')[-1]}.*"):   # only the older one
        (tmp_path / "worker" / f.name).write_bytes(f.read_bytes())
    fresh = tiny()
    checkpoint = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer)
    chosen = checkpoint_number(restore_latest(checkpoint, tmp_path / "chief"))
    assert chosen == checkpoint_number(latest) == 5 and checkpoint_number(None) == 0
    with pytest.raises(RuntimeError, match=r"worker 1 cannot read .*worker/ckpt-5, the "
                                           r"checkpoint the chief restored"):
        restore_chosen(checkpoint, tmp_path / "worker", chosen, worker=1)
    other = tiny()
    mine = tf.train.Checkpoint(model=other, optimizer=other.optimizer)
    assert restore_chosen(mine, tmp_path / "chief", chosen) == latest
    for a, b in zip(other.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert restore_chosen(mine, tmp_path / "worker", 0) is None     # the chief had none


def test_no_readable_checkpoint_is_an_error(tmp_path):
    from tftrain.training.callbacks import restore_latest
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
    from tftrain.training.callbacks import restore_latest
    model = tiny()
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, str(tmp_path), max_to_keep=5)
    good = manager.save(checkpoint_number=1)
    kept = [w.copy() for w in model.get_weights()]
    model.layers[0].kernel.assign(tf.fill(model.layers[0].kernel.shape, np.nan))
    manager.save(checkpoint_number=2)               # written by something other than tftrain
    fresh = tiny()
    with pytest.warns(UserWarning, match=r"ckpt-2 is unreadable \(ValueError: .* is not finite\)"):
        assert restore_latest(tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer),
                              tmp_path) == good
    for a, b in zip(fresh.get_weights(), kept):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make", ["early_stopping", "plateau"])
def test_plateau_and_early_stopping_counters_survive_a_restart(tmp_path, make):
    from tftrain.training.callbacks import EarlyStopping, ReduceLROnPlateau

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
    from tftrain.training.preemption import Preemption
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
