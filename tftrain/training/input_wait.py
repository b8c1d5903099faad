"""Where an epoch's training time goes: the wait on input against the time inside the
steps and the host's own overhead per call (`InputWait`), the remedies that apply to a
run's pipeline, and a probe naming its slow stage (`tftrain.data.probe`)."""
from __future__ import annotations

import os
import time

from tftrain.training.device_logs import DeviceLogsCallback
from tftrain.core import console
from tftrain.core.cpu import busy_seconds, others_cores
from tftrain import data
from tftrain.data import augment, probe
from tftrain.training.epoch_logs import steady_median


class InputWait(DeviceLogsCallback):
    """Where an epoch's training time goes, measured, not inferred: the wait on the input
    iterator (the train function clocks each `next(iterator)` from the moment the
    previous step is done to the batch's arrival: `TrainModel.input_seconds`), the time
    inside the steps (`step_seconds`), and what is left of the calls' wall time, the
    host's own overhead per call (dispatch, callbacks, the distributed iterator's
    bookkeeping). Adds `input_wait` (the iterator's share of the time per batch: input
    over input and step), `input_wait_ms` per batch and `host_ms_per_call` to the epoch
    logs. A call that traced the step is left out (its seconds are tracing and
    compilation). Warns once, naming `remedies` (what applies to this run's pipeline), when
    the epochs after the stage's first wait on input at least as long as they compute (half
    the time, their median: input is then the bottleneck, when by more than other processes'
    load on the cores explains, see `bottleneck`; below it, the iterator's own work and the
    input pipeline's share of the CPU with the step: the quickstart's 2 replicas on 2
    cores wait about 1.5 ms a batch, 20-30% of their 5 ms steps). Not
    measured under op determinism (TensorFlow refuses clocks there) or at one step per
    call with fixed `train.steps_per_execution` (Keras' own train function)."""

    threshold = 0.5
    noticed = 0.05      # waits above this share of the time: `probe` names the slow stage

    def __init__(self, remedies: list[str] | None = None, probe=None):
        """`probe(step_rate) -> str`: a line naming the pipeline's slow stage
        (`tftrain.data.probe`), asked once when the steady waits exceed `noticed`."""
        super().__init__()
        self.remedies = remedies or []
        self.probe = probe
        self.per_epoch: list[float] = []
        self.per_batch_ms: list[float] = []
        self.host_ms: list[float] = []
        self.call_seconds: list[float] = []    # each epoch's wall time of the calls counted
        self.others: list[float] = []          # cores other processes kept busy, per epoch
        self._warned = False
        self._last: tuple[float, float] | None = None    # the clocks at the last call's end

    def _read(self) -> tuple[float, float]:
        """(seconds inside steps, seconds waiting on the iterator) so far; a fed model's
        wait is not read (nothing is waited on: `TrainModel.feed`)."""
        fed = getattr(self.model, "feed", None) is not None
        return (float(self.model.step_seconds.numpy()),
                0.0 if fed else float(self.model.input_seconds.numpy()))

    def on_epoch_begin(self, epoch, logs=None):
        self._last = None               # (validation and another epoch's first call ran)
        self._calls = self._batches = 0
        self._wall = 0.0
        self._step = self._input = 0.0
        self._load = busy_seconds(), time.perf_counter()

    def _traces(self) -> int:
        function = getattr(self.model, "train_tf_function", None)
        return function.experimental_get_tracing_count() if function is not None else 0

    def on_train_batch_begin(self, batch, logs=None):
        self._traces_before = self._traces()
        # the last call's end, read then: nothing ran since (the same epoch's calls)
        self._before = (self._last or self._read()) if self._measured() else None
        self._first = batch
        self._began = time.perf_counter()

    def _measured(self) -> bool:
        return self.model.clocked and self.model.__dict__.get("input_measured", False)

    def on_train_batch_end(self, batch, logs=None):
        wall = time.perf_counter() - self._began
        if self._before is None or self._traces() != self._traces_before:
            self._last = None
            return        # not measured, or this call traced (and compiled) the step
        step, waited = self._last = self._read()
        self._step += step - self._before[0]
        self._input += waited - self._before[1]
        self._wall += wall
        self._calls += 1
        self._batches += batch - self._first + 1

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self._batches or self._step + self._input <= 0:
            return
        share = self._input / (self._input + self._step)
        self.per_epoch.append(share)
        self.call_seconds.append(self._wall)
        self.per_batch_ms.append(1e3 * self._input / self._batches)
        self.host_ms.append(1e3 * max(0.0, self._wall - self._step - self._input) / self._calls)
        others = others_cores(self._load[0], busy_seconds(), time.perf_counter() - self._load[1])
        if others is not None:
            self.others.append(others)
        logs.update(input_wait=share, input_wait_ms=self.per_batch_ms[-1],
                    host_ms_per_call=self.host_ms[-1])
        # judged on the steady epochs' median (a stage's first epoch also sizes the calls,
        # `steps_per_execution: auto` starting at one step per call, and warms up)
        if len(self.per_epoch) > 1 and not self._warned and self._noticeable():
            self._warned = True
            step_ms = 1e3 * self._step / self._batches
            where = self.probe(1e3 / max(step_ms, 1e-6)) if self.probe else None
            console.warn(f"the steps wait for input {share:.0%} of the time "
                         f"({self.per_batch_ms[-1]:.1f} ms per batch against "
                         f"{step_ms:.1f} ms inside the step); " + (f"{where}; " if where else "")
                         + ("; ".join(self.remedies) if self.remedies
                            else "the input pipeline is the bottleneck"))

    def _noticeable(self) -> bool:
        """Worth a warning: the bottleneck (`bottleneck`), or, with a probe to say where,
        steady waits above `noticed` of the time."""
        share = self.fraction()
        return self.bottleneck() or (self.probe is not None and share is not None
                                     and share > self.noticed)

    def fraction(self) -> float | None:
        """The iterator's share of the time per batch: the median over epochs, leaving out
        the first (it includes tracing); None when nothing was measured."""
        return steady_median(self.per_epoch, None)

    def bottleneck(self) -> bool:
        """Whether input is the bottleneck: the steady epochs wait on it longer than they
        compute (half the time), by more than a busy machine explains. While other
        processes keep c of the n cores busy, the input pipeline and the step share what is
        left and both slow down by up to n / (n - c) (at most n): input waiting 1.2x the
        step with one of two cores taken is the machine's load, not the pipeline (the
        report names the load)."""
        share = self.fraction()
        if share is None or share <= self.threshold:
            return False
        cores = os.cpu_count() or 1
        others = steady_median(self.others, 0.0)
        slowed = cores / max(cores - others, 1.0)
        return share / max(1.0 - share, 1e-9) > slowed

    def figures(self) -> dict:
        """Median input wait per batch (ms), host overhead per call (ms) and cores other
        processes kept busy, as `fraction` takes them."""
        return {"input_wait_ms_per_batch": steady_median(self.per_batch_ms, None),
                "host_ms_per_call": steady_median(self.host_ms, None),
                "others_cores": steady_median(self.others, None)}


