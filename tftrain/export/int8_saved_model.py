"""A SavedModel whose kernels are stored as int8 with per-channel float32 scales.

The kernels of convolutions and dense layers are int8 variables and dequantized when the
model is called (`int8 * scale`); activations, biases and every other weight stay
float32. From a quantization-aware trained model the codes are the ones its fake-quant
ranges give, the values the int8 TFLite file holds (pruned zeros stay zeros); a float
model is quantized after training, per output channel, symmetric. A batch norm right
after a quantized layer is folded into it exactly: per channel, the codes keep their
values (their sign follows the multiplier's) and the scale takes the multiplier's size.

The artifact loads with `tf.saved_model.load` or `saved_model_cli` alone: its layers are
subclasses of Keras's own, saved as traced functions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tftrain.compress.qat_audio import held_form
from tftrain.core.keras import keras
from tftrain.core import internals

# layer class name -> the attributes holding the kernels it quantizes (an embedding's
# table: its rows are gathered from the int8 codes; QAT's attention: its four
# projections)
KERNELS = {"Dense": ("kernel",), "SequenceDense": ("kernel",), "Conv1D": ("kernel",),
           "Conv2D": ("kernel",), "DepthwiseConv2D": ("depthwise_kernel",),
           "Embedding": ("embeddings",), "PositionEmbedding": ("positions",),
           "QuantizableAttention": ("query_kernel", "key_kernel", "value_kernel",
                                    "output_kernel")}


@dataclass
class Codes:
    """A kernel as int8 codes and a float32 scale broadcast over its output channels
    (the kernel's last axis; for a depthwise kernel, its last two)."""
    values: np.ndarray          # int8, the kernel's shape
    scale: np.ndarray           # float32, the kernel's output-channel shape

    def dequantized(self) -> np.ndarray:
        return self.values.astype(np.float32) * self.scale


def _output_axes(class_name: str) -> int:
    return 2 if class_name == "DepthwiseConv2D" else 1


def weight_only_codes(kernel: np.ndarray, class_name: str) -> Codes:
    """Post-training symmetric int8 codes, one scale per output channel (max |w| / 127)."""
    channels = _output_axes(class_name)
    reduce = tuple(range(kernel.ndim - channels))
    scale = np.max(np.abs(kernel), axis=reduce) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    values = np.clip(np.round(kernel / scale), -127, 127).astype(np.int8)
    return Codes(values, scale)


def qat_codes(weight, quantizer, variables, class_name: str) -> Codes:
    """The int8 codes and scales a QAT layer's fake-quant ranges give its kernel (masked
    where prune-preserving): the fake-quantized kernel is exactly `codes * scale`."""
    value = tf.convert_to_tensor(weight)
    if "sparsity_mask" in variables:
        value = value * tf.cast(variables["sparsity_mask"], value.dtype)
    low = np.asarray(variables["min_var"], np.float64)
    high = np.asarray(variables["max_var"], np.float64)
    bits, narrow = quantizer.num_bits, quantizer.narrow_range
    if bits != 8:
        raise ValueError(f"an int8 SavedModel needs 8-bit kernels; the QAT scheme used {bits}")
    levels = 2 ** bits - 1 - int(narrow)
    scale = (high - low) / levels
    zero = np.round((1 if narrow else 0) - low / np.where(scale > 0, scale, 1)) - 2 ** (bits - 1)
    if np.any(zero[scale > 0] != 0):
        raise ValueError("an int8 SavedModel stores symmetric kernels; this QAT scheme "
                         "learned asymmetric ranges")
    fake = quantizer(value, training=False, weights=variables).numpy().astype(np.float64)
    scale = np.where(scale > 0, scale, 1.0)
    scale = np.broadcast_to(scale, fake.shape[fake.ndim - _output_axes(class_name):])
    values = np.round(fake / scale)
    if np.max(np.abs(values * scale - fake)) > 1e-6 * max(float(np.max(np.abs(fake))), 1e-12):
        raise ValueError("the fake-quantized kernel is not codes * scale")
    return Codes(np.clip(values, -127, 127).astype(np.int8), scale.astype(np.float32))


def fold_batch_norm(codes: Codes, bias, bn) -> tuple[Codes, np.ndarray]:
    """Codes and bias of a layer followed by the batch norm `bn` (inference form)."""
    weights = dict(zip((w.name.split("/")[-1].split(":")[0] for w in bn.weights), bn.get_weights()))
    channels = codes.scale.size
    gamma = weights.get("gamma", np.ones(channels, np.float32))
    beta = weights.get("beta", np.zeros(channels, np.float32))
    multiplier = gamma / np.sqrt(weights["moving_variance"] + bn.epsilon)
    multiplier = multiplier.reshape(codes.scale.shape)
    sign = np.where(multiplier < 0, -1, 1).astype(np.int8)
    folded = Codes((codes.values * sign).astype(np.int8),
                   (codes.scale * np.abs(multiplier)).astype(np.float32))
    bias = np.zeros(channels, np.float32) if bias is None else bias
    new_bias = (bias - weights["moving_mean"]) * multiplier.reshape(-1) + beta
    return folded, new_bias.astype(np.float32)


class _Int8Kernel:
    """Mixin: each kernel attribute (`kernel`, or several) is `int8 codes * scale`,
    computed at call time, from the variables `<attr>_int8` and `<attr>_scale`; no float
    kernel variable exists."""
    _kernel_attrs = ("kernel",)
    _channel_axes = 1

    def add_weight(self, name=None, shape=None, *args, **kwargs):
        if name not in self._kernel_attrs:
            return super().add_weight(name, shape, *args, **kwargs)
        channels = self._channel_axes
        setattr(self, f"{name}_int8", super().add_weight(
            name=f"{name}_int8", shape=shape, dtype=tf.int8, initializer="zeros",
            trainable=False))
        setattr(self, f"{name}_scale", super().add_weight(
            name=f"{name}_scale", shape=tuple(shape)[len(shape) - channels:],
            dtype=tf.float32, initializer="ones", trainable=False))
        return None

    def _dequantized(self, attr: str):
        return tf.cast(getattr(self, f"{attr}_int8"), tf.float32) * getattr(self, f"{attr}_scale")


_CLASSES: dict[type, type] = {}


def int8_class(cls: type) -> type:
    """`cls` (a layer class of `KERNELS`) with int8 kernels."""
    if cls not in _CLASSES:
        attrs = KERNELS[cls.__name__]
        _CLASSES[cls] = type(f"Int8{cls.__name__}", (_Int8Kernel, cls), {
            "_kernel_attrs": attrs, "_channel_axes": _output_axes(cls.__name__),
            **{attr: property(lambda self, attr=attr: self._dequantized(attr),
                              lambda self, value: None) for attr in attrs}})
    return _CLASSES[cls]


# --- activation ranges ------------------------------------------------------------------
class ActivationRanges(keras.layers.Wrapper):
    """Runs its layer, then fake-quantizes as the QAT model does at inference: before its
    activation (`pre`, e.g. softmax), after it (`post`) and on its output (`output`),
    each an 8-bit range learned in QAT, stored as float32 variables. `activation` is the
    layer's own, applied here when the layer itself computes linearly."""

    STAGES = ("pre", "post", "output")

    def __init__(self, layer, activation="linear", pre=None, post=None, output=None, **kwargs):
        super().__init__(layer, **kwargs)
        self.activation = keras.activations.get(activation)
        # stage -> (num_bits, narrow_range)
        self.quantized = {k: v for k, v in zip(self.STAGES, (pre, post, output)) if v}

    def build(self, input_shape):
        super().build(input_shape)
        self.ranges = {stage: (self.add_weight(f"{stage}_min", (), initializer="zeros",
                                               trainable=False),
                               self.add_weight(f"{stage}_max", (), initializer="zeros",
                                               trainable=False))
                       for stage in self.quantized}

    def _fake_quant(self, x, stage):
        if stage not in self.quantized:
            return x
        (bits, narrow), (low, high) = self.quantized[stage], self.ranges[stage]
        return tf.quantization.fake_quant_with_min_max_vars(x, low, high, num_bits=bits,
                                                            narrow_range=narrow)

    def call(self, inputs, **kwargs):
        y = self._fake_quant(self.layer(inputs, **kwargs), "pre")
        return self._fake_quant(self._fake_quant(self.activation(y), "post"), "output")

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self):
        return {**super().get_config(), "activation": keras.activations.serialize(self.activation),
                **{stage: list(v) for stage, v in self.quantized.items()}}


