"""`train.jit_compile`: whether a stage's replica gradients are compiled by XLA.

What XLA compiles is `TrainModel._replica_gradients`: the forward and backward passes,
the accumulation loop and the loss and metric updates of one replica. The all-reduce,
the loss-scale bookkeeping, update hooks and the optimizer update stay outside it:
collectives and `merge_call` inside an XLA cluster fail under distribution strategies
(keras-team/keras#18145, tensorflow/tensorflow#58961). Exported models are never
compiled.

`auto` measures instead of guessing: XLA makes some models much faster and others much
slower on the same device (on this project's 2-core CPU a ResNet-20 step ran 2.5x
faster, the quickstart CNN's 3.6x slower). Before a stage trains, its gradient function
runs on one training batch, plain and compiled, alternately; XLA is used when it
compiles and is at least `margin` faster (a round where one side is twice as fast ends
the measurement early: XLA's CPU convolution gradients ran over 15x slower than the plain
step). The batch-norm statistics, random generators
and metrics it touches are put back, so the training that follows is the same whatever
the answer. In a cluster the workers vote (one all-reduce) so all compile alike. The
decision is saved with the stage's checkpoints, so a resumed stage keeps it.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.training.train_step import op_determinism
from tftrain.core import console
from tftrain.core.cpu import cpu_flags
from tftrain.training.rundir import atomic_write
from tftrain.training.callbacks import random_generators

UNDECIDED, OFF, ON = -1, 0, 1


@dataclass(frozen=True)
class Decision:
    compiled: bool
    reason: str                    # one line: why (printed)
    speedup: float | None = None   # compiled / plain step rate, when measured


def refusal(stage, parallel) -> str:
    """Why XLA cannot compile this stage's gradients ("": it can be tried)."""
    if parallel.unroll:
        return "model placement runs each stage's ops on its own device"
    if stage.unroll:
        return (f"stage {stage.name}'s forward pass synchronises replicas (merge_call), "
                "which XLA cannot compile")
    return ""


def check(cfg, stage, parallel) -> None:
    """Plan-time: `jit_compile: true` on a stage XLA cannot compile is a config error."""
    why = refusal(stage, parallel)
    if cfg.train.jit_compile is True and why:
        raise ConfigError(f"train.jit_compile: true cannot be used: {why}; set "
                          "train.jit_compile: auto (XLA where it works) or false")


@dataclass(frozen=True)
class Probe:
    """How `auto` measures. `margin`: the speed-up compiled steps must reach; `rounds` of
    `calls` each, timed in turn. `steps`: the updates the stage will make: the
    measurement is skipped when it would cost more than `BUDGET` of their time. `key`
    (one worker): a decision measured before under the same key (`cache_key`: model,
    strategy, precision, batch, hardware and TensorFlow) is reused. `longest`: the most
    the stage's steps can take (from its FLOPs at `SLOWEST_MFU` of the peak): a model whose
    trace alone, estimated from its layers (`TRACE_PER_LAYER`), would cost more than
    `BUDGET` of it is not even traced to be measured."""
    margin: float = 1.05
    rounds: int = 3
    calls: int = 3
    steps: int | None = None
    key: str | None = None
    longest: float | None = None


