"""Inception-ResNet's scaled residual sums in a form QAT quantizes.

Keras Applications' InceptionResNetV2 adds each of its 40 blocks' branch to the block's
input scaled by a constant (`CustomScaleLayer`: `x + branch * scale`, its own layer in
both Kerases). tfmot has no config for it and refused the model. The TFLite converter
writes it as a MUL by the constant and an ADD, and an int8 file needs a range for each of
their outputs: `ScaledSum` computes the same sum with the scaled branch fake-quantized
to 8 bits (a moving-average range of its own, learned and calibrated as every activation
range is), and tfmot's output config gives the sum its range, so both ops are int8.
"""
from __future__ import annotations

from tensorflow_model_optimization.python.core.quantization.keras import quantizers
from tf_keras.src.applications.inception_resnet_v2 import CustomScaleLayer

from tftrain.compress.qat_base import fake_quant
from tftrain.core.keras import keras

# QAT rebuilds every layer from its config by class name (the layer is not registered)
keras.utils.get_custom_objects().setdefault("CustomScaleLayer", CustomScaleLayer)


@keras.utils.register_keras_serializable("tftrain")
class ScaledSum(keras.layers.Layer):
    """`inputs[0] + inputs[1] * scale`, the product fake-quantized to 8 bits under QAT
    (`of(custom_scale_layer)` builds it with that layer's name and scale)."""

    def __init__(self, scale, **kwargs):
        super().__init__(**kwargs)
        self.scale = float(scale)
        self._quantizer = quantizers.MovingAverageQuantizer(num_bits=8, per_axis=False,
                                                            symmetric=False, narrow_range=False)

    @classmethod
    def of(cls, layer):
        return cls(layer.scale, name=layer.name, dtype=layer.dtype_policy)

    def build(self, input_shape):
        self._range = self._quantizer.build(None, "product_range", self)
        super().build(input_shape)

    def call(self, inputs, training=None):
        training = False if training is None else training
        product = fake_quant(self._quantizer, inputs[1] * self.scale, self._range, training)
        return inputs[0] + product

    def compute_output_shape(self, input_shape):
        return input_shape[0]

    def get_config(self):
        return {**super().get_config(), "scale": self.scale}


def is_scaled_sum(layer) -> bool:
    """Inception-ResNet's layer, or its quantizable form."""
    return isinstance(layer, (CustomScaleLayer, ScaledSum))
