"""Quantization configs for layers tfmot's default 8-bit scheme leaves out.

tfmot's registry refuses `Conv1D` (its entry is commented out) and `MaxPooling1D`, and
knows nothing of tftrain's own layers, so a 1-D speech model could not be quantized at
all. TFLite runs a Conv1D as a Conv2D over a height-1 map; for QAT tftrain does the
same (`Conv1DAsConv2D`) and gives it the config tfmot gives Conv2D: per-output-channel
symmetric int8 kernels, an 8-bit activation range, and, for prune-preserving QAT, the
quantizer that keeps pruned zeros. Max pooling passes ranges through (no quantizer); the feature layer
of the speech models computes in float and only its output is quantized, so the int8
TFLite file takes a float waveform and runs every layer after the features in int8.
"""
from __future__ import annotations

from typing import Optional

from tensorflow_model_optimization.python.core.quantization.keras.collab_opts.prune_preserve import (  # noqa: E501
    prune_preserve_quantize_registry as pqat_registry,
)
from tensorflow_model_optimization.python.core.quantization.keras import quantizers
from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
    default_8bit_quantize_registry as registry,
)

import tensorflow as tf
from tf_keras.src.applications.convnext import LayerScale as ConvNeXtLayerScale

from tftrain.compress.qat_base import PrunePreservingConfig
from tftrain.core.keras import keras
from tftrain.models.hard_swish import HardSigmoid, HardSwish
from tftrain.models.tensor_ops import affine_of
from tftrain.models.applications import Preprocess
from tftrain.models.audio import AudioFeatures
from tftrain.compress import qat_transformer as qt
from tftrain.compress.qat_audio import SpectrumQuantizeConfig, matrix_form
from tftrain.compress.qat_norms import ChannelAffine, ChannelAffineQuantizeConfig
from tftrain.compress.qat_residual import ScaledSum, is_scaled_sum
from tftrain.models.text import TermWeights, TokenMean
from tftrain.models.transformer import PositionEmbedding


# ConvNeXt's layer scale (a layer of tf_keras's applications, not registered): QAT
# rebuilds every layer from its config by class name
keras.utils.get_custom_objects().setdefault("LayerScale", ConvNeXtLayerScale)


@keras.utils.register_keras_serializable("tftrain")
class Conv1DAsConv2D(keras.layers.Layer):
    """A Conv1D computed as a 2-D convolution over a height-1 map, with a [1, k, in, out]
    kernel: the layout TFLite runs a Conv1D in, and one tfmot's per-channel fake
    quantization and the TFLite converter both handle (a rank-3 kernel they do not).
    Same name, outputs and (reshaped) weights as the Conv1D it replaces for QAT."""

    def __init__(self, filters, kernel_size, strides=1, padding="valid", dilation_rate=1,
                 activation=None, use_bias=True, **kwargs):
        super().__init__(**kwargs)
        first = lambda v: int(v[0] if isinstance(v, (list, tuple)) else v)  # noqa: E731
        self.filters, self.kernel_size = int(filters), first(kernel_size)
        self.strides, self.dilation_rate = first(strides), first(dilation_rate)
        if padding not in ("valid", "same"):
            raise ValueError(f"padding {padding!r}: only valid/same Conv1D have an int8 form here")
        self.padding, self.use_bias = padding, use_bias
        self.activation = keras.activations.get(activation)

    @classmethod
    def of(cls, conv1d):
        if conv1d.groups != 1:
            raise ValueError(f"layer {conv1d.name}: grouped Conv1D has no int8 form here")
        return cls(conv1d.filters, conv1d.kernel_size, conv1d.strides, conv1d.padding,
                   conv1d.dilation_rate, keras.activations.serialize(conv1d.activation),
                   conv1d.use_bias, name=conv1d.name, dtype=conv1d.dtype_policy)

    def build(self, input_shape):
        channels = int(input_shape[-1])
        self.kernel = self.add_weight("kernel", (1, self.kernel_size, channels, self.filters))
        self.bias = self.add_weight("bias", (self.filters,), initializer="zeros") \
            if self.use_bias else None
        super().build(input_shape)

    def call(self, inputs):
        # conv, bias and activation on the 4-D map, so TFLite fuses them into one int8
        # CONV_2D; the reshapes around it stay int8
        y = tf.nn.conv2d(tf.expand_dims(inputs, 1), tf.cast(self.kernel, inputs.dtype),
                         [1, 1, self.strides, 1], self.padding.upper(),
                         dilations=[1, 1, self.dilation_rate, 1])
        if self.bias is not None:
            y = tf.nn.bias_add(y, tf.cast(self.bias, y.dtype))
        return tf.squeeze(self.activation(y), 1)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters,
                "kernel_size": self.kernel_size, "strides": self.strides,
                "padding": self.padding, "dilation_rate": self.dilation_rate,
                "activation": keras.activations.serialize(self.activation),
                "use_bias": self.use_bias}


