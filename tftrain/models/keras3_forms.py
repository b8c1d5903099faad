"""Keras 3 objects that are not built-in layers, in tf_keras (`keras3.py` converts with
these): arithmetic ops on tensors as Keras Applications write them, the layers Keras
Applications define themselves, and activations tf_keras names or computes otherwise."""
from __future__ import annotations

import numpy as np

from tftrain.core.keras import keras
from tftrain.core import internals


def is_tensor(value) -> bool:
    """Whether a call argument is a Keras tensor (else a constant)."""
    return internals.is_symbolic(value)


# layers Keras Applications define themselves, in both Kerases: class -> module of
# `keras.src.applications` and `tf_keras.src.applications` (ConvNeXt's LayerScale and
# StochasticDepth, Inception-ResNet's CustomScaleLayer)
APPLICATION_LAYERS = {"LayerScale": "convnext", "StochasticDepth": "convnext",
                      "CustomScaleLayer": "inception_resnet_v2"}


def application_layer(package: str, layer):
    """The class of the same name in `package` ("keras" or "tf_keras"), built from the
    layer's own settings (its dtype as a name)."""
    import importlib

    kind = type(layer).__name__
    cls = getattr(importlib.import_module(f"{package}.src.applications.{APPLICATION_LAYERS[kind]}"),
                  kind)
    config = {k: v for k, v in layer.get_config().items() if k != "dtype"}
    policy = getattr(layer, "dtype_policy", None)
    return cls(**config, dtype=getattr(policy, "name", "float32"))


OP_LAYERS = {"Add": "Add", "Subtract": "Subtract", "Multiply": "Multiply"}
OPS = frozenset({"Add", "Subtract", "Multiply", "Divide", "TrueDivide"})   # (`op_layer`)


def op_layer(node):
    """(tf_keras layer, the tensors it is called on) for a Keras 3 arithmetic op node, as
    Keras Applications write them: `x + 3.0`, `x * (1 / 6)`, `x - c`, `x / c` as a
    `Rescaling`; `a + b`, `a - b`, `a * b` between tensors as `Add`, `Subtract`,
    `Multiply` (tf_keras's merge layers broadcast as the ops do). None: not one of them."""
    op = node.operation
    kind = type(op).__name__
    args = list(node.arguments.args)
    if node.arguments.kwargs or len(args) != 2 or \
            kind not in OPS:
        return None
    tensors = [a for a in args if is_tensor(a)]
    if len(tensors) == 2:
        name = OP_LAYERS.get(kind)
        return (getattr(keras.layers, name)(name=op.name), tensors) if name else None
    constant = args[1] if is_tensor(args[0]) else args[0]
    if np.ndim(constant) != 0:
        return None
    c, first = float(constant), is_tensor(args[0])
    scale, offset = {"Add": (1.0, c), "Multiply": (c, 0.0),
                     "Subtract": (1.0, -c) if first else (-1.0, c)}.get(kind, (None, None))
    if kind in ("Divide", "TrueDivide"):
        if not first or c == 0:
            return None
        scale, offset = 1.0 / c, 0.0
    return keras.layers.Rescaling(scale, offset, name=op.name), tensors


# Keras 3 activations tf_keras names otherwise or computes otherwise (tf_keras's
# `hard_sigmoid` is 0.2x + 0.5 clipped; Keras 3's is relu6(x + 3) / 6)
ACTIVATIONS = {"hard_silu": "HardSwish", "hard_swish": "HardSwish",
                "hard_sigmoid": "HardSigmoid"}
