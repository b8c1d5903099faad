"""Small training hooks: checkpoint/resume, preemption, throughput, learning rate.

All counting is in optimizer updates: with gradient accumulation one Keras "batch" is
one update, so `epoch * steps_per_epoch + batch + 1` is `optimizer.iterations` without
reading it back from the device every step.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import tensorflow as tf

from tftrain._keras import keras
from tftrain.optim import current_lr


def random_generators(model) -> list:
    """The random generators of the model's layers (dropout and the like), created now so
    that a checkpoint can hold their state and a resumed run draws the same masks.
    Needs `keras.backend.experimental.enable_tf_random_generator()` before the build."""
    generators = []
    for layer in model._flatten_layers(include_self=False):
        random = getattr(layer, "_random_generator", None)
        if random is not None and hasattr(random, "_maybe_init"):
            random._maybe_init()
            if getattr(random, "_generator", None) is not None:
                generators.append(random._generator)
    return generators


def restore_latest(checkpoint: tf.train.Checkpoint, directory) -> str | None:
    """Restore the newest readable, finite checkpoint in `directory`; returns its path or
    None.

    A checkpoint that cannot be read (truncated or corrupt files, e.g. from a crash
    mid-save) or that holds a NaN or infinity (none is written by tftrain, but a
    checkpoint may come from elsewhere) is skipped with a warning and the previous one is
    used.
    """
    state = tf.train.get_checkpoint_state(str(directory))
    paths = list(state.all_model_checkpoint_paths) if state else []
    for path in reversed(paths):
        try:
            _read_every_tensor(path)      # checks sizes and checksums before anything is set
            checkpoint.restore(path).assert_existing_objects_matched()
            return path
        except (tf.errors.OpError, ValueError, AssertionError, IndexError, OSError) as err:
            warnings.warn(f"checkpoint {path} is unreadable ({type(err).__name__}); "
                          "trying the previous one", stacklevel=2)
    if paths:
        raise RuntimeError(f"no readable checkpoint in {directory}; delete the run directory "
                           "to start over")
    return None


def _read_every_tensor(path: str) -> None:
    reader = tf.train.load_checkpoint(path)
    for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and \
                not np.isfinite(value).all():
            raise ValueError(f"{name} is not finite")


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


class Checkpointer(keras.callbacks.Callback):
    """Saves every `every` training batches, when a stop is asked for (then stops training)
    and at the end; never saves non-finite weights or optimizer state.

    Positions count training batches of the stage (`position`, kept in the checkpoint):
    an update skipped by loss scaling still consumed its batch. A save due on an epoch's
    last batch waits for the epoch's end, after validation and the callbacks before this
    one (plateau, early stopping) have updated their state, so the checkpoint holds it; a
    stop asked for during validation is honoured there too."""

    _supports_tf_logs = True   # reads no logs: batch hooks add no host sync

    def __init__(self, manager: tf.train.CheckpointManager, every: int, steps_per_epoch: int,
                 start_update: int = 0, agree=None, stop=None, position=None):
        """`stop`: the run's `Preemption`. `agree(flag) -> bool`, given for multi-worker
        runs, tells every worker at the same batch whether any worker was asked to stop,
        so all save and stop together. `position`: the int64 variable saved as the
        stage's batch count."""
        super().__init__()
        self.agree, self.stop, self.position = agree, stop, position
        self.manager, self.every, self.steps_per_epoch = manager, max(1, every), steps_per_epoch
        self.update = self.last_saved = start_update
        self.preempted = False
        self._epoch = 0
        self._finite = None

    def resume_at(self, update: int) -> None:
        """Continue counting from `update` (after a rollback)."""
        self.update = self.last_saved = update

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _stop_asked(self) -> bool:
        return self.stop.due(self.agree) if self.stop is not None else False

    def on_train_batch_end(self, batch, logs=None):
        self.update = self._epoch * self.steps_per_epoch + batch + 1
        if batch + 1 >= self.steps_per_epoch:      # the epoch's end decides (after validation)
            return
        self.preempted = self._stop_asked()
        if self.preempted:
            self.save()
            self.model.stop_training = True
        elif self.update // self.every > self.last_saved // self.every:
            self.save()

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
        if self._finite is None:
            floats = [v for v in self.model.variables + list(self.model.optimizer.variables)
                      if v.dtype.is_floating]

            @tf.function
            def finite():
                return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in floats])
            self._finite = finite
        return bool(self._finite())


