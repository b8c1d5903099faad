"""Model parallelism: a functional model's layers in contiguous stages, one device each.

Stages follow the model's topological order (`model.layers`), so a residual branch that
skips a stage boundary is simply another activation sent across it. `balance` chooses
the cost a stage is measured by (parameters, FLOPs, or training memory); the auto
partition is the contiguous split minimising the largest stage (exact dynamic
programme). Explicit stages are lists of name/regex rules.

Placement acts at two moments. Variables are created on their stage's device while the
model is built (a variable creator reads the layer from the name scope). Ops are placed
at call time: device scopes used while a functional model is built are not replayed
when it is called, so each layer's `call` runs inside its stage's `tf.device`; the
gradient of an op is placed with the op, so the backward pass runs where the forward
did. The activations crossing a stage boundary are the only transfers.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tftrain.core import internals
from tftrain.core.keras import keras
from tftrain.config import ConfigError, PlacementConfig
from tftrain.models import layer_parents


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, per example where it depends on the batch."""
    name: str
    params: int
    flops: float              # forward FLOPs per example
    activation_bytes: float   # bytes of its outputs per example (kept for the backward)

    def memory(self, batch: int, slots: int = 2, compute_bytes: int = 4) -> float:
        """Training bytes: float32 weights, gradients, optimizer slots and the optimizer's
        update temporaries, and activations."""
        return self.params * 4 * (3 + slots) + self.activation_bytes / 4 * compute_bytes * batch


def _size(shape) -> int:
    return int(np.prod([d for d in shape if d is not None], dtype=np.int64))


def layer_flops(layer) -> float:
    """Forward FLOPs per example (multiply-adds count 2), from the layer's shapes."""
    out = layer.output_shape
    outs = out if isinstance(out, list) else [out]
    out_elems = sum(_size(o[1:]) for o in outs)
    kind = type(layer).__name__
    if kind == "Dense":
        return 2.0 * layer.kernel.shape[0] * out_elems
    if kind in ("Conv1D", "Conv2D", "Conv3D"):
        k = layer.kernel.shape
        return 2.0 * _size(k[:-1]) * out_elems
    if kind == "DepthwiseConv2D":
        return 2.0 * _size(layer.depthwise_kernel.shape[:2]) * out_elems
    if kind == "MultiHeadAttention":
        config = internals.attention(layer)
        query = config["query_shape"] or out
        length = query[1] if len(query) > 2 else 1
        dim = config["key_dim"] * config["num_heads"]
        width = out[-1]
        projections = 2.0 * length * width * dim * 4
        attention = 2.0 * 2 * length * length * dim
        return projections + attention
    return float(out_elems)        # element-wise work


_VIEWS = ("Flatten", "Reshape", "InputLayer")          # no new memory
_FUSED_AFTER = ("BatchNormalization", "Add")           # ReLU fused into these by the runtime


def activation_bytes(layer, parents: list[str]) -> float:
    """float32 bytes per example this layer keeps for the backward pass: its outputs, none
    for views and for an activation fused into the batch norm or add before it, plus the
    attention scores and probabilities of multi-head attention."""
    kind = type(layer).__name__
    if kind in _VIEWS:
        return 0.0
    if kind in ("ReLU", "Activation") and parents and all(p in _FUSED_AFTER for p in parents):
        return 0.0
    out = layer.output_shape
    outs = out if isinstance(out, list) else [out]
    total = sum(_size(o[1:]) for o in outs) * 4.0
    if kind == "MultiHeadAttention" and len(outs[0]) > 2:
        length = outs[0][1]
        total += 3 * internals.attention(layer)["num_heads"] * length * length * 4.0   # scores, softmax, dropout mask
    return total


def layer_costs(model) -> list[LayerCost]:
    """Cost of each layer (InputLayers excluded), in topological order."""

    parents = layer_parents(model)
    costs = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        costs.append(LayerCost(layer.name, layer.count_params(), layer_flops(layer),
                               activation_bytes(layer, parents.get(layer.name, []))))
    return costs


def stage_cost(cost: LayerCost, balance: str, batch: int = 1) -> float:
    if balance == "params":
        return float(cost.params)
    if balance == "flops":
        return cost.flops
    return cost.memory(batch)


