"""Channel pruning: a physically narrower model with the surviving filters.

tfmot's magnitude pruning zeroes weights inside tensors of the same shape, so a pruned
model is neither smaller nor faster where it runs. Here whole channels go: every layer
that must keep the same channels is grouped (`ChannelGraph`: a convolution's or dense
layer's filters start a group; batch norms, depthwise convolutions, activations, pooling
and padding follow their input's channels; a residual add joins its inputs' groups; a
concatenation keeps each input's group in its own slice; the dense layer after a flatten
reads every spatial position's slice). Each group keeps the same share of its channels
(`widths`, chosen so the model's multiply-add FLOPs reach `target_flops`), the channels
with the largest filter norms summed over the group's producers (`select`), and
`narrowed` builds the functional model with only those, weights sliced.

A group that reaches the model's input or output, or a layer that mixes channels in a way
slicing cannot follow (layer normalization, attention, a reshape), keeps every channel.
A layer this module does not know (a custom layer) is refused with its name, never
skipped: `ChannelGraph` raises `ConfigError`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tftrain.config import ConfigError
from tftrain.core import internals
from tftrain.core.keras import keras
from tftrain.runtime.placement import layer_flops

KEY = "compression.pruning.structure"

PRODUCERS = ("Conv1D", "Conv2D", "Dense")
# channel-wise: output channel c depends on input channel c only
FOLLOWERS = ("BatchNormalization", "DepthwiseConv2D", "ReLU", "Activation", "Dropout",
             "SpatialDropout1D", "SpatialDropout2D", "GaussianNoise", "GaussianDropout",
             "MaxPooling1D", "MaxPooling2D", "AveragePooling1D", "AveragePooling2D",
             "GlobalAveragePooling1D", "GlobalAveragePooling2D", "GlobalMaxPooling1D",
             "GlobalMaxPooling2D", "ZeroPadding1D", "ZeroPadding2D", "Cropping1D",
             "Cropping2D", "UpSampling1D", "UpSampling2D", "Identity", "Preprocess",
             "LeakyReLU", "ELU", "HardSwish", "HardSigmoid")
MERGES = ("Add", "Subtract", "Multiply", "Maximum", "Minimum", "Average")
# layers tftrain knows that mix or fix their channels: their inputs and outputs keep all
# (a per-channel `Rescaling` or `Normalization` keeps them too: its constants are not sliced)
OPAQUE = ("InputLayer", "Reshape", "Permute", "LayerNormalization", "MultiHeadAttention",
          "Rescaling", "Normalization",
          "Embedding", "AudioFeatures", "TokenMean", "TermWeights", "PositionEmbedding", "Softmax",
          "UnitNormalization")


@dataclass
class Group:
    """Channels that must stay the same across `members`; `producers` create them."""
    width: int
    producers: list = field(default_factory=list)
    members: list = field(default_factory=list)
    fixed: str = ""              # why every channel stays ("" : prunable)


class ChannelGraph:
    """The channel groups of a functional model (see the module docstring).

    `spaces[layer]`: its output's last axis as segments `(group, size)` (a concatenation
    has several; a flatten repeats its input's once per spatial position)."""

    def __init__(self, model):
        if not internals.is_graph_network(model):
            raise ConfigError(f"{KEY}: channels needs a functional Keras model; "
                              f"{type(model).__name__} is subclassed (its graph cannot be "
                              "followed); build it with keras.Model(inputs, outputs) or use "
                              "structure: unstructured")
        self.model = model
        self._parent: list[int] = []
        self.groups: list[Group] = []
        self.spaces: dict[str, list[tuple[int, int]]] = {}
        self.inputs: dict[str, list[str]] = {}
        for entry in model.get_config()["layers"]:
            self._add(model.get_layer(entry["name"]), entry)
        for out in model.output_names if hasattr(model, "output_names") else []:
            for gid, _ in self.spaces[out]:
                self._fix(gid, f"{out} is a model output")

    # -- union-find over groups -------------------------------------------------------
    def _new(self, width: int, fixed: str = "") -> int:
        self._parent.append(len(self._parent))
        self.groups.append(Group(width, fixed=fixed))
        return len(self._parent) - 1

    def root(self, gid: int) -> int:
        while self._parent[gid] != gid:
            self._parent[gid] = self._parent[self._parent[gid]]
            gid = self._parent[gid]
        return gid

    def _union(self, a: int, b: int, layer) -> int:
        a, b = self.root(a), self.root(b)
        if a != b:
            ga, gb = self.groups[a], self.groups[b]
            if ga.width != gb.width:
                raise ConfigError(f"{KEY}: {layer.name} ({type(layer).__name__}) joins "
                                  f"{ga.width} and {gb.width} channels")
            self._parent[b] = a
            ga.producers += gb.producers
            ga.members += gb.members
            ga.fixed = ga.fixed or gb.fixed
        return a

    def _fix(self, gid: int, why: str) -> None:
        g = self.groups[self.root(gid)]
        g.fixed = g.fixed or why

    def group(self, gid: int) -> Group:
        return self.groups[self.root(gid)]

    # -- reading the model ----------------------------------------------------------------
    def _add(self, layer, entry) -> None:
        kind = type(layer).__name__
        nodes = entry["inbound_nodes"]
        if len(nodes) > 1:
            raise ConfigError(f"{KEY}: channels cannot follow {layer.name} ({kind}): the "
                              "layer is shared (called more than once); use structure: "
                              "unstructured")
        inputs = [i[0] for node in nodes for i in node]
        self.inputs[layer.name] = inputs
        spaces = [self.spaces[i] for i in inputs]
        width = int(_last(layer.output_shape))
        if kind in PRODUCERS:
            if getattr(layer, "groups", 1) != 1:
                raise ConfigError(f"{KEY}: channels cannot follow {layer.name} ({kind} with "
                                  f"groups={layer.groups}); use structure: unstructured")
            gid = self._new(width)
            if _mixes(layer):          # a softmax over the channels it produces
                self._fix(gid, f"{layer.name} ({kind}) applies a softmax across its channels")
            self.groups[gid].producers.append(layer.name)
            self.spaces[layer.name] = [(gid, width)]
        elif (kind in FOLLOWERS and not _mixes(layer)) or _channelwise(layer):
            if kind == "DepthwiseConv2D" and layer.depth_multiplier != 1:
                raise ConfigError(f"{KEY}: channels cannot follow {layer.name} "
                                  f"(DepthwiseConv2D with depth_multiplier="
                                  f"{layer.depth_multiplier}); use structure: unstructured")
            self.spaces[layer.name] = spaces[0]
        elif kind in MERGES:
            first = spaces[0]
            if any([s for _, s in other] != [s for _, s in first] for other in spaces[1:]):
                raise ConfigError(f"{KEY}: channels cannot follow {layer.name} ({kind}): its "
                                  "inputs' channels are arranged differently")
            merged = []
            for parts in zip(*spaces):
                gid = parts[0][0]
                for other, _ in parts[1:]:
                    gid = self._union(gid, other, layer)
                merged.append((gid, parts[0][1]))
            self.spaces[layer.name] = merged
        elif kind == "Concatenate" and layer.axis in (-1, len(layer.output_shape) - 1):
            self.spaces[layer.name] = [seg for s in spaces for seg in s]
        elif kind == "Flatten":
            shape = layer.input_shape
            positions = int(np.prod(shape[1:-1])) if len(shape) > 2 else 1
            self.spaces[layer.name] = spaces[0] * positions
        elif kind in OPAQUE or _mixes(layer):
            for space in spaces:
                for gid, _ in space:
                    self._fix(gid, f"{layer.name} ({kind}) mixes its channels")
            self.spaces[layer.name] = [(self._new(width, f"{layer.name} ({kind}) sets them"),
                                        width)]
        else:
            raise ConfigError(f"{KEY}: channels cannot follow {layer.name} ({kind}): tftrain "
                              "does not know how its channels relate to its inputs'; use "
                              "structure: unstructured, or build the model from Keras layers")
        for gid, _ in self.spaces[layer.name]:
            members = self.group(gid).members
            if layer.name not in members:
                members.append(layer.name)

    # -- what can go ------------------------------------------------------------------------
    def prunable(self) -> list[int]:
        """Roots of the groups that may lose channels."""
        roots = sorted({self.root(g) for g in range(len(self.groups))})
        return [g for g in roots if not self.groups[g].fixed and self.groups[g].producers]

    def kept_indices(self, space, keep: dict[int, np.ndarray]) -> np.ndarray:
        """Indices into a tensor's last axis (described by `space`) that survive."""
        parts, offset = [], 0
        for gid, size in space:
            chosen = keep.get(self.root(gid))
            parts.append(offset + (np.arange(size) if chosen is None else chosen))
            offset += size
        return np.concatenate(parts) if parts else np.arange(0)