@keras.utils.register_keras_serializable("tftrain")
class Conv1DQuantizeConfig(registry.Default8BitConvQuantizeConfig):
    """tfmot's Conv2D config (per-channel kernel, activation) for `Conv1DAsConv2D`, with
    the prune-preserving kernel quantizer if asked; serializable, since `quantize_apply`
    rebuilds configs from their config (a quantizer set on an instance is lost)."""

    def __init__(self, preserve_sparsity: bool = False):
        super().__init__(["kernel"], ["activation"], False)
        self.preserve_sparsity = preserve_sparsity
        if preserve_sparsity:
            self.weight_quantizer = pqat_registry.PrunePreserveDefault8BitConvWeightsQuantizer()

    def get_config(self):
        return {"preserve_sparsity": self.preserve_sparsity}


@keras.utils.register_keras_serializable("tftrain")
class DepthwisePrunePreserveConfig(registry.Default8BitConvQuantizeConfig):
    """tfmot's 8-bit DepthwiseConv2D config with the prune-preserving kernel quantizer.
    tfmot's prune-preserving scheme leaves depthwise kernels unmasked (its registry
    disables them), so QAT refilled their pruned zeros. `activation`: also quantize the
    layer's activation (not when a separate ReLU after it does). Serializable, as
    `Conv1DQuantizeConfig`."""

    def __init__(self, activation: bool = True):
        super().__init__(["depthwise_kernel"], ["activation"] if activation else [], False)
        self.activation = activation
        self.weight_quantizer = pqat_registry.PrunePreserveDefault8BitConvWeightsQuantizer()

    def get_config(self):
        return {"activation": self.activation}


@keras.utils.register_keras_serializable("tftrain")
class EmbeddingQuantizeConfig(PrunePreservingConfig):
    """An 8-bit embedding table: one symmetric range for the whole table (TFLite's int8
    GATHER keeps its table's scale on the rows it gathers, so the rows come out int8 at
    that scale), prune-preserving if asked; no activation of its own to quantize. tfmot
    has no config for `Embedding`, so a text model's table stayed float (a 1.45 MB
    "int8" file that was mostly a float32 table)."""
    WEIGHTS = ("embeddings",)


@keras.utils.register_keras_serializable("tftrain")
class PositionEmbeddingQuantizeConfig(PrunePreservingConfig):
    """A transformer's learned position table as 8-bit (one symmetric range) and its
    output's range: TFLite adds the gathered int8 token rows and the int8 position rows
    in one int8 ADD."""
    WEIGHTS, OUTPUT = ("positions",), True


class FixedRange(quantizers.Quantizer):
    """8-bit fake quantization over a range known in advance (a hard sigmoid's [0, 1]):
    no variable to learn or calibrate. A tfmot quantizer, so every context that changes
    what quantizers compute (`quantization.quantizers_bypassed` for the float function,
    `calibrate_ranges`, `ranges_held`) changes it too."""

    def __init__(self, low: float, high: float):
        self.low, self.high = float(low), float(high)

    def build(self, tensor_shape, name, layer):
        return {}

    def __call__(self, inputs, training, weights, **kwargs):
        return tf.quantization.fake_quant_with_min_max_args(inputs, self.low, self.high,
                                                            num_bits=8)

    def get_config(self):
        return {"low": self.low, "high": self.high}

    def __eq__(self, other):
        return isinstance(other, FixedRange) and self.get_config() == other.get_config()


_RELU6, _UNIT = FixedRange(0.0, 6.0), FixedRange(0.0, 1.0)