def partition(costs: list[float], k: int) -> list[int]:
    """Stage index of each item: the contiguous split into at most k stages minimising the
    largest stage sum (exact; O(k n^2))."""
    n = len(costs)
    k = max(1, min(k, n))
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for j in range(1, n + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    stage = [0] * n
    j = n
    for s in range(k, 0, -1):
        i = cut[s][j]
        for m in range(i, j):
            stage[m] = s - 1
        j = i
    return stage


def stages_from_rules(names: list[str], rules: list[list[str]]) -> list[int]:
    """Stage index of each layer from per-stage name/regex rules (full match)."""
    stage: dict[str, int] = {}
    for s, stage_rules in enumerate(rules):
        for r, rule in enumerate(stage_rules):
            matched = [n for n in names if re.fullmatch(rule, n)]
            if not matched:
                raise ConfigError(f"model.placement.stages[{s}][{r}]: rule {rule!r} matches no "
                                  f"layer; the model's layers are: {', '.join(names)}")
            for n in matched:
                if n in stage and stage[n] != s:
                    raise ConfigError(f"model.placement.stages[{s}][{r}]: layer {n} is already "
                                      f"in stage {stage[n]}; each layer belongs to one stage")
                stage[n] = s
    missing = [n for n in names if n not in stage]
    if missing:
        raise ConfigError(f"model.placement.stages: layers {', '.join(missing)} are in no "
                          "stage; add rules for them (e.g. '.*' in the last stage)")
    order = [stage[n] for n in names]
    if any(b < a for a, b in zip(order, order[1:])):
        back = next(names[i + 1] for i, (a, b) in enumerate(zip(order, order[1:])) if b < a)
        raise ConfigError(f"model.placement.stages: stages must be contiguous in the model's "
                          f"layer order, and layer {back} goes back to an earlier stage")
    return order


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...]
    layers: tuple[str, ...]          # topological order, InputLayers excluded
    stage: tuple[int, ...]           # stage of each layer
    costs: tuple[float, ...]         # cost of each stage (by `balance`)
    balance: str
    microbatches: int = 1
    measured: tuple = ()             # `microbatches: auto`: (count, ms per batch) measured

    def device_of(self, layer: str) -> str:
        return self.devices[self.stage[self.layers.index(layer)]]

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    def bubble(self) -> float:
        """GPipe's idle fraction for balanced stages: (K-1)/(M+K-1)."""
        k, m = self.num_stages, self.microbatches
        return (k - 1) / (m + k - 1)

    def describe(self) -> str:
        lines = [f"model parallel: {self.num_stages} stages, balance {self.balance}, "
                 f"{self.microbatches} micro-batches (bubble (K-1)/(M+K-1) = {self.bubble():.2f})"]
        if self.measured:
            lines.append("  micro-batches: auto, the fastest of " + ", ".join(
                f"{m}: {ms:.1f} ms" for m, ms in self.measured) + " (a batch's forward and "
                "backward pass, measured)")
        for s, device in enumerate(self.devices):
            names = [n for n, st in zip(self.layers, self.stage) if st == s]
            span = f"{names[0]} .. {names[-1]}" if len(names) > 1 else (names[0] if names else "-")
            lines.append(f"  stage {s} {device}: {len(names)} layers ({span}), cost {self.costs[s]:.3g}")
        return "\n".join(lines)


def plan(model, cfg: PlacementConfig, batch: int = 1, devices=None) -> Placement:
    """Assign the layers of a built functional model to the configured devices."""
    devices = tuple(devices or cfg.devices)
    costs = layer_costs(model)
    names = [c.name for c in costs]
    weights = [stage_cost(c, cfg.balance, batch) for c in costs]
    if cfg.stages == "auto":
        stage = partition(weights, len(devices))
    else:
        if len(cfg.stages) != len(devices):
            raise ConfigError(f"model.placement.stages: {len(cfg.stages)} stages for "
                              f"{len(devices)} devices; give one list of rules per device")
        stage = stages_from_rules(names, cfg.stages)
    totals = [sum(w for w, s in zip(weights, stage) if s == k) for k in range(len(devices))]
    return Placement(devices, tuple(names), tuple(stage), tuple(totals), cfg.balance,
                     1 if cfg.microbatches == "auto" else cfg.microbatches)


def build(builder):
    """`builder()` with Keras' automatic layer names counted from zero, so that building
    the same model twice (once to plan, once placed) names its layers alike."""
    keras.backend.reset_uids()
    return builder()


def build_placed(builder, placement: Placement):
    """Build the model again with each layer's variables on its stage's device, and its
    calls pinned there. `builder()` must build the same functional model (auto-named
    layers included: both builds go through `build`). A layer of the plan missing from
    the build, or a variable off its stage's device, is an error, never a silent
    unplaced model."""
    top = set(placement.layers)

    def creator(next_creator, **kwargs):
        scope = tf.get_current_name_scope().split("/")[0]
        if scope in top:
            with tf.device(placement.device_of(scope)):
                return next_creator(**kwargs)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        model = build(builder)
    _check_built(model, placement)
    return pin(model, placement)