def _channelwise(layer) -> bool:
    """A layer that keeps each channel apart though its class may not: a scalar
    `Rescaling`, a `Reshape` that only adds or drops axes of size 1 around the channels
    (EfficientNet's squeeze-excite: (C,) to (1, 1, C))."""
    kind = type(layer).__name__
    if kind == "Rescaling":
        return np.ndim(layer.scale) == np.ndim(layer.offset) == 0
    if kind != "Reshape":
        return False
    before = [d for d in layer.input_shape[1:] if d != 1]
    after = [d for d in layer.output_shape[1:] if d != 1]
    return before == after == [layer.output_shape[-1]] and layer.input_shape[-1] == after[0]


def _mixes(layer) -> bool:
    """An activation over the channel axis (softmax) rather than channel by channel: an
    Activation layer's, or one built into a convolution or dense layer."""
    name = getattr(getattr(layer, "activation", None), "__name__", "")
    return name in ("softmax", "log_softmax")


def _last(shape) -> int:
    shape = shape[0] if isinstance(shape, list) else shape
    return shape[-1] if shape and shape[-1] is not None else 0


# -- how many channels each group keeps --------------------------------------------------
def flops(model) -> float:
    """Multiply-add FLOPs per example of the convolutions and dense layers."""
    return sum(layer_flops(layer) for layer in model.layers
               if type(layer).__name__ in (*PRODUCERS, "DepthwiseConv2D"))


