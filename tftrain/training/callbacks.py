"""Small training hooks: checkpoint/resume, preemption, throughput, learning rate.

All counting is in optimizer updates: with gradient accumulation one Keras "batch" is
one update, so `epoch * steps_per_epoch + batch + 1` is `optimizer.iterations` without
reading it back from the device every step.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.training.device_logs import DeviceLogsCallback
from tftrain.core import internals


def random_generators(model) -> list:
    """The random generators of the model's layers (dropout and the like), created now so
    that a checkpoint can hold their state and a resumed run draws the same masks.
    Needs `keras.backend.experimental.enable_tf_random_generator()` before the build."""
    found = (internals.random_generator(layer) for layer in internals.all_layers(model))
    return [generator for generator in found if generator is not None]


# what reading a truncated, corrupt, non-finite or mismatched checkpoint raises
UNREADABLE = (tf.errors.OpError, ValueError, AssertionError, IndexError, OSError)


def restore_latest(checkpoint: tf.train.Checkpoint, directory, loss_scale=None,
                   optional=()) -> str | None:
    """Restore the newest readable, finite checkpoint in `directory`; returns its path or
    None.

    A checkpoint that cannot be read (truncated or corrupt files, e.g. from a crash
    mid-save) or that holds a NaN or infinity (none is written by tftrain, but a
    checkpoint may come from elsewhere) is skipped with a warning and the previous one is
    used.

    `loss_scale`: the variables of the optimizer's dynamic loss scale, if it has one. A
    checkpoint written without loss scaling (a float16 all-reduce added on resume)
    restores everything else, and the scale starts from its initial value. (A
    LossScaleOptimizer checkpoints as its inner optimizer plus `loss_scale`, so the
    reverse needs nothing: the scale is left unread.) `optional`: objects a checkpoint
    written by an earlier version may lack (they keep their initial values).
    """
    state = tf.train.get_checkpoint_state(str(directory))
    paths = list(state.all_model_checkpoint_paths) if state else []
    for path in reversed(paths):
        try:
            return restore(checkpoint, path, loss_scale, optional)
        except UNREADABLE as err:
            warnings.warn(f"checkpoint {path} is unreadable ({_reason(err)}); "
                          "trying the previous one", stacklevel=2)
    if paths:
        raise RuntimeError(f"no readable checkpoint in {directory}; delete the run directory "
                           "to start over")
    return None


def restore(checkpoint: tf.train.Checkpoint, path: str, loss_scale=None, optional=()) -> str:
    """Restore the checkpoint at `path` (checked whole and finite first); returns `path`.
    Raises what `restore_latest` skips."""
    names = _read_every_tensor(path)      # sizes and checksums, before anything is set
    status = checkpoint.restore(path)
    unscaled = bool(loss_scale) and not any("loss_scale/" in n for n in names)
    _all_matched_but(status, [*optional, *(loss_scale if unscaled else ())])
    if unscaled:
        print(f"checkpoint {path} was written without loss scaling: its optimizer state "
              "carries over, the loss scale starts from its initial value", flush=True)
    return path


def restore_chosen(checkpoint: tf.train.Checkpoint, directory, chosen: int, loss_scale=None,
                   worker: int = 0, optional=()) -> str | None:
    """Restore checkpoint number `chosen` of `directory` (0: none, a fresh start): what a
    cluster's chief restored, which every other worker must load too (each reading its
    newest could leave workers on different weights). Unreadable here: a RuntimeError
    naming the path (the run stops, exit 1)."""
    if not chosen:
        return None
    path = str(Path(directory) / f"ckpt-{chosen}")
    try:
        return restore(checkpoint, path, loss_scale, optional)
    except UNREADABLE as err:
        raise RuntimeError(f"worker {worker} cannot read {path}, the checkpoint the chief "
                           f"restored ({_reason(err)}); every worker must see the chief's "
                           "checkpoints (a shared run directory)") from None


def checkpoint_number(path: str | None) -> int:
    """The number of a `CheckpointManager` checkpoint path (`.../ckpt-12` -> 12; None -> 0)."""
    return int(path.rsplit("-", 1)[1]) if path else 0


def _reason(err: Exception) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def _all_matched_but(status, allowed) -> None:
    """`status.assert_existing_objects_matched()`, except for the objects in `allowed`."""
    try:
        status.assert_existing_objects_matched()
    except AssertionError:
        if not allowed:
            raise
        unused = internals.unmatched(status)     # what TensorFlow's own check compares
        if any(all(o is not a for a in allowed) for o in unused):
            raise


def _read_every_tensor(path: str) -> list[str]:
    """Read (and check finite) every tensor of a checkpoint; returns their names."""
    reader = tf.train.load_checkpoint(path)
    names = list(reader.get_variable_to_shape_map())
    for name in names:
        value = reader.get_tensor(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and \
                not np.isfinite(value).all():
            raise ValueError(f"{name} is not finite")
    return names


class ResumePoint:
    """Tells `fit` which (epoch, step) to start at, so a resumed run continues mid-epoch.

    tf_keras asks `model._training_state` for its initial counters (the hook that its
    BackupAndRestore callback uses); the data pipeline is built to start at the same
    update, so no batch is skipped or seen twice.
    """

    def __init__(self, start_update: int):
        self.start_update = start_update

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):
        return divmod(self.start_update, steps_per_epoch)


def metric_variables(model) -> dict:
    """The variables of the model's compiled loss and metrics (their running sums and
    counts), by a stable name: what a checkpoint keeps of an epoch in progress."""
    return {f"{i}_{metric.name}_{j}": variable
            for i, metric in enumerate(model.metrics)
            for j, variable in enumerate(metric.variables)}


class CarriedMetrics(keras.callbacks.Callback):
    """Carries an epoch's running training metrics across a restart: a stage resumed
    mid-epoch (`carry`) restored, with its checkpoint, the sums and counts of the epoch's
    batches trained before it; Keras resets the metrics when the epoch begins again, and
    this puts them back, so the epoch's logs cover the whole epoch, as an uninterrupted
    run's do. Read once here, on every worker (a cluster-wide sum), before `fit` resets
    them; the sums are split over this run's replicas again when put back."""

    def __init__(self, model, strategy, carry: bool):
        super().__init__()
        self.values = []
        if carry:
            with strategy.scope():
                self.values = [(v, v.read_value().numpy())
                               for v in metric_variables(model).values()]

    def on_epoch_begin(self, epoch, logs=None):
        for variable, value in self.values:
            variable.assign(value)
        self.values = []


