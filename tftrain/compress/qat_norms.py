"""Batch normalization that no convolution precedes, in a form QAT quantizes.

tfmot quantizes a batch norm only by folding it into the convolution or dense layer
before it. A pre-activation network (ResNetV2, the DenseNets) normalizes a residual sum
or a concatenation (batch norm -> ReLU -> convolution): there is nothing to fold into,
and tfmot refused the whole model. At inference a batch norm is an affine map per
channel, `x * scale + offset` with scale = gamma / sqrt(variance + epsilon) and offset =
beta - mean * scale, which the TFLite converter writes as an int8 MUL and an int8 ADD
(XNNPack runs both). For QAT tftrain swaps such a batch norm for `ChannelAffine`: that
map, with `scale` and `offset` trainable, an 8-bit range learned for the product and one
for the output (`ChannelAffineQuantizeConfig`).

Freezing the statistics is the usual practice of quantization-aware fine-tuning (the
int8 file computes with the statistics the QAT model ends with): the moving mean and
variance stop updating, the per-channel scale and shift still learn. The recipe
therefore wants statistics that fit the data before QAT (tftrain re-estimates them at
the end of each stage, `train.recalibrate_batch_norm`).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow_model_optimization.python.core.quantization.keras import quantizers
from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
    default_8bit_quantize_configs as configs,
)

from tftrain.compress.qat_base import fake_quant
from tftrain.core.keras import keras


def standalone_norms(model, folded_into: tuple[str, ...]) -> set[str]:
    """Names of the batch norms over the last axis in `model` that tfmot cannot fold:
    their input is not the output of one layer of a kind in `folded_into` that feeds
    nothing else (tfmot's fold patterns match only a convolution whose one consumer is
    the batch norm: DenseNet's first convolution also feeds a concatenation)."""
    entries = model.get_config()["layers"]
    kinds = {entry["name"]: entry["class_name"] for entry in entries}
    inbound = {entry["name"]: [item[0] for node in entry.get("inbound_nodes", [])
                               for item in node if isinstance(item, (list, tuple))]
               for entry in entries}
    readers: dict[str, int] = {}
    for names in inbound.values():
        for name in names:
            readers[name] = readers.get(name, 0) + 1
    found = set()
    for layer in model.layers:
        if type(layer) is not keras.layers.BatchNormalization or not _last_axis(layer):
            continue
        sources = inbound.get(layer.name, [])
        if not (len(sources) == 1 and kinds.get(sources[0]) in folded_into
                and readers.get(sources[0]) == 1):
            found.add(layer.name)
    return found


def _last_axis(layer) -> bool:
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    try:
        rank = len(layer.input_shape)
    except (AttributeError, RuntimeError):       # not built, or called on several shapes
        return False
    return [a % rank for a in axes] == [rank - 1]


@keras.utils.register_keras_serializable("tftrain")
class ChannelAffine(keras.layers.Layer):
    """`x * scale + offset` per channel (last axis): an inference-mode batch norm with
    trainable scale and offset. `of(batch_norm)` builds it with the batch norm's name;
    `adopt(weights)` takes the batch norm's weights in their order (gamma and beta if it
    has them, moving mean, moving variance). Under QAT the product's 8-bit range is
    learned here (a moving-average quantizer, as tfmot's for activations), so the
    converter writes an int8 MUL, not a float one between a dequantize and a quantize."""

    def __init__(self, epsilon=1e-3, center=True, scale=True, **kwargs):
        super().__init__(**kwargs)
        self.epsilon, self.center, self.has_scale = float(epsilon), bool(center), bool(scale)
        self._quantizer = quantizers.MovingAverageQuantizer(num_bits=8, per_axis=False,
                                                            symmetric=False, narrow_range=False)

    @classmethod
    def of(cls, batch_norm):
        return cls(batch_norm.epsilon, batch_norm.center, batch_norm.scale,
                   name=batch_norm.name, dtype=batch_norm.dtype_policy)

    def build(self, input_shape):
        channels = int(input_shape[-1])
        self.scale = self.add_weight("scale", (channels,), initializer="ones")
        self.offset = self.add_weight("offset", (channels,), initializer="zeros")
        self._range = self._quantizer.build(None, "product_range", self)
        super().build(input_shape)

    def adopt(self, values: list[np.ndarray]) -> None:
        """Take a batch norm's weights: scale = gamma / sqrt(variance + epsilon), offset =
        beta - mean * scale (computed in float64)."""
        values = [np.asarray(v, "float64") for v in values]
        gamma = values.pop(0) if self.has_scale else 1.0
        beta = values.pop(0) if self.center else 0.0
        mean, variance = values
        scale = gamma / np.sqrt(variance + self.epsilon)
        self.scale.assign((scale * np.ones_like(mean)).astype("float32"))
        self.offset.assign((beta - mean * scale).astype("float32"))

    def call(self, inputs, training=None):
        product = inputs * tf.cast(self.scale, inputs.dtype)
        training = False if training is None else training
        product = fake_quant(self._quantizer, product, self._range, training)
        return product + tf.cast(self.offset, inputs.dtype)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon, "center": self.center,
                "scale": self.has_scale}


@keras.utils.register_keras_serializable("tftrain")
class ChannelAffineQuantizeConfig(configs.Default8BitOutputQuantizeConfig):
    """The output's 8-bit range (the product's is the layer's own); no weight quantizer:
    the converter quantizes the constant scale and offset of an int8 MUL and ADD."""