@keras.utils.register_keras_serializable("tftrain")
class QuantizableHardSigmoid(HardSigmoid):
    """`HardSigmoid` as the int8 file computes it: relu6(x + 3) on 8 bits of [0, 6] (an
    int8 ADD with a fused RELU6), then / 6 on 8 bits of [0, 1] (an int8 MUL): both
    ranges are known, so fixed (nothing to learn). Written as one expression, the
    converter would fuse it into HARD_SWISH (with the multiply by x), whose int8 kernel
    XNNPack does not run; without the inner range it would stay float."""

    def call(self, x):
        six = _RELU6(tf.nn.relu6(x + 3.0), False, {})
        return _UNIT(six * (1.0 / 6.0), False, {})


@keras.utils.register_keras_serializable("tftrain")
class QuantizableHardSwish(HardSwish):
    """`HardSwish` as x times `QuantizableHardSigmoid`: three int8 ops XNNPack runs (ADD
    with RELU6, MUL, MUL); its output range is learned (the layer's quantize config)."""

    def call(self, x):
        return x * QuantizableHardSigmoid.call(self, x)


def configs_for(model, preserve_sparsity: bool) -> dict:
    """The QuantizeConfig tftrain gives each layer of `model` that needs one, by name.

    tfmot quantizes a `DepthwiseConv2D -> BatchNormalization (-> ReLU)` chain as one op
    (TFLite folds the batch norm into the depthwise and fuses the ReLU) only when no layer
    of it has a config of its own; a depthwise with the prune-preserving config gets the
    same arrangement here, else tfmot refuses the batch norm: one 8-bit range, at the
    ReLU's output when a ReLU follows, else at the batch norm's. (A range at the batch
    norm's output before a ReLU too would round twice where the int8 file rounds once:
    MobileNetV2's depthwise layers then departed from the file by 30-34 dB each.)"""
    from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
        default_8bit_quantize_configs as configs,
    )
    configs_ = {}
    sources = _sources(model) if preserve_sparsity else {}
    consumers = _consumers(model) if preserve_sparsity else {}
    for layer in model.layers:
        source = sources.get(layer.name)
        if (isinstance(layer, keras.layers.BatchNormalization)
                and isinstance(source, keras.layers.DepthwiseConv2D)
                and consumers.get(source.name) == [layer]):        # (else not folded)
            relu = [c for c in consumers.get(layer.name, []) if _is_relu(c)]
            configs_[layer.name] = (configs.NoOpQuantizeConfig()
                                    if relu and len(consumers[layer.name]) == 1
                                    else configs.Default8BitOutputQuantizeConfig())
            configs_[source.name] = DepthwisePrunePreserveConfig(activation=False)
    for layer in model.layers:
        if layer.name not in configs_:
            config = config_for(layer, preserve_sparsity)
            if config is not None:
                configs_[layer.name] = config
    return configs_


def _is_relu(layer) -> bool:
    """A layer tfmot's conv-batch norm-ReLU transforms fuse (TFLite fuses it into the op)."""
    return isinstance(layer, keras.layers.ReLU) or (
        isinstance(layer, keras.layers.Activation)
        and getattr(layer.activation, "__name__", "") in ("relu", "relu6"))


def _consumers(model) -> dict:
    """The layers reading each layer's output, in this model's graph."""
    found: dict = {}
    for entry in model.get_config()["layers"]:
        for node in entry["inbound_nodes"]:
            for i in node:
                found.setdefault(i[0], []).append(model.get_layer(entry["name"]))
    return found


def _sources(model) -> dict:
    """The one layer feeding each single-input layer, in this model's graph (a layer
    shared with another model has nodes of that model's too)."""
    found = {}
    for entry in model.get_config()["layers"]:
        inbound = [i[0] for node in entry["inbound_nodes"] for i in node]
        if len(inbound) == 1:
            found[entry["name"]] = model.get_layer(inbound[0])
    return found


