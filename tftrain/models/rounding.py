"""A functional model's own float32 rounding: its graph replayed node by node as Keras
runs it (`replay`), and how far rounding at every layer moves its outputs (`layer_noise`):
the scale another runtime's float computation of the same model (a SavedModel, a TFLite
file, Keras 3's form of it) may differ by. A trained network keeps it near float
rounding; an untrained deep one amplifies it."""
from __future__ import annotations

import numpy as np

from tftrain.core import internals
from tensorflow import nest

ULPS = 4      # each layer's output moved by this many units of float32 roundoff


def replay(model, x: np.ndarray, each, again: bool = False) -> list[np.ndarray]:
    """`model`'s outputs on `x`, its graph replayed node by node as Keras runs a
    functional model (each layer called with its own arguments, in inference mode), each
    single-output layer's value passed through `each(layer name, value)` before the
    layers after it read it. With `again`, `each` gets a third argument: a function that
    calls the layer once more on its inputs each passed through `perturb(name of the
    layer that made it, or None for the model's input, value)` (what the layer makes of
    its inputs moved)."""
    usage = internals.tensor_usage(model)
    tensors = {str(id(t)): [x] * usage[str(id(t))] for t in model.inputs}
    maker: dict[str, str] = {}          # tensor id -> the layer that made it
    graph = internals.nodes_by_depth(model)
    for depth in sorted(graph, reverse=True):
        for node in graph[depth]:
            if node.is_input:
                continue
            ids = internals.node_input_ids(node)
            inputs = {tensor_id: tensors[tensor_id][-1] for tensor_id in ids}
            outputs = _call(node, node.map_arguments(tensors))
            if len(outputs) == 1:
                def again_fn(perturb, node=node, ids=ids, inputs=inputs):
                    moved = {i: perturb(maker.get(i), value) for i, value in inputs.items()}
                    return _call(node, node.map_arguments(
                        {i: [moved[i]] * ids.count(i) for i in moved}))[0]
                outputs[0] = (each(node.layer.name, outputs[0], again_fn) if again
                              else each(node.layer.name, outputs[0]))
            for tensor_id, value in zip(node.flat_output_ids, outputs):
                tensors[tensor_id] = [value] * max(1, usage.get(tensor_id, 1))
                maker[tensor_id] = node.layer.name
    return [tensors[str(id(t))][0] for t in model.outputs]


def _call(node, arguments) -> list[np.ndarray]:
    """A node's layer called on `arguments` ((args, kwargs)), in inference mode."""

    args, kwargs = arguments
    if internals.takes_training(node.layer):
        kwargs = {**kwargs, "training": False}
    return [np.asarray(o) for o in nest.flatten(node.layer(*args, **kwargs))]


def layer_noise(model, x: np.ndarray, reference: np.ndarray, batch: int = 64) -> float:
    """The largest change of `model`'s first output (`reference`, on `x`) when each
    layer's output moves by `ULPS` units of roundoff, up or down at random, before the
    next layers read it. 0 for a model that is not a functional graph."""
    if not internals.has_graph(model):
        return 0.0
    rng = np.random.default_rng(1)

    def rounded(name, value):
        if value.dtype.kind != "f":
            return value
        signs = rng.choice([-1.0, 1.0], value.shape)
        return (value * (1.0 + ULPS * 2.0 ** -24 * signs)).astype(value.dtype)
    found = np.concatenate([np.asarray(replay(model, x[i:i + batch], rounded)[0], np.float32)
                            for i in range(0, len(x), batch)])
    return float(np.max(np.abs(found - np.asarray(reference, np.float32)[:len(found)])))
