"""What a run measures and logs per epoch: throughput, FLOPs, the learning rate, the
metrics over all replicas, TensorBoard, and the steps each call runs
(`train.steps_per_execution: auto`). The wait on input is `input_wait.py`; checkpoints
and checks are in `callbacks.py`."""
from __future__ import annotations

import math
import time

from tftrain.core.keras import keras
from tftrain.training.device_logs import DeviceLogsCallback
from tftrain.optim.rates import current_lr
from tftrain.core import internals
from tftrain.optim.averaging import has_batch_norm
from tftrain.runtime.strategy import graph_collectives


def steady_median(per_epoch: list[float], empty):
    """Median over epochs, leaving out the first (it includes tracing); `empty` when
    nothing was measured."""
    values = sorted(per_epoch[1:] or per_epoch)
    return values[len(values) // 2] if values else empty


class Throughput(DeviceLogsCallback):
    """Adds `examples_per_sec` (training examples per second of the epoch) to the logs."""

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
        return steady_median(self.per_epoch, 0.0)


class GlobalMetrics(DeviceLogsCallback):
    """Puts each training metric's value over all replicas into the epoch's logs (the
    train step logs one replica's running values, `TrainModel.local_metrics`, so that a
    step exchanges nothing but gradients). The values are read at the epoch's last
    training batch, before validation reuses the metric objects, and written at the
    epoch's end; it must come before every callback that reads those logs (Keras
    appends its history and progress bar after the given callbacks)."""

    def on_epoch_begin(self, epoch, logs=None):
        self._values = None

    def on_train_batch_end(self, batch, logs=None):
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 < steps:              # not the epoch's last training batch
            return
        values = {}
        for metric in self.model.metrics:
            value = metric.result()                  # a synchronised read: every worker
            values.update({k: float(v) for k, v in value.items()} if isinstance(value, dict)
                          else {metric.name: float(value)})
        self._values = values

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._values:
            logs.update(self._values)


class ExecutionSizer(DeviceLogsCallback):
    """`train.steps_per_execution: auto`: after a few executions of one step, sets the
    steps run per `tf.function` call so that the host's work per call (Python callbacks,
    the checks, dispatch, the distributed iterator) stays under `target` of the time spent
    inside the steps, and one call lasts at most `max_seconds` (callbacks, checks and
    signals are looked at between calls: a stop asked for is honoured within that time,
    well inside the 30 s a scheduler's SIGTERM usually leaves). In a cluster every worker
    takes the same value, the rounded-up mean of their proposals (one all-reduce).
    Without clocks in the step (`run.deterministic`), half of each call is taken as host
    time, which errs toward more steps per call."""

    target = 0.02

    def __init__(self, steps_per_epoch: int, mean=None, measure: int = 8,
                 max_seconds: float = 5.0, most: int | None = None, updates: int | None = None):
        """`most`: an upper bound (the checkpoint interval, so saves stay on time).
        `updates`: the steps the stage ends at (None: as many as pay for a trace)."""
        super().__init__()
        self.steps_per_epoch, self.mean = steps_per_epoch, mean
        self.most = min(steps_per_epoch, most or steps_per_epoch)
        self.measure, self.max_seconds, self.updates = measure, max_seconds, updates
        self.chosen: int | None = None
        self.host_seconds: float | None = None     # per call, measured
        self.step_seconds: float | None = None     # per step, measured
        self.retraced: bool | None = None          # settled at one step: traced without the loop
        self._began: float | None = None
        self._first_call: float | None = None      # the first call's seconds (its trace)
        self._epoch = 0                            # (fit's epochs count from the stage's start)

    def on_train_begin(self, logs=None):
        self._began = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        # A window starts after the epoch's first call (tracing, the iterator) and never
        # spans an epoch's end (validation).
        self._start, self._calls, self._epoch = None, 0, epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.chosen is not None:
            return
        if self._first_call is None and self._began is not None:
            self._first_call = time.perf_counter() - self._began
        if self._start is None:
            self._start = (time.perf_counter(), self._inside(), batch)
            return
        self._calls += 1
        if self._calls >= max(1, min(self.measure, self.steps_per_epoch - 2)):
            began, inside, first = self._start
            steps = batch - first
            wall = (time.perf_counter() - began) / self._calls
            now = self._inside()
            step = ((now - inside) / steps if now is not None else 0.5 * wall * self._calls / steps)
            self._choose(host=max(0.0, wall - step * steps / self._calls), step=step,
                         remaining=None if self.updates is None else
                         self.updates - self._epoch * self.steps_per_epoch - batch - 1)

    def _inside(self) -> float | None:
        """Seconds spent inside steps so far (one read of a replica-synchronised sum:
        milliseconds, so only at a window's ends)."""
        if not self.model.clocked:
            return None
        return float(self.model.step_seconds.numpy())

    # what a loop of one step costs against a call without it (a ResNet-20's steps, 2%)
    LOOP_SHARE = 0.02

    def _choose(self, host: float, step: float, remaining: int | None = None) -> None:
        """Steps per call from the host's and a step's seconds; settled at one step, the
        train function is traced again without its loop only where the steps left save
        more than that trace costs (the first call's seconds: a smoke run's last update,
        or a short stage's, is not worth a trace). In a cluster both are agreed on."""
        k = math.ceil(host / (self.target * max(step, 1e-9)))
        k = max(1, min(k, int(self.max_seconds // max(step, 1e-9)), self.most))
        trace = max(0.0, (self._first_call or 0.0) - step)
        pays = float(remaining is None or remaining * step * self.LOOP_SHARE > trace)
        if self.mean is not None:                        # every worker alike
            agreed, pays = self.mean([float(k), pays])
            k = math.ceil(agreed - 1e-9)
        self.chosen, self.host_seconds, self.step_seconds = k, host, step
        self.model.steps_per_execution.assign(k)
        settle = getattr(self.model, "settle_calls", None)
        self.retraced = k == 1 and pays >= 0.5 and settle is not None
        if self.retraced:
            settle(k)


class EpochTensorBoard(keras.callbacks.TensorBoard):
    """Keras' TensorBoard callback with per-epoch scalars and no work per batch: Keras'
    own writes the training graph at the first batch's end (about 0.1 s, enough to trip
    its slow-callback warning) and runs a summary op per log per batch even when only
    epochs are recorded. The graph is written at the first epoch's end instead."""

    def __init__(self, log_dir: str):
        super().__init__(log_dir, update_freq="epoch", profile_batch=0)

    def _implements_train_batch_hooks(self):
        return False

    def on_train_batch_begin(self, batch, logs=None):
        pass

    def on_train_batch_end(self, batch, logs=None):
        pass

    def on_epoch_end(self, epoch, logs=None):
        internals.write_train_graph_once(self)
        # Keras writes the learning rate itself (epoch_learning_rate): `lr` once is enough
        super().on_epoch_end(epoch, {k: v for k, v in (logs or {}).items() if k != "lr"})


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


def generalisation_gap(model, history: dict, metrics: dict, margin: float = 0.3) -> str:
    """A warning when the last epoch's training accuracy (`history`, Keras' History of
    the fit) exceeds validation accuracy by more than `margin` ("": none). With batch
    norm the usual cause is moving statistics that lag the weights; without, the model
    has memorised its training data."""

    train = (history.get("accuracy") or [None])[-1]
    val = metrics.get("val_accuracy")
    if train is None or val is None or train - val <= margin:
        return ""
    seen = f"accuracy {train:.2f} training, {val:.2f} validation"
    if has_batch_norm(model):
        return (f"{seen}: batch-norm moving statistics that lag the weights are the usual "
                "cause (set train.recalibrate_batch_norm: auto, or lower the batch-norm "
                "momentum)")
    return f"{seen}: overfit (check labels; train less, regularise)"


def host_figures(model, checkpointer, sizer, callbacks) -> dict:
    """What the host did besides the steps: steps per call, training calls, checks made
    (each one small all-reduce in a cluster), the callbacks for which Keras copied every
    call's logs to the host (none of tftrain's own), the collectives inside the compiled
    step (a cluster's should be its gradient all-reduce alone) and, when `auto` sized the
    calls, the host seconds per call and the step time it measured."""

    traced = getattr(model, "train_tf_function", None)
    figures = {"steps_per_execution": int(model.steps_per_execution.numpy()),
               "calls": checkpointer.calls, "checks": checkpointer.checks,
               "logs_copied_by": internals.logs_copied_by(callbacks),
               "step_collectives": graph_collectives(traced) if traced is not None else []}
    if sizer is not None and sizer.chosen is not None:
        figures.update(host_seconds_per_call=sizer.host_seconds,
                       step_seconds=sizer.step_seconds)
    return figures


def validated(trained: dict, callbacks) -> dict | None:
    """The validation metrics of fit's last epoch (`trained`: its history), which were
    the model's as it ends the stage: fit ran this session, and no callback (early
    stopping's best weights) set other weights after it; None: evaluate again. (Each stage
    evaluated its model once more: the whole validation set again.)"""
    if any(getattr(c, "restore_best_weights", False) for c in callbacks):
        return None
    last = {k: float(v[-1]) for k, v in trained.items() if k.startswith("val_") and v}
    return last or None