def _ranges(layer) -> dict:
    """stage -> (num_bits, narrow_range, min, max) of a QAT layer's activation quantizers."""
    found = {}

    def add(stage, quantizer, variables):
        if not variables:
            return
        if getattr(quantizer, "per_axis", False):
            raise ValueError(f"layer {layer.name}: per-channel activation ranges have no "
                             "int8 SavedModel form")
        entry = (quantizer.num_bits, quantizer.narrow_range,
                 float(variables["min_var"].numpy()), float(variables["max_var"].numpy()))
        if stage.startswith("inner-"):           # inside the layer's computation, in order
            found.setdefault("inner", []).append(entry)
        else:
            found[stage] = entry

    if type(layer).__name__ == "QuantizeLayer":
        add("output", layer.quantizer, getattr(layer, "quantizer_vars", None))
    for stage, quantizer, variables in internals.qat_activations(layer):
        add(stage, quantizer, variables)
    return found


# --- from a trained model to its int8 form ----------------------------------------------
@dataclass
class _Layer:
    """How one layer of the int8 model is made: the float layer it stands for (None: an
    identity, e.g. tfmot's input quantizer), for a quantized layer its codes by kernel
    attribute and its bias, the batch norm folded into it, and the activation ranges QAT
    learned around it."""
    layer: object
    codes: dict = None
    bias: np.ndarray = None
    folded: str = None           # name of the batch norm folded into this layer
    ranges: dict = None
    name: str = None             # of an identity (else the float layer's)