def decide(setting, model, strategy, batch, vote=None, refused: str = "",
           probe: Probe = Probe()) -> Decision:
    """Whether `model` (a compiled `TrainModel`) computes its gradients under XLA.
    `batch`: one replica batch `(x, y[, weight])`, or a function giving it (called only
    when a measurement needs it); `vote(values) -> values`: the mean
    over a cluster's replicas (None on one worker); `refused`: why XLA cannot be used
    (`refusal`), "" if it can be tried; `probe`: how `auto` measures (`Probe`)."""
    margin, steps, key, longest = probe.margin, probe.steps, probe.key, probe.longest
    if setting is False:
        return Decision(False, "off (train.jit_compile: false)")
    if refused:
        return Decision(False, f"off: {refused}")
    if setting is True:
        return Decision(True, "on (train.jit_compile: true)")
    if op_determinism():
        return Decision(False, "off: run.deterministic (a measured choice could differ "
                               "between runs)")
    cached = _cached(key) if key and vote is None else None
    if cached is not None:
        return cached
    tracing = TRACE_PER_LAYER * len(model.submodules)
    if longest is not None and tracing > BUDGET * longest:
        return Decision(False, f"off, not probed: tracing the step alone would take about "
                               f"{tracing:.0f} s ({len(model.submodules)} layers), over "
                               f"{BUDGET:.0%} of the stage's {longest:.0f} s of steps at most")
    try:
        speedup, cost, planned = _measure(model, strategy, batch() if callable(batch) else batch,
                                          probe.rounds, probe.calls, steps=steps)
        spent = (f" (the probe took {cost:.1f} s, {cost / planned:.0%} of the {planned:.0f} s "
                 "of steps planned)" if planned else "")
        decision = (Decision(True, f"on: compiled steps ran {speedup:.2f}x as fast{spent}",
                             speedup) if speedup >= margin else
                    Decision(False, f"off: compiled steps ran {speedup:.2f}x as fast "
                                    f"(needs {margin:.2f}x){spent}", speedup))
        if key and vote is None:
            _store(key, decision)
    except _OverBudget as over:
        decision = Decision(False, f"off, not probed: probing would take about "
                                   f"{over.cost:.1f} s, over {BUDGET:.0%} of the stage's "
                                   f"{over.planned:.1f} s of steps")
    except (tf.errors.OpError, ValueError, TypeError, NotImplementedError) as err:
        lines = [ln.strip() for ln in str(err).splitlines()
                 if ln.strip() and not ln.strip().startswith(("Graph execution", "Detected at",
                                                              "[[", "File", "Cf."))]
        first = (lines[0] if lines else type(err).__name__)[:200]
        decision = Decision(False, f"off: XLA could not compile the step ({first})")
    if vote is not None:                  # every worker alike
        agreed = vote([1.0 if decision.compiled else 0.0])[0] >= 0.5
        if agreed != decision.compiled:
            decision = Decision(agreed, f"{'on' if agreed else 'off'} by the workers' vote "
                                        f"(this worker: {decision.reason})", decision.speedup)
    return decision


def for_stage(stage, model, jit, plan, batch) -> Decision:
    """The decision for a stage about to train: as saved before a restart (`jit`, the
    stage checkpoint's variable), else decided now and saved in `jit`; printed when it
    was for `auto` to decide. `batch()`: one replica batch, built only to measure."""
    if stage.updates == 0:                  # (train.epochs: 0) nothing to compile
        return Decision(False, "no updates")
    if int(jit.numpy()) != UNDECIDED:
        return Decision(bool(jit.numpy()), "as decided before the restart")

    parallel, setting = plan.parallel, plan.cfg.train.jit_compile
    refused = refusal(stage, parallel)
    measuring = setting == "auto" and not refused
    key = (cache_key(model, parallel.strategy, plan.precision.policy,
                     (plan.batches.per_replica, plan.batches.accumulation))
           if parallel.mean is None and measuring else None)
    # the stage's steps at the slowest plausible pace of the peak the devices reached
    # (measured; not the ceiling MFU is quoted against)
    longest = None
    if plan.flops_per_example and stage.updates:
        longest = (3 * plan.flops_per_example * plan.batches.global_batch * stage.updates
                   / (SLOWEST_MFU * (plan.peak.measured or plan.peak.flops)))
    with (console.phase("xla", f"{stage.name}: timing compiled steps against plain ones")
          if measuring else contextlib.nullcontext()) as note:
        decision = decide(setting, model, parallel.strategy, batch, parallel.mean, refused,
                          Probe(steps=stage.updates, key=key, longest=longest))
        if note is not None:
            note["detail"] = decision.reason
    jit.assign(ON if decision.compiled else OFF)
    if setting == "auto" and not measuring:
        console.say(f"XLA ({stage.name}): {decision.reason}")
    return decision


BUDGET = 0.10            # the most of a stage's planned step time the probe may take
SLOWEST_MFU = 0.05       # a stage's steps reach at least this share of the peak FLOP/s
TRACE_PER_LAYER = 0.03   # seconds of tracing per layer at least (MobileNetV2: 0.06 s)


class _OverBudget(Exception):
    def __init__(self, cost: float, planned: float):
        super().__init__(f"{cost} > {BUDGET} x {planned}")
        self.cost, self.planned = cost, planned


def cache_key(model, strategy, policy: str, batch: tuple[int, int]) -> str:
    """What an XLA decision depends on: the model's architecture, the strategy and its
    replicas, the precision policy, the per-replica batch and accumulation steps, the
    CPU or GPUs, and TensorFlow's version."""
    import hashlib
    import json
    import platform

    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    parts = [model.to_json(), type(strategy).__name__, strategy.num_replicas_in_sync, policy,
             list(batch), platform.processor() or platform.machine(), cpu_flags(), gpus,
             tf.__version__]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:24]