def _check_built(model, placement: Placement) -> None:
    built = {layer.name: layer for layer in model.layers}
    missing = [name for name in placement.layers if name not in built]
    if missing:
        raise RuntimeError(f"model placement matched nothing for layers {', '.join(missing[:5])}: "
                           f"the model built for training names its layers "
                           f"{', '.join(list(built)[:8])}...; the builder must build the same "
                           "model each time it is called (name its layers)")
    for name in placement.layers:
        wanted = tf.DeviceSpec.from_string(placement.device_of(name))
        for variable in built[name].weights:
            found = tf.DeviceSpec.from_string(variable.device)
            if (found.device_type, found.device_index) != (wanted.device_type.upper(),
                                                            wanted.device_index):
                raise RuntimeError(f"model placement: variable {variable.name} of layer {name} "
                                   f"is on {variable.device or 'no device'}, not on "
                                   f"{placement.device_of(name)}; create the layer's variables "
                                   "inside the layer (in build), not before")


def pin(model, placement: Placement):
    """Run each layer's `call` inside its stage's device scope (call-time placement)."""
    for layer in model.layers:
        if layer.name in placement.layers and not getattr(layer, "_tftrain_pinned", False):
            layer.call = _on_device(layer.call, placement.device_of(layer.name))
            layer._tftrain_pinned = True
            layer._tftrain_device = placement.device_of(layer.name)
    return model


def pin_updates(optimizer) -> None:
    """Run the optimizer's update of each variable on the variable's device (the default
    strategy's `extended.update` does not colocate it, so a placed model's updates would
    all land on one device)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    for name in ("_update_step", "_update_step_xla"):
        step = getattr(inner, name)

        def on_variable_device(gradient, variable, *rest, _step=step):
            with tf.device(variable.device):
                return _step(gradient, variable, *rest)
        setattr(inner, name, on_variable_device)


def _on_device(call, device: str):
    @functools.wraps(call)
    def placed(*args, **kwargs):
        with tf.device(device):
            return call(*args, **kwargs)
    return placed


def _gradients(net, x, y, loss, parts: int):
    """A function computing the gradients of (x, y) in `parts` micro-batches (summed to
    one number, so the call waits for all of them)."""
    piece = int(x.shape[0]) // parts

    @tf.function
    def step():
        total = []
        for i in range(parts):
            xs, ys = x[i * piece:(i + 1) * piece], y[i * piece:(i + 1) * piece]
            g = tf.gradients(loss(ys, net(xs, training=False)), net.trainable_variables)
            total.append(tf.add_n([tf.reduce_sum(t) for t in g if t is not None]))
        return tf.add_n(total)
    return step


def _median_times(functions: dict, repeats: int) -> dict:
    """Median seconds of each function's call, timed in interleaved rounds."""
    import time

    for fn in functions.values():
        fn()                                         # trace
    times: dict = {name: [] for name in functions}
    names = list(functions)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            functions[name]().numpy()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def fastest_microbatches(net, batch: int, loss, candidates=(1, 2, 4, 8),
                         repeats: int = 3) -> tuple[int, dict]:
    """`model.placement.microbatches: auto`: the count, of `candidates` dividing `batch`,
    whose forward and backward pass of one batch of random inputs ran fastest on the
    placed model `net` ({count: milliseconds} beside it). Measured, not assumed: stages
    on CPU devices share one thread pool, so pipelining there buys what running two
    micro-batches side by side on the cores buys, not GPipe's overlap."""
    shape = [batch, *net.inputs[0].shape[1:]]
    x = (tf.random.stateless_uniform(shape, [1, 2]) if net.inputs[0].dtype.is_floating
         else tf.zeros(shape, net.inputs[0].dtype))
    y = tf.zeros([batch], tf.int32)
    counts = [m for m in candidates if batch % m == 0]
    times = _median_times({m: _gradients(net, x, y, loss, m) for m in counts}, repeats)
    best = min(counts, key=lambda m: times[m])
    return best, {m: round(t * 1e3, 2) for m, t in times.items()}


def measure_bubble(net, placement: Placement, x, y, loss, repeats: int = 5) -> dict:
    """Idle fraction of the pipeline, measured on batch (x, y): the forward and backward
    pass run as one batch (stages strictly in turn: T1) and as M micro-batches (TM);
    the stages' busy time is T1, so the idle fraction is 1 - T1 / (K x TM). Gradients
    only, in inference mode: weights, optimizer and batch-norm statistics are untouched."""
    m = placement.microbatches
    times = _median_times({"one": _gradients(net, x, y, loss, 1),
                           "piped": _gradients(net, x, y, loss, m)}, repeats)
    t1, tm = times["one"], times["piped"]
    return {"step_ms_one_batch": t1 * 1e3, "step_ms_pipelined": tm * 1e3,
            "bubble_measured": max(0.0, 1.0 - t1 / (placement.num_stages * tm))}