def config_for(layer, preserve_sparsity: bool) -> Optional[object]:
    """The QuantizeConfig tftrain gives `layer`, or None when tfmot's registry has one."""
    from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
        default_8bit_quantize_configs as configs,
    )

    if isinstance(layer, (keras.layers.MultiHeadAttention, qt.QuantizableAttention)):
        return qt.AttentionQuantizeConfig(preserve_sparsity)
    if qt.on_sequence(layer) or isinstance(layer, qt.SequenceDense):
        return qt.DenseQuantizeConfig(preserve_sparsity)
    if isinstance(layer, PositionEmbedding):
        return PositionEmbeddingQuantizeConfig(preserve_sparsity)
    if isinstance(layer, ChannelAffine):
        return ChannelAffineQuantizeConfig()
    if type(layer) in (keras.layers.Conv1D, Conv1DAsConv2D):
        return Conv1DQuantizeConfig(preserve_sparsity)
    if isinstance(layer, keras.layers.Embedding):
        return EmbeddingQuantizeConfig(preserve_sparsity)
    if preserve_sparsity and isinstance(layer, keras.layers.DepthwiseConv2D):
        return DepthwisePrunePreserveConfig()
    # pooling passes its input's range on: TFLite's int8 AVERAGE_POOL_2D needs its input's
    # scale at its output (a range of its own, tfmot's default, failed the conversion of
    # every DenseNet after QAT); a hard sigmoid's ranges are fixed
    if isinstance(layer, (keras.layers.MaxPooling1D, keras.layers.GlobalMaxPooling1D,
                          keras.layers.AveragePooling1D, keras.layers.AveragePooling2D,
                          HardSigmoid)):
        return configs.NoOpQuantizeConfig()
    # an elementwise product (squeeze-excite's, ConvNeXt's layer scale) and an affine map
    # (input rescaling) are int8 MUL and ADD in TFLite: their output range is learned
    if isinstance(layer, (HardSwish, keras.layers.Multiply, keras.layers.Rescaling,
                          keras.layers.Normalization, ConvNeXtLayerScale)):
        return configs.Default8BitOutputQuantizeConfig()
    # Inception-ResNet's scaled residual sum: int8 MUL (its product's range the layer's
    # own, `qat_residual`) and int8 ADD (this range)
    if is_scaled_sum(layer):
        return configs.Default8BitOutputQuantizeConfig()
    if matrix_form(layer):
        return SpectrumQuantizeConfig()
    # layer normalization computes in float (TFLite has no int8 kernel for it): its output
    # is quantized, so the int8 ops around it read int8
    if isinstance(layer, (AudioFeatures, Preprocess, TokenMean, TermWeights,
                          keras.layers.LayerNormalization)):
        return configs.Default8BitOutputQuantizeConfig()
    return None


def quantizable_form(layer, standalone_norm: bool = False):
    """A fresh copy of `layer` in the form QAT quantizes (a Conv1D as `Conv1DAsConv2D`;
    multi-head attention, a Dense on a sequence and layer normalization as
    `qat_transformer`'s forms; a batch norm nothing folds into, `standalone_norm`, as
    `qat_norms.ChannelAffine`; Inception-ResNet's scaled sum as `qat_residual.ScaledSum`)."""
    if standalone_norm:
        return ChannelAffine.of(layer)

    if type(layer) is keras.layers.Conv1D:
        return Conv1DAsConv2D.of(layer)
    if type(layer) is keras.layers.MultiHeadAttention:
        return qt.QuantizableAttention.of(layer)
    if qt.on_sequence(layer):
        return qt.SequenceDense.from_config(layer.get_config())
    if qt.last_axis_norm(layer):
        return qt.PlainLayerNorm.from_config(layer.get_config())
    if is_scaled_sum(layer):
        return ScaledSum.of(layer)
    if type(layer) in (HardSigmoid, HardSwish):
        form = QuantizableHardSigmoid if type(layer) is HardSigmoid else QuantizableHardSwish
        return form.from_config(layer.get_config())
    if isinstance(layer, keras.layers.Normalization) and affine_of(layer) is not None:
        # (x - mean) / std as x * scale + offset: int8 MUL and ADD (TFLite has no int8 DIV)
        scale, offset = affine_of(layer)
        return keras.layers.Rescaling([float(v) for v in scale], [float(v) for v in offset],
                                      name=layer.name)
    return layer.__class__.from_config(layer.get_config())


def supported(layer) -> bool:
    """Whether tftrain has a config of its own for this layer."""
    return config_for(layer, False) is not None


def quantize_input(model) -> bool:
    """Whether QAT should fake-quantize the model's input: not token ids (integers), nor
    a waveform feeding feature extraction (8 bits would lose the quiet frames; the
    int8 spectrum of `qat_audio` quantizes each frame at its own scale)."""

    if model.inputs[0].dtype.is_integer:
        return False
    first = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    # an input rescaling's output range is the input's quantization: quantizing the raw
    # input too would put its float MUL and ADD between a DEQUANTIZE and a QUANTIZE
    return not (first and isinstance(first[0], (AudioFeatures, keras.layers.Rescaling)))