def _fraction(graph: ChannelGraph, space, counts: dict[int, int]) -> float:
    total = sum(size for _, size in space)
    kept = sum(counts.get(graph.root(gid), size) for gid, size in space)
    return kept / total if total else 1.0


def flops_with(graph: ChannelGraph, counts: dict[int, int]) -> float:
    """The model's FLOPs with `counts[group]` channels kept in each group."""
    total = 0.0
    for layer in graph.model.layers:
        kind = type(layer).__name__
        if kind not in (*PRODUCERS, "DepthwiseConv2D"):
            continue
        inside = [graph.spaces[i] for i in graph.inputs[layer.name]][0]
        share = _fraction(graph, inside, counts)
        if kind in PRODUCERS:
            share *= _fraction(graph, graph.spaces[layer.name], counts)
        total += layer_flops(layer) * share
    return total


def widths(graph: ChannelGraph, target_flops: float, min_channels: int = 4,
           multiple: int = 1) -> dict[int, int]:
    """Channels each prunable group keeps: the same share of every group (at least
    `min_channels`, and never more than it has), rounded to a `multiple` (the vector
    width runtimes tile channels by), the largest share whose FLOPs are at most
    `target_flops` of the dense model's."""
    groups = graph.prunable()
    dense = flops_with(graph, {})

    def counts(share):
        out = {}
        for g in groups:
            width = graph.groups[g].width
            kept = max(min_channels, int(round(share * width / multiple)) * multiple)
            out[g] = min(width, kept)
        return out

    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if flops_with(graph, counts(mid)) <= target_flops * dense:
            low = mid
        else:
            high = mid
    return counts(low)


# -- which channels ---------------------------------------------------------------------
def importance(graph: ChannelGraph, criterion: str = "l1") -> dict[int, np.ndarray]:
    """Per prunable group, each channel's importance: its filters' L1 (or L2) norm in
    every producer of the group, each producer's norms divided by their mean, summed; or
    (`bn`) the summed |gamma| of the group's batch norms; `auto`: `bn` for the groups
    with a scaled batch norm (a narrowed MobileNetV2 kept 0.91 of its accuracy after 66
    updates by |gamma|, 0.78 by L1), L1 for the others."""
    model = graph.model
    scores = {}
    for g in graph.prunable():
        group = graph.groups[g]
        total = np.zeros(group.width)
        norms = []
        if criterion in ("bn", "auto"):
            norms = [np.abs(model.get_layer(m).gamma.numpy()) for m in group.members
                     if type(model.get_layer(m)).__name__ == "BatchNormalization"
                     and model.get_layer(m).scale]
        if criterion != "bn" and not norms:
            order = 2 if criterion == "l2" else 1
            for name in group.producers:
                kernel = model.get_layer(name).kernel.numpy()
                flat = np.abs(kernel.reshape(-1, kernel.shape[-1])) ** order
                norms.append(flat.sum(0) ** (1.0 / order))
        if not norms:
            raise ConfigError(f"compression.pruning.importance: bn needs a batch norm with "
                              f"a scale in every group; {', '.join(group.producers)} has none; "
                              "use l1")
        for n in norms:
            total += n / max(float(n.mean()), 1e-12)
        scores[g] = total
    return scores


