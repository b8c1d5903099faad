"""MobileNetV3's hard-sigmoid and hard-swish as layers (`tensor_ops.as_layers` makes them
from the operations Keras Applications write), and the form of hard-swish int8 files
run fastest (`unfused`)."""
from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras


@keras.utils.register_keras_serializable("tftrain")
class HardSigmoid(keras.layers.Layer):
    """relu6(x + 3) / 6: MobileNetV3's gate (TFLite folds it into the layers around it
    in float, and runs it as ADD with a fused RELU6 and a MUL in int8)."""

    def call(self, x):
        return tf.nn.relu6(x + 3.0) * (1.0 / 6.0)


@keras.utils.register_keras_serializable("tftrain")
class HardSwish(keras.layers.Layer):
    """x * relu6(x + 3) / 6: MobileNetV3's activation (TFLite's HARD_SWISH in float).
    Traced inside `unfused(...)` and named there, it is written (x / 6) * relu6(x + 3), a
    form the TFLite converter does not fuse: post-training int8 then gets an int8 MUL, ADD
    (RELU6 fused) and MUL, which XNNPack runs, instead of an int8 HARD_SWISH, which it
    does not (MobileNetV3Small's int8 file ran at 0.47x the float file's speed for it).
    (The converter's own calibration held `x / 6` on the product's range, its result
    written over it in place: `export.calibration` measures each tensor's own.) An input
    far larger than relu6's [0, 6] (`UNFUSED_MAX`) is left fused: LiteRT's int8 ADD of x
    and 3 into [0, 6] at a scale ratio of 423 gave 6 for x = -1275, where the int8
    HARD_SWISH kernel computes it right."""

    def call(self, x):
        if self.name not in HardSwish.unfused_names:
            return x * (tf.nn.relu6(x + 3.0) * (1.0 / 6.0))
        return (x * (1.0 / 6.0)) * tf.nn.relu6(x + 3.0)


HardSwish.unfused_names = frozenset()
# the largest |input| (on the calibration examples) a HardSwish layer is traced unfused
# for: its int8 ADD then rescales by at most UNFUSED_MAX / 6 into relu6's [0, 6]
UNFUSED_MAX = 96.0


@contextlib.contextmanager
def unfused(names):
    """Inside: the `HardSwish` layers named trace in the form the converter leaves
    unfused."""
    HardSwish.unfused_names = frozenset(names)
    try:
        yield
    finally:
        HardSwish.unfused_names = frozenset()


def unfusable(model, x) -> list[str]:
    """The `HardSwish` layers of `model` whose input stays within `UNFUSED_MAX` on `x`."""
    layers = [layer for layer in model.layers if isinstance(layer, HardSwish)]
    if not layers:
        return []
    probe = keras.Model(model.inputs, [layer.input for layer in layers])
    found = [probe(x[i:i + 64], training=False) for i in range(0, len(x), 64)]
    found = [f if isinstance(f, (list, tuple)) else [f] for f in found]
    return [layer.name for k, layer in enumerate(layers)
            if max(float(np.max(np.abs(np.asarray(f[k])))) for f in found) <= UNFUSED_MAX]


def has_hard_swish(model) -> bool:
    return any(isinstance(layer, HardSwish) for layer in model.layers)
