"""The wait on input, the step's time and the host's overhead per call, measured
(`InputWait`), and the probe it asks where waits are noticeable."""
import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.training.input_wait import InputWait
from tftrain.training.train_step import TrainModel


class _TracesSlowly(TrainModel):
    def train_step(self, data):
        import time
        time.sleep(3.0)          # Python: runs while the step is traced, never when it runs
        return super().train_step(data)


def _waited(model, dataset, epochs, capsys, wait=None):
    wait = wait or InputWait()
    model.fit(dataset, epochs=epochs, steps_per_epoch=10, callbacks=[wait], verbose=0)
    return wait.per_epoch, capsys.readouterr().out


def _model(cls=TrainModel, width=256):
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width), keras.layers.Dense(8)])
    model = cls.wrap(net)
    model.compile(keras.optimizers.SGD(0.0), "mse", steps_per_execution=5)
    return model


DATA = tf.data.Dataset.from_tensors((np.ones((64, 64), np.float32),
                                     np.zeros((64, 8), np.float32))).repeat()


def test_input_wait_leaves_out_the_call_that_traced_the_step(capsys):
    """Tracing and compiling the step (seconds of Python in the first call) is neither
    waiting for input nor the step: the first epoch measures what the second does."""
    wait = InputWait()
    per_epoch, _ = _waited(_model(_TracesSlowly), DATA, 2, capsys, wait)
    assert len(per_epoch) == 2
    # the call that traced slept 3 s: counted, the first epoch's calls would last >= 3 s
    # (and its share of waiting be ~0.99); left out, they are the nine calls after it, as
    # short as the second epoch's ten (the step never sleeps once traced)
    assert wait.call_seconds[0] < 3.0 and wait.call_seconds[1] < 3.0, wait.call_seconds


def test_input_wait_warns_on_steady_epochs_only(capsys):
    """Slow input (50 ms a batch for steps of a few ms) warns once, from the second epoch
    (the first also warms up and sizes the calls; a one-epoch run never warns)."""
    def slow(a, b):
        import time
        time.sleep(0.05)
        return a, b
    slow_input = DATA.map(lambda a, b: tf.numpy_function(slow, [a, b], [tf.float32, tf.float32]))
    per_epoch, out = _waited(_model(), slow_input, 1, capsys)
    assert per_epoch[0] > 0.5 and "warning" not in out, (per_epoch, out)
    per_epoch, out = _waited(_model(), slow_input, 3, capsys)
    assert min(per_epoch[1:]) > 0.5 and out.count("tftrain: warning: ") == 1, (per_epoch, out)
    assert "the steps wait for input" in out


def test_input_wait_under_other_processes_load_is_not_called_the_bottleneck():
    """Input waiting 1.5x the step while other processes keep one of two cores busy is what
    sharing the remaining core explains (both slow down up to 2x): no bottleneck. Waiting 3x
    the step is, and so is 1.5x on an idle machine."""
    from unittest import mock


    def judged(share, others):
        wait = InputWait()
        wait.per_epoch, wait.others = [0.9, share, share], [0.0, others, others]
        with mock.patch("os.cpu_count", return_value=2):
            return wait.bottleneck()
    assert judged(0.6, 0.0) and not judged(0.6, 1.0) and not judged(0.6, 1.9)
    assert judged(0.75, 1.0) and judged(0.75, 2.0)
    assert not judged(0.45, 0.0)


def test_input_wait_is_the_iterators_own_wait_not_the_calls_overhead(capsys):
    """Batches ready in memory: the iterator's wait is a small share of the step however
    much the host spends per call (callbacks, dispatch), which is reported apart."""

    class SlowHost(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            import time
            time.sleep(0.2)                  # the host's own work in each call (after InputWait's clock starts)
    wait = InputWait(["a remedy"])
    model = _model(width=32768)   # steps of ~20 ms: the iterator's own work is small beside them
    model.fit(DATA.prefetch(2), epochs=3, steps_per_epoch=10, callbacks=[wait, SlowHost()],
              verbose=0)
    out = capsys.readouterr().out
    # the host's 200 ms per call counted as waiting would make it 0.8 of each batch's time
    assert max(wait.per_epoch[1:]) < 0.4 and "warning" not in out, (wait.per_epoch, out)
    figures = wait.figures()
    assert figures["host_ms_per_call"] >= 150 and figures["input_wait_ms_per_batch"] < 10, figures


def test_waits_above_five_percent_ask_the_probe_where_once(capsys):
    """Waits over 5% of the time (not the bottleneck) warn once, naming what the probe
    says, with the steps' rate in batches per second; below 5%, the probe is not asked."""
    asked = []

    def probe(rate):
        asked.append(rate)
        return "timed alone: decode is the slow stage"
    wait = InputWait(probe=probe)
    wait.per_epoch = [0.9, 0.2, 0.2]
    assert wait._noticeable() and not wait.bottleneck()
    quiet = InputWait(probe=probe)
    quiet.per_epoch = [0.9, 0.04, 0.04]
    assert not quiet._noticeable()

    def slow(a, b):
        import time
        time.sleep(0.004)
        return a, b
    slowish = DATA.map(lambda a, b: tf.numpy_function(slow, [a, b], [tf.float32, tf.float32]))
    per_epoch, out = _waited(_model(), slowish, 3, capsys, InputWait(probe=probe))
    assert min(per_epoch[1:]) > 0.05, per_epoch
    assert out.count("tftrain: warning: ") == 1 and "decode is the slow stage" in out, out
    assert len(asked) == 1 and asked[0] > 0
