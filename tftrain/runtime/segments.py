"""A functional model's layers cut into segments for activation recomputation
(`train.recompute`; the recomputing forward pass is `tftrain.training.recompute`).

The layers are taken in the order Keras runs them (its nodes by depth). Between two
layers, the tensors that are live (made before, read after) are what a segment boundary
keeps for the backward pass. `blocks` cuts where one tensor is live (between residual
blocks, transformer layers, the layers of a plain stack) and merges the pieces into
segments of the size that keeps least (`kept_bytes`; the square root of the layer count
of Chen et al. 2016 is one of the sizes tried); `every: K`
cuts every K layers, keeping whatever is live there. `kept_bytes` estimates what a step
keeps then, for the planner.
"""
from __future__ import annotations

from dataclasses import dataclass

from tftrain.config import ConfigError
from tftrain.core import internals


@dataclass(frozen=True)
class Segment:
    """Layers `start` to `stop` (exclusive) of the model's order: the ids of the tensors
    they read from before (`inputs`) and those read after them (`outputs`)."""
    start: int
    stop: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def layer_calls(model) -> list:
    """The model's layer calls in the order Keras runs them (`Functional._run_internal_graph`)."""
    return [n for n in internals.nodes_in_order(model) if not n.is_input]


def _live(model, nodes) -> list[tuple[str, ...]]:
    """For each boundary i (before node i, and after the last), the tensor ids made before
    it and read at or after it (or returned by the model)."""
    made_at = {str(id(x)): -1 for x in model.inputs}
    for i, node in enumerate(nodes):
        for t in node.flat_output_ids:
            made_at[t] = i
    last_read = {t: -1 for t in made_at}
    for i, node in enumerate(nodes):
        for t in node.flat_input_ids:
            last_read[t] = max(last_read[t], i)
    for x in model.outputs:
        last_read[str(id(x))] = len(nodes)
    return [tuple(t for t in made_at if made_at[t] < i <= last_read[t])
            for i in range(len(nodes) + 1)]


def segments(model, mode: str, every: int | None = None) -> list[Segment]:
    """The model's segments for `mode`: "blocks" or "every" (`every` layers each)."""
    if not internals.is_graph_network(model):
        raise ConfigError(
            f"train.recompute: model '{model.name}' is not a functional model (a subclassed "
            "model's layers cannot be segmented); use train.recompute: none")
    nodes = layer_calls(model)
    live = _live(model, nodes)
    n = len(nodes)
    if mode == "every":
        return _cut(live, list(range(every, n, every)))
    single = [i for i in range(1, n) if len(live[i]) == 1]
    options = {}
    for target in range(1, n + 1):       # each size's segments, by the same greedy cut
        found = _cut(live, _greedy(single, n, target))
        options.setdefault(tuple(s.start for s in found), found)
    sizes = _activation_bytes(nodes)
    # (one segment recomputes nothing: the last runs once; uncapped, so that a small model
    # whose every choice reaches what all its layers keep is still cut)
    options = {key: found for key, found in options.items() if len(found) > 1} or options
    kept = {key: _kept(nodes, found, sizes) for key, found in options.items()}
    least = min(kept.values())
    # the fewest segments within WITHIN of the least memory: fewer segments leave a longer
    # last one, which runs once (the square root of the layer count, Chen et al.'s size,
    # kept a transformer's two layers per segment: 1.8x the memory of one)
    return min((found for key, found in options.items() if kept[key] <= least * WITHIN),
               key=len)


# how far above the least memory a segmentation with fewer segments may keep
WITHIN = 1.25


def _activation_bytes(nodes) -> dict[str, float]:
    """What each layer call keeps for the backward pass, per example, as the planner counts
    it (`placement.activation_bytes`: nothing for views and activations fused into the
    batch norm before them, attention's scores), its parents read from the calls."""
    from tftrain.runtime.placement import activation_bytes
    made_by = {t: type(node.layer).__name__ for node in nodes for t in node.flat_output_ids}
    return {node.layer.name: activation_bytes(
        node.layer, [made_by[t] for t in node.flat_input_ids if t in made_by]) for node in nodes}


def _greedy(single: list[int], n: int, target: int) -> list[int]:
    """Cuts at single-tensor boundaries at least `target` layers apart."""
    cuts, last = [], 0
    for i in single:
        if i - last >= target:
            cuts.append(i)
            last = i
    if cuts and n - cuts[-1] < target:       # a short tail joins the segment before it
        cuts.pop()
    return cuts


def _cut(live, cuts: list[int]) -> list[Segment]:
    bounds = [0, *cuts, len(live) - 1]
    return [Segment(a, b, live[a], live[b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def describe(found: list[Segment], mode: str, every: int | None = None) -> str:
    sizes = [s.stop - s.start for s in found]
    how = "cut between single tensors" if mode == "blocks" else f"every {every} layers"
    return (f"{len(found)} segments of {min(sizes)}-{max(sizes)} layers ({how}), "
            f"{sum(len(s.inputs) for s in found)} tensors kept between them")


def kept_bytes(model, found: list[Segment], activation_bytes: dict[str, float]) -> float:
    """Activation bytes per example a step keeps with recomputation: the tensors at the
    segments' boundaries, and the largest segment's own activations twice (recomputed in
    its backward pass, beside their gradients), at most what every layer's outputs take
    (a model of few segments). `activation_bytes`: per layer name, what the layer's
    outputs take per example (`tftrain.runtime.placement.LayerCost`)."""
    nodes = layer_calls(model)
    return min(_kept(nodes, found, activation_bytes),
               sum(activation_bytes.get(n.layer.name, 0.0) for n in nodes))


def _kept(nodes, found: list[Segment], activation_bytes: dict[str, float]) -> float:
    made_by = {t: node.layer.name for node in nodes for t in node.flat_output_ids}
    boundaries = {t for s in found for t in s.inputs if t in made_by}
    kept = sum(activation_bytes.get(made_by[t], 0.0) / max(1, _outputs(nodes, made_by[t]))
               for t in boundaries)
    inside = max(sum(activation_bytes.get(n.layer.name, 0.0) for n in nodes[s.start:s.stop])
                 for s in found)
    return kept + 2 * inside


def _outputs(nodes, name: str) -> int:
    return next(len(n.flat_output_ids) for n in nodes if n.layer.name == name)
