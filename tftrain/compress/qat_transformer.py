"""Transformer layers in forms QAT quantizes: every matmul between int8 tensors.

Keras's `MultiHeadAttention` is a layer of `EinsumDense` sublayers that tfmot cannot
wrap (it has no config for it, and a wrapper sees one layer, not its four projections),
so under `skip_unsupported` a transformer's attention stayed float. For QAT tftrain
swaps it for `QuantizableAttention`: the same weights (each projection's kernel as a 2-D
matrix, the layout TFLite's FULLY_CONNECTED takes) and the same arithmetic, written as
projections, reshapes, transposes and two batched matmuls, with an 8-bit fake-quant on
every tensor a matmul reads: the scaled queries, the keys, the values, the attention
logits (softmax's input), the attention weights (its output, range [0, 1]) and the
context. `AttentionQuantizeConfig` adds per-tensor symmetric 8-bit kernels (tfmot's
Dense scheme, prune-preserving if asked) and the output's range, so the TFLite converter
writes int8 FULLY_CONNECTED, BATCH_MATMUL and SOFTMAX ops with the ranges QAT learned.
(Model Garden's `official/projects/qat/nlp` quantizes attention the same way.) The
1/sqrt(key_dim) scale of the queries is folded into the query projection, so the
projection's int8 output is the scaled query.

A Dense on a sequence (`[B, T, D]`) computes with `tensordot`, whose reshape between
matmul and bias leaves TFLite's FULLY_CONNECTED float; `SequenceDense` is the same
layer as one matmul with its bias over the leading axes flattened (`last_axis_dense`),
which converts to one int8 FULLY_CONNECTED between reshapes. (An einsum
`"...d,de->...e"`, the form before, trained over 100x slower on CPU.) Layer
normalization has no int8 kernel in TFLite: `PlainLayerNorm` computes it in float as
mean, variance and rsqrt (nine TFLite ops instead of the eighteen of Keras's fused
form), between a dequantize and the quantize of its output range.
"""
from __future__ import annotations

import math

import tensorflow as tf
from tensorflow_model_optimization.python.core.keras.utils import smart_cond
from tensorflow_model_optimization.python.core.quantization.keras import quantizers

from tftrain.compress.qat_base import PrunePreservingConfig, fake_quant
from tftrain.core import internals
from tftrain.core.keras import keras

# the tensors inside attention that an int8 kernel reads, each with its own 8-bit range
INTERNAL = ("query", "key", "value", "logits", "weights", "context")
PROJECTIONS = ("query", "key", "value", "output")


@keras.utils.register_keras_serializable("tftrain")
class QuantizableAttention(keras.layers.Layer):
    """Self- or cross-attention computing what `MultiHeadAttention` computes (no mask,
    no dropout at inference), with each projection a 2-D kernel and the tensors between
    its matmuls fake-quantized to 8 bits. Built with `of(mha)`; its weights, in
    `MultiHeadAttention`'s order, are the originals reshaped."""

    def __init__(self, num_heads, key_dim, value_dim=None, use_bias=True, dropout=0.0,
                 **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.value_dim = int(value_dim or key_dim)
        self.use_bias, self.dropout = use_bias, float(dropout)
        self._quantizer = quantizers.MovingAverageQuantizer(num_bits=8, per_axis=False,
                                                            symmetric=False, narrow_range=False)

    @classmethod
    def of(cls, mha):
        """The quantizable form of a Keras `MultiHeadAttention` (default projections: one
        attention axis, output width = query width)."""
        c = internals.attention(mha)
        if c["attention_axes"] not in (None, (1,), [1]) or c["output_shape"] is not None:
            raise ValueError(f"layer {mha.name}: MultiHeadAttention with attention_axes or "
                             "output_shape has no int8 form here")
        return cls(c["num_heads"], c["key_dim"], c["value_dim"], c["use_bias"], c["dropout"],
                   name=mha.name, dtype=mha.dtype_policy)

    def adopt(self, weights) -> None:
        """Take a `MultiHeadAttention`'s weights (its order), the query projection
        scaled by 1/sqrt(key_dim)."""
        scale = 1.0 / math.sqrt(float(self.key_dim))
        for i, (value, weight) in enumerate(zip(weights, self.weights)):
            factor = scale if i < (2 if self.use_bias else 1) else 1.0
            weight.assign((value * factor).reshape(weight.shape))

    @staticmethod
    def source_weight(mha, name: str):
        """The `MultiHeadAttention` weight held here as `name` (e.g. query_kernel)."""
        projection, kind = name.rsplit("_", 1)
        return getattr(getattr(mha, f"_{projection}_dense"), kind)

    def build(self, input_shape):
        width = int(input_shape[-1])
        heads, kd, vd = self.num_heads, self.key_dim, self.value_dim
        shapes = {"query": (width, heads * kd), "key": (width, heads * kd),
                  "value": (width, heads * vd), "output": (heads * vd, width)}
        for name in PROJECTIONS:
            setattr(self, f"{name}_kernel", self.add_weight(
                f"{name}_kernel", shapes[name], initializer="glorot_uniform"))
            setattr(self, f"{name}_bias", self.add_weight(
                f"{name}_bias", shapes[name][1:], initializer="zeros") if self.use_bias else None)
        self._ranges = {name: self._quantizer.build(None, f"{name}_range", self)
                        for name in INTERNAL}
        super().build(input_shape)

    def _project(self, x, name):
        return last_axis_dense(x, getattr(self, f"{name}_kernel"), getattr(self, f"{name}_bias"))

    def _fake_quant(self, x, name, training):
        return fake_quant(self._quantizer, x, self._ranges[name], training)

    def _heads(self, x, size):
        # [B, T, heads * size] -> [B, heads, T, size]
        x = tf.reshape(x, [-1, x.shape[1], self.num_heads, size])
        return tf.transpose(x, [0, 2, 1, 3])

    def call(self, query, value=None, key=None, training=None):
        value = query if value is None else tf.cast(value, query.dtype)
        key = value if key is None else tf.cast(key, query.dtype)
        training = False if training is None else training
        q = self._project(query, "query")          # scaled by 1/sqrt(key_dim): `adopt`
        q = self._heads(self._fake_quant(q, "query", training), self.key_dim)
        k = self._heads(self._fake_quant(self._project(key, "key"), "key", training),
                        self.key_dim)
        v = self._heads(self._fake_quant(self._project(value, "value"), "value", training),
                        self.value_dim)
        logits = self._fake_quant(tf.matmul(q, k, transpose_b=True), "logits", training)
        weights = self._fake_quant(tf.nn.softmax(logits, axis=-1), "weights", training)
        if self.dropout:
            weights = smart_cond(training, lambda: tf.nn.dropout(weights, self.dropout),
                                 lambda: weights)
        context = tf.matmul(weights, v)                             # [B, heads, T, vd]
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]),
                             [-1, context.shape[2], self.num_heads * self.value_dim])
        context = self._fake_quant(context, "context", training)
        return self._project(context, "output")

    def compute_output_shape(self, input_shape):
        return input_shape

    def range_variables(self) -> list:
        """The min/max variables of the ranges inside (what calibration sets)."""
        return [v for name in INTERNAL for v in self._ranges[name].values()]

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "key_dim": self.key_dim,
                "value_dim": self.value_dim, "use_bias": self.use_bias,
                "dropout": self.dropout}