def select(graph: ChannelGraph, counts: dict[int, int], criterion: str = "l1"
           ) -> dict[int, np.ndarray]:
    """The surviving channels of each group, in their original order (ties: lower index)."""
    scores = importance(graph, criterion)
    return {g: np.sort(np.argsort(-scores[g], kind="stable")[:counts[g]]) for g in counts}


# -- the narrower model -----------------------------------------------------------------
def narrowed(graph: ChannelGraph, keep: dict[int, np.ndarray]):
    """A functional model with only the kept channels of every group, each layer's
    weights sliced from `graph.model`'s (same names, same dtype policy)."""
    model = graph.model

    def clone(layer):
        config = layer.get_config()
        if type(layer).__name__ in PRODUCERS:
            out = graph.kept_indices(graph.spaces[layer.name], keep)
            config["filters" if "filters" in config else "units"] = int(len(out))
        elif type(layer).__name__ == "Reshape" and _channelwise(layer):
            out = graph.kept_indices(graph.spaces[layer.name], keep)
            config["target_shape"] = (*tuple(config["target_shape"])[:-1], int(len(out)))
        return type(layer).from_config(config)

    narrow = keras.models.clone_model(model, clone_function=clone)
    for layer in model.layers:
        weights = layer.get_weights()
        if weights:
            narrow.get_layer(layer.name).set_weights(sliced(graph, layer, weights, keep))
    return narrow


def sliced(graph: ChannelGraph, layer, weights: list, keep) -> list:
    """`layer`'s weights with only the kept input and output channels."""
    kind = type(layer).__name__
    inputs = graph.inputs[layer.name]
    inside = graph.kept_indices(graph.spaces[inputs[0]], keep) if inputs else None
    out = graph.kept_indices(graph.spaces[layer.name], keep)
    if kind in PRODUCERS:
        kernel = np.take(np.take(weights[0], inside, axis=-2), out, axis=-1)
        return [kernel, *[np.take(w, out, axis=-1) for w in weights[1:]]]
    if kind == "DepthwiseConv2D":
        return [np.take(weights[0], out, axis=-2), *[np.take(w, out, axis=-1) for w in weights[1:]]]
    if kind == "BatchNormalization":
        return [np.take(w, out, axis=-1) for w in weights]
    if kind in OPAQUE:
        return weights
    raise ConfigError(f"{KEY}: channels cannot slice the weights of {layer.name} ({kind})")


def masked(graph: ChannelGraph, keep: dict[int, np.ndarray]):
    """The wide model computing what `narrowed` computes: every convolution and dense
    layer reads nothing from a pruned channel (its input weights there are zero)."""
    wide = keras.models.clone_model(graph.model)
    wide.set_weights(graph.model.get_weights())
    for layer in graph.model.layers:
        if type(layer).__name__ in PRODUCERS:
            inside = graph.kept_indices(graph.spaces[graph.inputs[layer.name][0]], keep)
            kernel, *rest = wide.get_layer(layer.name).get_weights()
            drop = np.setdiff1d(np.arange(kernel.shape[-2]), inside)
            kernel[..., drop, :] = 0
            wide.get_layer(layer.name).set_weights([kernel, *rest])
    return wide


@dataclass(frozen=True)
class ChannelPlan:
    """What channel pruning does to a model: channels kept per group, FLOPs before/after."""
    counts: dict
    flops_before: float
    flops_after: float
    groups: int

    def describe(self) -> str:
        return (f"{self.groups} channel groups narrowed, FLOPs {self.flops_before:,.0f} -> "
                f"{self.flops_after:,.0f} per example "
                f"({self.flops_after / max(self.flops_before, 1):.2f})")


def plan(model, target_flops: float, min_channels: int = 4,
         multiple: int = 1) -> tuple[ChannelGraph, ChannelPlan]:
    """The groups of `model` and the channels each keeps for `target_flops`."""
    graph = ChannelGraph(model)
    if not graph.prunable():
        raise ConfigError(f"{KEY}: channels found no group of channels the model can lose "
                          "(each reaches the input, the output or a layer that mixes "
                          "channels); use structure: unstructured")
    counts = widths(graph, target_flops, min_channels, multiple)
    return graph, ChannelPlan(counts, flops_with(graph, {}), flops_with(graph, counts),
                              len(counts))
