"""What a person and the run directory see while a stage trains: the training metrics
every few updates (`UpdateLog`: updates.csv and TensorBoard), one line per epoch with
units within 120 columns, and progress with an ETA inside a long epoch (`EpochLine`)."""
from __future__ import annotations

import time

from tftrain.core import console
from tftrain.training.device_logs import DeviceLogsCallback
from tftrain.optim.rates import current_lr
from tftrain.training.rundir import atomic_write
import tensorflow as tf


class UpdateLog(DeviceLogsCallback):
    """Every `every` updates (at the first call's end at or after each multiple), the
    training metrics over all replicas (running means since the epoch began, as Keras
    shows them) and `lr` (the rate of the next update), as a row of `path` (a CSV file:
    `update`, then the values) and as TensorBoard scalars in `tensorboard` (a directory),
    on the chief; every worker reads the values (a synchronised read), so all call it at
    the same batches. A resumed stage (`start` > 0) drops the rows after its checkpoint,
    which it trains again. Which updates are logged depends on where calls end
    (`train.steps_per_execution`), so two runs share the updates logged at each epoch's
    end and at every multiple of `every` that ends a call in both."""

    def __init__(self, every: int, steps_per_epoch: int, start: int = 0, path=None,
                 tensorboard=None):
        super().__init__()
        self.every, self.steps_per_epoch = max(1, every), steps_per_epoch
        self.last, self.path, self.pending = start, path, []
        self.writer = None
        if tensorboard is not None:
            self.writer = tf.summary.create_file_writer(str(tensorboard))
        if path is not None:
            keep_rows(path, lambda row: int(row["update"]) <= start)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        update = self._epoch * self.steps_per_epoch + batch + 1
        if update // self.every <= self.last // self.every:
            return
        self.last = update
        values = {}
        for metric in self.model.metrics:
            value = metric.result()                  # a synchronised read: every worker
            values.update({k: float(v) for k, v in value.items()} if isinstance(value, dict)
                          else {metric.name: float(value)})
        values["lr"] = current_lr(self.model.optimizer)
        if self.path is not None:        # a line now: what a kill leaves is the rows so far
            _append_row(self.path, {"update": update, **values})
        self.pending.append({"update": update, **values})

    def on_epoch_end(self, epoch, logs=None):
        self._write()        # summaries per epoch: no summary op between steps

    def on_train_end(self, logs=None):
        self._write()

    def _write(self) -> None:
        rows, self.pending = self.pending, []
        if self.writer is not None and rows:
            with self.writer.as_default():
                for row in rows:
                    for name, value in row.items():
                        if name != "update":
                            tf.summary.scalar(name, value, step=row["update"])
            self.writer.flush()


def keep_rows(path, keep) -> None:
    """Rewrite the CSV file at `path` (if it exists) with only the rows `keep(row)` accepts,
    and none cut short by a kill (a row with empty fields)."""
    import os
    if os.path.exists(path):
        _write_rows(path, [row for row in _read_rows(path)
                           if None not in row.values() and keep(row)])


def _read_rows(path) -> list[dict]:
    import csv
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _write_rows(path, rows: list[dict]) -> None:
    import csv
    import io

    text = io.StringIO()
    if rows:
        writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    atomic_write(path, text.getvalue())


def _append_row(path, row: dict) -> None:
    import csv
    import os

    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row), lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerow(row)




class EpochLine(DeviceLogsCallback):
    """`train.verbose: 2`: one line per epoch, e.g. `epoch  3/15  loss 0.2590  accuracy
    0.9300  val_loss 0.1812  val_accuracy 0.9704  6.8k ex/s  14.2 GFLOP/s  lr 1.5e-3
    0.9 s` (within 120 columns), and inside an epoch that runs past `every` seconds a
    line every `every` seconds with the updates done and the time left."""

    def __init__(self, stage: str, epochs: int, steps_per_epoch: int, every: float = 10.0):
        super().__init__()
        self.stage, self.epochs, self.steps, self.every = stage, epochs, steps_per_epoch, every

    def on_epoch_begin(self, epoch, logs=None):
        self._began = self._shown = time.perf_counter()
        self._first, self._epoch = None, epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._first is None:
            self._first = batch

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if now - self._shown < self.every:
            return
        self._shown = now
        done = batch - self._first + 1
        left = (now - self._began) / done * (self.steps - batch - 1)
        console.say(f"  {self._label(self._epoch)}: {batch + 1}/{self.steps} updates, "
                    f"{console.seconds(now - self._began)}, about {console.seconds(left)} left")

    def _label(self, epoch: int) -> str:
        prefix = "epoch" if self.stage == "train" else f"{self.stage} epoch"
        width = len(str(self.epochs))
        return f"{prefix} {epoch + 1:>{width}}/{self.epochs}"

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        parts = [self._label(epoch)]
        skip = {"examples_per_sec", "model_flops_per_sec", "mfu", "lr", "input_wait",
                "input_wait_ms", "host_ms_per_call"}
        parts += [f"{k} {v:.4f}" for k, v in logs.items() if k not in skip
                  and isinstance(v, (int, float))]
        parts.append(console.seconds(time.perf_counter() - self._began))
        optional = [console.rate(logs["examples_per_sec"], "ex/s") if "examples_per_sec" in logs
                    else "", f"lr {logs['lr']:.1e}" if "lr" in logs else "",
                    console.rate(logs["model_flops_per_sec"], "FLOP/s")
                    if logs.get("model_flops_per_sec") else ""]
        for extra in filter(None, optional):      # as many as fit 120 columns, in this order
            if len("  ".join(parts + [extra])) <= console.WIDTH:
                parts.insert(len(parts) - 1, extra)
        console.say(console.fit("  ".join(parts)))