def _float_layer(layer):
    """The float layer a QAT model's layer stands for, with its live weights: the layer a
    `QuantizeWrapper` wraps, `None` for tfmot's input quantizer."""
    name = type(layer).__name__
    if name == "QuantizeLayer":
        return None
    return layer.layer if name.startswith("QuantizeWrapper") else layer


def _activation(layer) -> str:
    """A layer's own activation, unwrapped from QAT's (`NoOpActivation`: linear)."""
    fn = getattr(layer, "activation", None)
    fn = getattr(fn, "activation", fn)
    if fn is None or type(fn).__name__ == "NoOpActivation":
        return "linear"
    return keras.activations.serialize(fn)


def _plan(model, qat: bool) -> dict[str, _Layer]:
    """By layer name of the QAT (or float) model: how each int8 layer is made."""
    plans = {}
    for layer in model.layers:
        inner = _float_layer(layer)
        plan = plans[layer.name] = _Layer(inner, ranges=_ranges(layer) if qat else {})
        if inner is None:
            continue
        kind = "Conv1D" if type(inner).__name__ == "Conv1DAsConv2D" else type(inner).__name__
        attrs = KERNELS.get(kind, ())
        if qat:
            plan.codes = {name: qat_codes(w, q, v, kind)
                          for w, q, v in internals.qat_weights(layer)
                          for name in [w.name.split("/")[-1].split(":")[0]] if name in attrs}
        elif kind in KERNELS and kind != "QuantizableAttention":
            plan.codes = {name: weight_only_codes(getattr(inner, name).numpy(), kind)
                          for name in attrs}
        plan.codes = plan.codes or None
        if plan.codes is not None and kind == "Conv1D" and plan.codes["kernel"].values.ndim == 4:
            codes = plan.codes["kernel"]                          # [1, k, in, out]
            plan.codes = {"kernel": Codes(codes.values[0], codes.scale)}
        if plan.codes is not None and getattr(inner, "use_bias", False) \
                and isinstance(getattr(inner, "bias", None), tf.Variable):
            plan.bias = inner.bias.numpy()
    _fold(model, plans)
    return plans


def _fold(model, plans: dict[str, _Layer]) -> None:
    """Fold each batch norm whose only input is a quantized layer with a linear
    activation that feeds nothing else; the batch norm becomes an identity that keeps
    its output range."""
    consumers: dict[str, list[str]] = {}
    producers: dict[str, list[str]] = {}
    for layer in model.layers:
        for index, node in enumerate(layer.inbound_nodes):
            if not internals.in_network(model, layer, index):
                continue                        # a call outside this model
            for parent in tf.nest.flatten(node.inbound_layers):
                consumers.setdefault(parent.name, []).append(layer.name)
                producers.setdefault(layer.name, []).append(parent.name)
    for name, plan in plans.items():
        bn = plan.layer
        if not isinstance(bn, keras.layers.BatchNormalization) or len(producers.get(name, [])) != 1:
            continue
        parent = plans[producers[name][0]]
        if (parent.codes is None or len(parent.codes) != 1 or _activation(parent.layer) != "linear"
                or consumers[producers[name][0]] != [name] or "post" in parent.ranges
                or "output" in parent.ranges or bn.axis not in ([-1], [len(bn.input_shape) - 1])):
            continue
        (attr, codes), = parent.codes.items()
        folded, parent.bias = fold_batch_norm(codes, parent.bias, bn)
        parent.codes = {attr: folded}
        parent.folded, plan.layer, plan.name = bn.name, None, bn.name


