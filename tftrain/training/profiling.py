"""`--profile START:STOP`: a TensorFlow profiler trace of training updates START to STOP
(0-based, STOP excluded) of the first stage, written on the chief into the run's
`tensorboard/` (`plugins/profile/<time>/<host>.xplane.pb`), where TensorBoard's profile
plugin (`pip install -e ".[profile]"`, xprof) shows it.

Updates run several per call (`train.steps_per_execution`): the trace starts before the
call holding START and stops after the call holding STOP - 1, so it covers at least the
asked updates. No callback work happens per step when no profile is asked.
"""
from __future__ import annotations

from tftrain.training.device_logs import DeviceLogsCallback
from tftrain.config import ConfigError
from tftrain.core import internals
import tensorflow as tf


def parse_window(text: str) -> tuple[int, int]:
    """"5:15" -> (5, 15); a clear error naming the flag otherwise."""
    try:
        start, stop = (int(part) for part in str(text).split(":"))
    except ValueError:
        raise ConfigError(f"--profile: {text!r} is not START:STOP (updates, e.g. 5:15)") from None
    if not 0 <= start < stop:
        raise ConfigError(f"--profile: {text!r}: need 0 <= START < STOP (updates, e.g. 5:15)")
    return start, stop


class ProfileWindow(DeviceLogsCallback):
    """Starts the profiler before the call that runs update `start` and stops it after
    the call that runs update `stop - 1`; updates count from the stage's start."""

    def __init__(self, start: int, stop: int, logdir: str, steps_per_epoch: int):
        super().__init__()
        self.start, self.stop, self.logdir = start, stop, logdir
        self.steps_per_epoch, self.epoch, self.running, self.done = steps_per_epoch, 0, False, False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):

        first = self.epoch * self.steps_per_epoch + batch
        if not (self.running or self.done) and first + self._per_call() > self.start \
                and first < self.stop:
            tf.profiler.experimental.start(self.logdir)
            self.running = True

    def on_train_batch_end(self, batch, logs=None):
        # Keras passes the call's last step here
        if self.running and self.epoch * self.steps_per_epoch + batch + 1 >= self.stop:
            self._finish()

    def on_train_end(self, logs=None):
        if self.running:
            self._finish()

    def _per_call(self) -> int:
        """Updates per call now (`train.steps_per_execution`; auto sizing changes it)."""
        return max(1, int(internals.steps_per_execution(self.model).numpy()))

    def _finish(self):

        tf.profiler.experimental.stop()
        self.running, self.done = False, True