def input_wait(plan) -> InputWait:
    """A run's `InputWait`: the remedies that apply to its pipeline, and a probe timing the
    pipeline's stages alone against the replica batches its worker's steps take."""
    cfg, source = plan.cfg, plan.training_source
    elements = plan.layout.share // plan.batches.replica_batch    # per worker and update
    return InputWait(
        input_remedies(cfg.data, source, data.cache_choice(source, cfg.data),
                       cfg.train.steps_per_execution),
        probe=lambda updates: probe.slowest(probe.stage_rates(
            source, plan.batches, cfg.data, cfg.run.seed), updates * elements))


def input_remedies(data_cfg, source, cached: str, steps_per_execution) -> list[str]:
    """What can shorten the wait on input for this pipeline (what already holds, left out):
    `cached`: the cache choice (`data.cache_choice`)."""

    found = []
    if cached != "memory":
        found.append("hold the decoded examples in memory (data.cache: memory, within "
                     "data.cache_budget)")
    ops = [op.name for op in augment.build(data_cfg.augment) if not op.deterministic]
    if ops:
        found.append(f"lighten data.augment ({', '.join(ops)} run for every example)")
    if data_cfg.service is None:
        found.append("run the input pipeline on tf.data service workers (python -m "
                     "tftrain.launch --data-workers N)")
    return found