@keras.utils.register_keras_serializable("tftrain")
class AttentionQuantizeConfig(PrunePreservingConfig):
    """8-bit per-tensor symmetric kernels for the four projections of a
    `QuantizableAttention` (prune-preserving if asked) and an 8-bit range on its output;
    the ranges inside are the layer's own."""
    WEIGHTS, OUTPUT = tuple(f"{name}_kernel" for name in PROJECTIONS), True


@keras.utils.register_keras_serializable("tftrain")
class SequenceDense(keras.layers.Dense):
    """A Dense applied to the last axis of a sequence (or an image's pixels) as one
    matmul with its bias over the leading axes flattened (the form TFLite converts to
    one int8 FULLY_CONNECTED between reshapes); same weights and config. (Written as
    `einsum("...d,de->...e")`, its forward and backward pass on CPU took 505 ms against
    2.8 ms for a batch of 32 x 8 x 8 x 96 into 384 units: a QAT ConvNeXtTiny's update 33 s against
    2.3 s for the float model.)"""

    def call(self, inputs):
        return self.activation(last_axis_dense(inputs, self.kernel,
                                               self.bias if self.use_bias else None))


def last_axis_dense(x, kernel, bias=None):
    """`x @ kernel + bias` over the last axis of `x` (any rank): one matmul with its bias
    over the leading axes flattened, reshaped back; to a constant shape where all but the
    batch axis are known (a shape computed from the tensor is SHAPE, STRIDED_SLICE and
    CONCATENATION in TFLite, which XNNPack leaves: ConvNeXt's int8 file left the delegate
    four times a block)."""
    units = kernel.shape[-1]
    y = tf.matmul(tf.reshape(x, [-1, kernel.shape[0]]), tf.cast(kernel, x.dtype))
    if bias is not None:
        y = tf.nn.bias_add(y, tf.cast(bias, y.dtype))
    inner = x.shape[1:-1]
    y = tf.reshape(y, [-1, *inner.as_list(), units] if inner.is_fully_defined()
                   else tf.concat([tf.shape(x)[:-1], [units]], 0))
    y.set_shape(x.shape[:-1].concatenate([units]))
    return y


@keras.utils.register_keras_serializable("tftrain")
class PlainLayerNorm(keras.layers.LayerNormalization):
    """Layer normalization over the last axis written as mean, variance and rsqrt
    (Keras's form goes through a fused batch norm and shape arithmetic); same weights
    and config."""

    def call(self, inputs):
        mean, variance = tf.nn.moments(inputs, [-1], keepdims=True)
        y = (inputs - mean) * tf.math.rsqrt(variance + self.epsilon)
        if self.scale:
            y = y * tf.cast(self.gamma, y.dtype)
        if self.center:
            y = y + tf.cast(self.beta, y.dtype)
        return y


def on_sequence(layer) -> bool:
    """Whether `layer` is a plain Dense applied to inputs of rank 3 or more."""
    try:
        return type(layer) is keras.layers.Dense and len(layer.input_shape) > 2
    except (AttributeError, RuntimeError):        # not built, or called on several shapes
        return False


def last_axis_norm(layer) -> bool:
    """Whether `layer` is a Keras LayerNormalization over the last axis only."""
    if type(layer) is not keras.layers.LayerNormalization:
        return False
    try:
        rank = len(layer.input_shape)
    except (AttributeError, RuntimeError):
        return False
    return [a % rank for a in layer.axis] == [rank - 1]


@keras.utils.register_keras_serializable("tftrain")
class DenseQuantizeConfig(PrunePreservingConfig):
    """tfmot's Dense scheme (per-tensor 8-bit kernel, the activation's range) for a
    `SequenceDense`, prune-preserving if asked."""
    WEIGHTS, ACTIVATIONS = ("kernel",), ("activation",)
