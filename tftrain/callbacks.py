"""Small training hooks: checkpoint/resume, preemption, throughput, learning rate.

All counting is in optimizer updates: with gradient accumulation one Keras "batch" is
one update, so `epoch * steps_per_epoch + batch + 1` is `optimizer.iterations` without
reading it back from the device every step.
"""
from __future__ import annotations

import signal
import time
import warnings

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
    """Restore the newest readable checkpoint in `directory`; returns its path or None.

    A checkpoint that cannot be read (truncated or corrupt files, e.g. from a crash
    mid-save) is skipped with a warning and the previous one is used.
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
        reader.get_tensor(name)


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
    """Saves every `every` updates, on SIGTERM (then stops training) and at the end."""

    _supports_tf_logs = True   # reads no logs: batch hooks add no host sync

    def __init__(self, manager: tf.train.CheckpointManager, every: int, steps_per_epoch: int,
                 start_update: int = 0, agree=None):
        """`agree(flag) -> bool`, given for multi-worker runs, tells every worker at the same
        update whether any worker was asked to stop, so all save and stop together."""
        super().__init__()
        self.agree = agree
        self.manager, self.every, self.steps_per_epoch = manager, max(1, every), steps_per_epoch
        self.update = self.last_saved = start_update
        self.preempted = self._signaled = False
        self._epoch = 0
        self._previous_handler = None

    def on_train_begin(self, logs=None):
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self._previous_handler is None:     # a retried fit keeps the original one
            self._previous_handler = previous

    def resume_at(self, update: int) -> None:
        """Continue counting from `update` (after a rollback)."""
        self.update = self.last_saved = update

    def _on_sigterm(self, signum, frame):
        self._signaled = True    # only the handler writes it, so no signal is lost

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.update = self._epoch * self.steps_per_epoch + batch + 1
        self.preempted = self.agree(self._signaled) if self.agree else self._signaled
        if self.preempted:
            self.save()
            self.model.stop_training = True
        elif self.update // self.every > self.last_saved // self.every:
            self.save()

    def on_train_end(self, logs=None):
        if self.update != self.last_saved:
            self.save()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)

    def save(self):
        self.manager.save(checkpoint_number=self.update)
        self.last_saved = self.update


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
    """The training loss became NaN or infinite at `update`."""

    def __init__(self, update: int):
        super().__init__(f"loss became non-finite at update {update}")
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