def _int8_layer(plans: dict[str, _Layer]):
    """`clone_model`'s function: each layer in its int8 (or float, or identity) form,
    wrapped in its activation ranges when QAT learned any."""
    def clone(layer):
        plan = plans[layer.name]
        inner, ranges = plan.layer, plan.ranges
        name = plan.name or (layer.name if inner is None else inner.name)
        activation = _activation(inner) if inner is not None else "linear"
        if inner is None:
            base = keras.layers.Activation("linear", name=name)
        else:
            config = {**inner.get_config(), "dtype": "float32"}
            if "activation" in config:      # applied by the ranges' wrapper when it exists
                config["activation"] = "linear" if ranges else activation
            cls = type(inner)
            if plan.codes is not None:
                if type(inner).__name__ == "Conv1DAsConv2D":
                    cls = keras.layers.Conv1D
                    config = {k: config[k] for k in (
                        "name", "filters", "kernel_size", "strides", "padding",
                        "dilation_rate", "activation", "use_bias", "dtype")}
                if "use_bias" in config and hasattr(inner, "bias"):   # (one bias, folded)
                    config["use_bias"] = plan.bias is not None
                cls = int8_class(cls)
            if "inner" in ranges:        # a layer quantized inside: its held form
                cls, config = held_form(inner, config, [r[2:] for r in ranges["inner"]])
            base = cls.from_config(config)
        outside = {k: v[:2] for k, v in ranges.items() if k != "inner"}
        if not outside:
            return base
        return ActivationRanges(base, activation, **outside, name=name)
    return clone


def _copy_others(source, target) -> None:
    """Every weight of `target` besides its int8 kernels from `source`'s weight of the same
    name (biases, the ranges inside a `QuantizableAttention`)."""
    sources = {w.name.split("/")[-1]: w for w in source.weights}
    for weight in target.weights:
        name = weight.name.split("/")[-1]
        base = name.split(":")[0]
        if base.endswith(("_int8", "_scale")) and base.rsplit("_", 1)[0] in target._kernel_attrs:
            continue
        if name in sources:
            weight.assign(sources[name])


def quantized_model(model, qat: bool):
    """The int8 form of `model` (a QAT model, with its learned kernel and activation
    ranges; or a float model, quantized after training, weights only): a functional Keras
    model whose kernels are int8 variables with float32 scales. Returns it and, per
    int8 layer, its zero fraction and the batch norm folded into it."""
    plans = _plan(model, qat)
    clone = keras.models.clone_model(model, clone_function=_int8_layer(plans))
    described = {}
    for source, layer in zip(model.layers, clone.layers):    # clone_model keeps the order
        plan = plans.get(source.name)
        if plan is None:
            continue
        target = layer.layer if isinstance(layer, ActivationRanges) else layer
        if isinstance(layer, ActivationRanges):
            for stage, (low, high) in layer.ranges.items():
                low.assign(plan.ranges[stage][2])
                high.assign(plan.ranges[stage][3])
        if plan.layer is None:
            continue
        if plan.codes is None:
            target.set_weights(plan.layer.get_weights())
            continue
        for attr, codes in plan.codes.items():
            getattr(target, f"{attr}_int8").assign(codes.values)
            getattr(target, f"{attr}_scale").assign(codes.scale)
        _copy_others(plan.layer, target)
        if plan.bias is not None:
            target.bias.assign(plan.bias)
        values = np.concatenate([c.values.ravel() for c in plan.codes.values()])
        described[target.name] = {"zero_fraction": float(np.mean(values == 0)),
                                  **({"folded": plan.folded} if plan.folded else {})}
    return clone, described