def _cache_file():
    import os
    from pathlib import Path
    root = os.environ.get("TFTRAIN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tftrain")
    return Path(root) / "xla.json"


def _cached(key: str) -> Decision | None:
    import json
    try:
        entry = json.loads(_cache_file().read_text()).get(key)
    except (OSError, ValueError):
        return None
    if not entry:
        return None
    return Decision(entry["compiled"], f"{'on' if entry['compiled'] else 'off'}, as measured "
                    f"on {entry['date']} for this model, strategy, precision, batch and hardware "
                    f"({entry['reason']})", entry.get("speedup"))


def _store(key: str, decision: Decision) -> None:
    import datetime
    import json
    path = _cache_file()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known[key] = {"compiled": decision.compiled, "reason": decision.reason,
                  "speedup": decision.speedup, "date": datetime.date.today().isoformat()}
    try:
        atomic_write(path, json.dumps(known, indent=1))
    except OSError:
        pass                           # a read-only home: measured again next time


def _measure(model, strategy, batch, rounds: int, calls: int, decisive: float = 2.0,
             steps: int | None = None) -> tuple[float, float, float | None]:
    """Median over rounds of (compiled rate / plain rate) of the replica gradients on
    `batch`, with every variable they change put back afterwards. A round that finds one
    side `decisive` times faster ends the measurement, and a round stops calling a side
    once it has taken `decisive` times the other's time: XLA's CPU convolution gradients
    ran over 15x slower than TensorFlow's on a ResNet-14 w32 (2 CPU cores: 3 plain steps
    11 s, 3 compiled over 180 s), and with three full rounds a stage waited over fifteen
    minutes to begin."""
    x, y, weight = (*batch, None) if len(batch) == 2 else batch
    with strategy.scope():          # per-replica metric variables, as in training
        model.build_metrics(y)
    x, y = _on_replicas(strategy, x), _on_replicas(strategy, y)   # each on its device
    saved = _state(model)
    began = time.perf_counter()
    try:
        plain = _probe(strategy, model._replica_gradients)
        compiled = _probe(strategy, model._compiled_gradients)
        traced = _run(plain, x, y, weight, 1)          # trace
        planned = None
        if steps:
            step = _run(plain, x, y, weight, 1)
            planned = steps * step
            # XLA compiles about twice as long as TensorFlow traces, then the rounds
            cost = 2 * traced + 2 * rounds * calls * step
            if cost > BUDGET * planned:
                raise _OverBudget(cost, planned)
        _run(compiled, x, y, weight, 1)                # compile
        ratios = []
        for r in range(rounds):
            first, second = (plain, compiled) if r % 2 == 0 else (compiled, plain)
            seconds = {id(first): _run(first, x, y, weight, calls)}
            seconds[id(second)] = _run(second, x, y, weight, calls,
                                       limit=seconds[id(first)] * calls * decisive)
            ratios.append(seconds[id(plain)] / seconds[id(compiled)])
            if not 1 / decisive < ratios[-1] < decisive:
                break
        return statistics.median(ratios), time.perf_counter() - began, planned
    finally:
        _restore(saved)
        model.reset_metrics()


def _on_replicas(strategy, value):
    """`value` copied onto each local replica's device (a PerReplica)."""
    devices = strategy.extended.worker_devices

    def copy(context):
        with tf.device(devices[context.replica_id_in_sync_group % len(devices)]):
            return tf.nest.map_structure(tf.identity, value)
    return strategy.experimental_distribute_values_from_function(copy)


def _probe(strategy, gradients):
    @tf.function(autograph=False)            # as the train function (train_step.py)
    def probe(x, y, weight):
        return strategy.run(gradients, args=(x, y, weight))
    return probe


def _run(probe, x, y, weight, calls: int, limit: float = float("inf")) -> float:
    """Seconds per call of `probe` over `calls` calls, or fewer once they took `limit`."""
    began, done = time.perf_counter(), 0
    while done < calls and (done == 0 or time.perf_counter() - began < limit):
        out = probe(x, y, weight)
        tf.nest.flatten(out, expand_composites=True)[0].numpy()     # wait for the call
        done += 1
    return (time.perf_counter() - began) / done


def _state(model) -> list:
    """(variable, value) of what a gradient pass changes: batch-norm statistics and other
    non-trainable weights, and the layers' random generators."""

    variables = list(model.non_trainable_variables)
    variables += [g.state for g in random_generators(model)]
    return [(v, tf.identity(v.read_value())) for v in variables]


def _restore(saved) -> None:
    for variable, value in saved:
        variable.assign(value)