class Throughput(keras.callbacks.Callback):
    """Adds `examples_per_sec` (training examples per second of the epoch) to the logs."""

    _supports_tf_logs = True

    def __init__(self, global_batch: int):
        super().__init__()
        self.global_batch = global_batch
        self.per_epoch: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._first_batch, self._last_batch = time.perf_counter(), None, None

    def on_train_batch_begin(self, batch, logs=None):
        if self._first_batch is None:
            self._first_batch = batch

    def on_train_batch_end(self, batch, logs=None):
        self._last_batch, self._end = batch, time.perf_counter()   # before validation runs

    def on_epoch_end(self, epoch, logs=None):
        if self._last_batch is None or logs is None:
            return
        steps = self._last_batch - self._first_batch + 1
        rate = steps * self.global_batch / (self._end - self._start)
        self.per_epoch.append(rate)
        logs["examples_per_sec"] = rate

    def steady_rate(self) -> float:
        """Median over epochs, leaving out the first (it includes tracing)."""
        rates = sorted(self.per_epoch[1:] or self.per_epoch)
        return rates[len(rates) // 2] if rates else 0.0


class InputWait(keras.callbacks.Callback):
    """Adds `input_wait` to the epoch logs: the fraction of the training calls' wall time
    spent outside the train step itself, i.e. waiting for the next batch plus the call's
    own host overhead (dispatch, the distributed iterator, logs), which is large next to a
    tiny step and shrinks with `train.steps_per_execution`. Warns once when an epoch
    exceeds 20%. Not measured under op determinism (TensorFlow refuses clocks there)."""

    _supports_tf_logs = True
    threshold = 0.2

    def __init__(self):
        super().__init__()
        self.per_epoch: list[float] = []
        self._warned = False

    def on_epoch_begin(self, epoch, logs=None):
        self._calls = 0.0
        self._steps_before = float(self.model.step_seconds.numpy())

    def on_train_batch_begin(self, batch, logs=None):
        self._began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._calls += time.perf_counter() - self._began

    def on_epoch_end(self, epoch, logs=None):
        from tftrain.train_step import op_determinism

        if logs is None or not self._calls or not self.model.time_steps or op_determinism():
            return
        inside = float(self.model.step_seconds.numpy()) - self._steps_before
        wait = min(1.0, max(0.0, 1.0 - inside / self._calls))
        self.per_epoch.append(wait)
        logs["input_wait"] = wait
        if wait > self.threshold and not self._warned:
            self._warned = True
            print(f"tftrain: warning: {wait:.0%} of the training time is spent outside the "
                  "step, waiting for input or in per-step host overhead; cache decoded data "
                  "(data.cache), lighten data.augment, add tf.data service workers "
                  "(data.service), or raise train.steps_per_execution", flush=True)

    def fraction(self) -> float | None:
        """Median over epochs, leaving out the first (it includes tracing); None when
        nothing was measured."""
        values = sorted(self.per_epoch[1:] or self.per_epoch)
        return values[len(values) // 2] if values else None


class FlopsLogger(keras.callbacks.Callback):
    """Adds `model_flops_per_sec` (training FLOPs: 3x the forward pass) and `mfu` (model
    FLOP utilisation against `peak` FLOP/s) to the epoch logs, from `examples_per_sec`
    (so it comes after `Throughput`)."""

    def __init__(self, flops_per_example: float, peak: float):
        super().__init__()
        self.flops_per_example, self.peak = flops_per_example, peak

    def rate(self, examples_per_sec: float) -> float:
        return 3.0 * self.flops_per_example * examples_per_sec

    def utilisation(self, examples_per_sec: float) -> float:
        return self.rate(examples_per_sec) / self.peak if self.peak else 0.0

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and "examples_per_sec" in logs:
            logs["model_flops_per_sec"] = self.rate(logs["examples_per_sec"])
            logs["mfu"] = self.utilisation(logs["examples_per_sec"])


class LearningRateLogger(keras.callbacks.Callback):
    """Adds `lr` (the rate of the next update) to the epoch logs."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = current_lr(self.model.optimizer)


class NonFiniteLoss(Exception):
    """The training loss (or, found before a save, the weights) became NaN or infinite."""

    def __init__(self, update: int, what: str = "loss"):
        super().__init__(f"{what} became non-finite at update {update}")
        self.update = update


class NaNGuard(keras.callbacks.Callback):
    """Raises NonFiniteLoss as soon as the loss is not finite, before anything is saved
    (it must come first among the callbacks). `agree` makes every worker raise together."""

    _supports_tf_logs = True

    def __init__(self, steps_per_epoch: int, agree=None):
        super().__init__()
        self.steps_per_epoch, self.agree = steps_per_epoch, agree

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        bad = not bool(tf.math.is_finite(tf.cast(logs["loss"], tf.float32)))
        if self.agree(bad) if self.agree else bad:
            raise NonFiniteLoss(self._epoch * self.steps_per_epoch + batch + 1)


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