class Checkpointer(DeviceLogsCallback):
    """Saves every `every` training batches, when a stop is asked for (then stops training)
    and at the end; never saves non-finite weights or optimizer state. It also makes the
    run's checks: whether the loss became non-finite and whether a stop was asked for.

    The checks are batched: they are made at the first batch end at or after each multiple
    of `check_every` updates, at each epoch's last batch and before any save; in a cluster
    both flags are agreed on by all workers with one small all-reduce. A step between
    checks costs no host sync and no collective beyond its gradient all-reduce. Keras'
    loss in the logs is the epoch's running mean, so a non-finite loss at any step since
    the epoch began is still seen at the next check; saves check the weights themselves.

    Positions count training batches of the stage (`position`, kept in the checkpoint):
    an update skipped by loss scaling still consumed its batch. A save due on an epoch's
    last batch waits for the epoch's end, after validation and the callbacks before this
    one (plateau, early stopping) have updated their state, so the checkpoint holds it; a
    stop asked for during validation is honoured there too."""

    def __init__(self, manager: tf.train.CheckpointManager, every: int, steps_per_epoch: int,
                 start_update: int = 0, agree=None, stop=None, position=None,
                 check_every: int = 1):
        """`stop`: the run's `Preemption`. `agree(*flags) -> bools`, given for multi-worker
        runs, tells every worker at the same batch whether any worker raised each flag, so
        all save, stop or roll back together. `position`: the int64 variable saved as the
        stage's batch count."""
        super().__init__()
        self.agree, self.stop, self.position = agree, stop, position
        self.manager, self.every, self.steps_per_epoch = manager, max(1, every), steps_per_epoch
        self.check_every = max(1, check_every)
        self.update = self.last_saved = self.last_checked = start_update
        self.preempted = False
        self.checks = 0           # checks made (each one all-reduce in a cluster)
        self.calls = 0            # training calls (steps_per_execution steps each)
        self._epoch = 0

    def resume_at(self, update: int) -> None:
        """Continue counting from `update` (after a rollback)."""
        self.update = self.last_saved = self.last_checked = update

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _flags(self, *local: bool):
        self.checks += 1
        if self.agree is None:
            return local if len(local) > 1 else local[0]
        return self.agree(*local)

    def _stop_asked(self) -> bool:
        return self._flags(self.stop is not None and self.stop.requested is not None)

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1
        self.update = self._epoch * self.steps_per_epoch + batch + 1
        last_of_epoch = batch + 1 >= self.steps_per_epoch
        save_due = self.update // self.every > self.last_saved // self.every
        if not (last_of_epoch or save_due
                or self.update // self.check_every > self.last_checked // self.check_every):
            return
        self.last_checked = self.update
        loss = (logs or {}).get("loss")
        bad = loss is not None and not math.isfinite(float(loss))
        bad, stop = self._flags(bad, self.stop is not None and self.stop.requested is not None)
        if bad:
            raise NonFiniteLoss(self.update)
        if last_of_epoch:                  # the epoch's end decides (after validation)
            return
        self.preempted = stop
        if stop or save_due:
            self.save()
        if stop:
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        self.preempted = self._stop_asked()
        if self.preempted or self.update // self.every > self.last_saved // self.every:
            self.save()
        if self.preempted:
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.update != self.last_saved:
            self.save()

    def save(self):
        if not self._all_finite():
            raise NonFiniteLoss(self.update, "the weights or optimizer state")
        if self.position is not None:
            self.position.assign(self.update)
        self.manager.save(checkpoint_number=self.update)
        self.last_saved = self.update

    def _all_finite(self) -> bool:
        # eagerly, variable by variable: a tf.function over every variable costs a trace
        # (seconds for a large model) that short stages never earn back
        floats = [v for v in self.model.variables + list(self.model.optimizer.variables)
                  if v.dtype.is_floating]
        return all(bool(tf.reduce_all(tf.math.is_finite(v))) for v in floats)


class NonFiniteLoss(Exception):
    """The training loss (or, found before a save, the weights) became NaN or infinite."""

    def __init__(self, update: int, what: str = "loss"):
        # the loss is checked every few updates (`Checkpointer`), the weights at the update
        super().__init__(f"{what} became non-finite {'at' if what != 'loss' else 'by'} "
                         f"update {update}")
        self.update = update


class CheckpointedState:
    """Mixin for a Keras callback whose counters must survive a restart: the attributes
    named in `fields` are copied into variables at each epoch's end (before `Checkpointer`,
    which comes after it, saves them with the stage's checkpoint) and back at the start
    of training, after Keras' own reset. `state` is what goes into the checkpoint."""

    fields: tuple[str, ...] = ()

    def _make_state(self, weights=()) -> None:
        with tf.init_scope():
            self.state = {name: tf.Variable(0.0, dtype=tf.float64, trainable=False, name=name)
                          for name in self.fields}
            self.state["saved"] = tf.Variable(False, trainable=False, name="saved")
            # restore_best_weights: the best weights so far, beside the counters
            self.state["weights"] = [tf.Variable(tf.zeros(w.shape, w.dtype), trainable=False)
                                     for w in weights]
            self.state["has_weights"] = tf.Variable(False, trainable=False)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if bool(self.state["saved"].numpy()):
            for name in self.fields:
                value = float(self.state[name].numpy())
                setattr(self, name, int(value) if isinstance(getattr(self, name), int) else value)
            if bool(self.state["has_weights"].numpy()):
                self.best_weights = [v.numpy() for v in self.state["weights"]]

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        for name in self.fields:
            self.state[name].assign(float(getattr(self, name)))
        self.state["saved"].assign(True)
        best = getattr(self, "best_weights", None)
        if best is not None and self.state["weights"]:
            for variable, value in zip(self.state["weights"], best):
                variable.assign(value)
            self.state["has_weights"].assign(True)


class EarlyStopping(CheckpointedState, keras.callbacks.EarlyStopping):
    """Keras' EarlyStopping with its counters (and best weights) in the checkpoint."""

    fields = ("wait", "best", "stopped_epoch", "best_epoch")

    def __init__(self, model, **kwargs):
        super().__init__(**kwargs)
        self._make_state(model.get_weights() if self.restore_best_weights else ())


class ReduceLROnPlateau(CheckpointedState, keras.callbacks.ReduceLROnPlateau):
    """Keras' ReduceLROnPlateau with its counters in the checkpoint (the learning rate it
    lowers is the optimizer's, saved with it)."""

    fields = ("wait", "best", "cooldown_counter")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._make_state()


def plateau_callback(cfg):
    """ReduceLROnPlateau (its state kept in checkpoints) for the `plateau` schedule (a
    `tftrain.optim.schedules.Schedule`), else None."""
    if cfg.name != "plateau":
        return None
    return ReduceLROnPlateau(monitor=cfg.monitor, factor=cfg.factor, patience=cfg.patience,
                             min_lr=cfg.min_lr, min_delta=cfg.min_delta, verbose=1)
