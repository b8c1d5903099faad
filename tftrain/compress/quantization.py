"""Quantization-aware training: tfmot's 8-bit scheme, prune-preserving after pruning.

The forward pass of tfmot's wrappers does not take bfloat16/float16
(tensorflow/model-optimization#367, #409): QAT always runs in float32 on a float32 copy
of the model. Per-layer configs tfmot lacks (depthwise prune preservation, the bundled
models' own layers) are `qat_configs.py`.
"""
from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot

from tftrain.compress import qat_base, qat_configs, qat_norms, qat_scheme
from tftrain.compress.unquantizable import FOLDED_INTO, quantizable, unquantizable  # noqa: F401
from tftrain.config import QuantizationConfig
from tftrain.core import internals
from tftrain.core.keras import keras
from tftrain.optim.batch_loops import traced_after

def quantize_configured(model, cfg):
    """`quantize_model` as the run's config asks: prune-preserving after pruning (not
    after channel pruning: a narrowed model has no zeros to keep)."""
    q, p = cfg.compression.quantization, cfg.compression.pruning
    return quantize_model(model, q, p.enabled and not p.channels and q.preserve_sparsity)


def quantize_model(model, cfg: QuantizationConfig, preserve_sparsity: bool):
    """8-bit QAT copy of a float32 functional model (tfmot default scheme, or the
    prune-preserving one so that zeros stay zeros). Call inside the strategy scope."""
    q = tfmot.quantization.keras
    loose = qat_norms.standalone_norms(model, FOLDED_INTO)
    skipped = set(unquantizable(model, cfg, loose))
    configs = qat_configs.configs_for(model, preserve_sparsity)

    def annotate(layer):
        if layer.name in skipped or isinstance(layer, keras.layers.InputLayer):
            return layer.__class__.from_config(layer.get_config())
        form = qat_configs.quantizable_form(layer, layer.name in loose)
        config = qat_configs.config_for(form, preserve_sparsity) if layer.name in loose \
            else configs.get(layer.name)
        return q.quantize_annotate_layer(form, config)

    annotated = keras.models.clone_model(model, clone_function=annotate)
    # layer by layer (a clone keeps their order): a quantizable form keeps the original's
    # weights in order, reshaped, then ranges of its own (`QuantizableAttention`)
    for layer, target in zip(model.layers, annotated.layers):
        values = [w.numpy() for w in layer.weights]
        if hasattr(getattr(target, "layer", None), "adopt"):
            target.layer.adopt(values)
        else:
            for value, weight in zip(values, target.weights):
                weight.assign(value.reshape(weight.shape))
    with q.quantize_scope():
        quantized = q.quantize_apply(annotated, qat_scheme.scheme(preserve_sparsity,
                                                        qat_configs.quantize_input(model)))
    if preserve_sparsity:
        _keep_zeros(quantized, model)
    return quantized


def clone(model):
    """A copy of a QAT model, prune-preserving included, with every variable it has
    (weights not copied). A clone from the model's config loses what prune-preserving QAT
    adds to a layer's weight quantizers (its sparsity masks: a pruned, QAT-trained CNN's
    clone had 36 weights for the model's 40), so each QuantizeWrapper is rebuilt around
    its layer's clone with the original's quantize config."""
    import copy as copying

    q = tfmot.quantization.keras

    def layer_clone(layer):
        if isinstance(layer, q.QuantizeWrapper):
            inner = layer.layer.__class__.from_config(layer.layer.get_config())
            return type(layer)(inner, copying.copy(layer.quantize_config), name=layer.name)
        return layer.__class__.from_config(layer.get_config())
    with q.quantize_scope():
        copy = keras.models.clone_model(model, clone_function=layer_clone)
    for source, target in zip(model.layers, copy.layers):      # the masks `_keep_zeros` adds
        for (_, _, had), (weight, _, variables) in zip(internals.qat_weights(source),
                                                      internals.qat_weights(target)):
            if isinstance(had.get("sparsity_mask"), tf.Variable):
                name = weight.name.split("/")[-1].split(":")[0]
                variables["sparsity_mask"] = target.add_weight(
                    f"pruning_mask_{name}", shape=weight.shape, trainable=False,
                    initializer=keras.initializers.Ones(), dtype=weight.dtype)
    return copy


def _keep_zeros(quantized, pruned) -> None:
    """Give each prune-preserving weight quantizer a mask variable of the pruned zeros.

    tfmot's prune-preserving quantizer computes its mask once, as a constant, from the
    weights the layer holds when it is built, which inside `quantize_apply` are a fresh
    copy's random initial values for some layer types (convolutions here), and a constant
    is not in checkpoints. tftrain masks with a variable set from the pruned model's zeros:
    every pruned zero stays zero, and a resumed QAT stage restores the mask."""
    for layer in quantized.layers:
        for weight, _, variables in internals.qat_weights(layer):
            if "sparsity_mask" not in variables:
                continue
            name = weight.name.split("/")[-1].split(":")[0]
            source, attribute = qat_scheme.split_source(pruned, layer.layer.name, name)
            # a quantizable form names the original's weight it holds (reshaped)
            original = layer.layer.source_weight(source, name) \
                if hasattr(layer.layer, "source_weight") else getattr(source, attribute)
            zeros = (original.numpy() != 0).reshape(weight.shape)
            mask = layer.add_weight(f"pruning_mask_{name}", shape=weight.shape, trainable=False,
                                    initializer=keras.initializers.Ones(), dtype=weight.dtype)
            mask.assign(zeros.astype(weight.dtype.as_numpy_dtype))
            variables["sparsity_mask"] = mask


def calibrate_ranges(model, batches) -> int:
    """Set every activation range of a QAT model (tfmot's moving-average and all-values
    quantizers: layer outputs and the model's input) to the min and max of the values it
    sees on `batches` (with 0 inside, as TFLite needs), as post-training calibration
    would: the model runs in inference mode with nothing quantized (float kernels, float
    activations), so batch-norm statistics stay. Returns the batches used.

    tfmot starts every range at [-6, 6] and moves it by an EMA of decay 0.999 per update:
    after a QAT stage of a few dozen updates the ranges are still about [-6, 6], which
    clips MFCCs of -200..40 to 8 bits of [-6, 6] and spends most of the levels of a [0, 1]
    input or a ReLU output of [0, 2] on values that never occur (an input's range only
    ever widens). Call before the first QAT update; a resumed stage restores its ranges
    from the checkpoint.

    Kernel ranges (tfmot's last-value quantizers) are set as a first training call sets
    them, to the kernel's own extent: they too start at [-6, 6], and until an update a
    kernel of small weights (a linear layer over 65,000 TF-IDF features: |w| < 0.01)
    rounds to zero everywhere."""

    seen: dict[int, list] = {}           # id(min variable) -> [min_var, max_var, low, high]
    called: list = []                    # (min_var, max_var) in the order the model calls them
    lows: list = []
    highs: list = []

    def record(self, inputs, training, weights, **kwargs):
        low_var, high_var = weights["min_var"], weights["max_var"]
        axes = None if low_var.shape.rank == 0 else list(range(inputs.shape.rank - 1))
        called.append((low_var, high_var))
        low, high = qat_base.bounds(self, inputs, axes)
        lows.append(low), highs.append(high)
        return inputs

    def observed(x):        # traced once past the first batches (`traced_after`): 9.2 s of
        called.clear(), lows.clear(), highs.clear()     # a MobileNetV3's 64 eager batches
        model(x, training=False)
        return list(lows), list(highs)

    used, step = 0, traced_after(observed)
    kernels: dict[int, tuple] = {}

    def kernel(self, inputs, training, weights, **kwargs):
        low_var, high_var = (weights or {}).get("min_var"), (weights or {}).get("max_var")
        if low_var is not None and high_var is not None:
            kernels[id(low_var)] = (low_var, high_var, inputs, getattr(self, "symmetric", False))
        return inputs

    with _quantizers_replaced(lambda cls, call: record if _activation(cls) else kernel):
        for used, batch in enumerate(batches, start=1):
            low, high = step(batch[0] if isinstance(batch, tuple) else batch)
            for (low_var, high_var), a, b in zip(called, low, high):
                a, b = a.numpy(), b.numpy()
                entry = seen.setdefault(id(low_var), [low_var, high_var, a, b])
                entry[2], entry[3] = np.minimum(entry[2], a), np.maximum(entry[3], b)
    for low_var, high_var, low, high in seen.values():
        low_var.assign(np.minimum(low, 0.0).astype(np.float32).reshape(low_var.shape))
        high_var.assign(np.maximum(high, 0.0).astype(np.float32).reshape(high_var.shape))
    for low_var, high_var, weight, symmetric in kernels.values():
        qat_base.kernel_range(low_var, high_var, np.asarray(weight), symmetric)
    return used


def quantizers_bypassed():
    """A context inside which every tfmot quantizer passes its input through: a QAT
    model computes its float model's function (what its quantizable forms must keep)."""
    return _quantizers_replaced(lambda cls, call: _float_through)


def _float_through(self, inputs, training, weights, **kwargs):
    return inputs


def kernels_unquantized(layers):
    """A context inside which the kernels of `layers` (QAT wrappers) are not
    fake-quantized (pruned zeros still masked): a SavedModel traced inside converts with
    those layers' kernels float, the ranges around them kept."""
    chosen = {id(v) for layer in layers for _, _, variables in internals.qat_weights(layer)
              for v in variables.values()}

    def replaced(cls, call):
        def maybe(self, inputs, training, weights, **kwargs):
            if not any(id(v) in chosen for v in weights.values()):
                return call(self, inputs, training, weights, **kwargs)
            mask = weights.get("sparsity_mask")
            return inputs if mask is None else inputs * tf.cast(mask, inputs.dtype)
        return maybe
    return _quantizers_replaced(replaced)


def ranges_held():
    """A context inside which every tfmot quantizer computes as in inference
    (fake-quantized with its stored range, pruned zeros masked) whatever the `training`
    flag, so a training-mode pass (batch-norm re-estimation) moves no range;
    training-mode quantizers would also update their ranges from a cross-replica
    context, which MirroredStrategy refuses."""
    return _inference_mode(lambda cls: True)


def activation_ranges_held():
    """A context inside which the activation quantizers (tfmot's moving-average and
    all-values ones: layer outputs and the model's input) fake-quantize with their stored
    ranges in training too, and never move them (`compression.quantization.ranges:
    fixed`); the kernels' quantizers still take each update's weights' range."""
    return _inference_mode(_activation)


def _activation(cls) -> bool:
    """Whether a tfmot quantizer class quantizes activations (its range moved by what
    it sees), not kernels."""
    from tensorflow_model_optimization.python.core.quantization.keras import quantizers
    return issubclass(cls, (quantizers.MovingAverageQuantizer, quantizers.AllValuesQuantizer))


def _inference_mode(chosen):
    """Quantizers of the classes `chosen(cls)` picks called with `training=False`."""
    def held(cls, call):
        if not chosen(cls):
            return call
        return lambda self, inputs, training, weights, **kwargs: call(self, inputs, False,
                                                                      weights, **kwargs)
    return _quantizers_replaced(held)


@contextlib.contextmanager
def _quantizers_replaced(replacement):
    """Inside: each tfmot quantizer class's `__call__` is `replacement(cls, its own)`."""
    from tensorflow_model_optimization.python.core.quantization.keras import quantizers

    classes, pending = [], [quantizers.Quantizer]
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "__call__" in cls.__dict__:
            classes.append((cls, cls.__dict__["__call__"]))
    try:
        for cls, call in classes:
            cls.__call__ = replacement(cls, call)
        yield
    finally:
        for cls, call in classes:
            cls.__call__ = call


def range_variables(model) -> list:
    """The activation range variables of a QAT model, or of one of its layers (what
    `calibrate_ranges` sets and a training-mode pass moves): its input quantizer's, and
    each wrapper's around its activation and its outputs."""
    found = []
    for layer in getattr(model, "layers", [model]):
        groups = [getattr(layer, "quantizer_vars", None)]        # tfmot's QuantizeLayer
        inner = getattr(layer, "layer", None)
        if hasattr(inner, "range_variables"):                   # ranges inside a layer
            groups.append(dict(enumerate(inner.range_variables())))
        groups += [variables for _, _, variables in internals.qat_activations(layer)]
        found += [v for group in groups if group for v in group.values()]
    return found


def fit_empty_channels(model) -> int:
    """Give every kernel channel that pruning emptied (all its weights zero, so QAT's
    per-channel range is [0, 0]) the median range of its layer's other channels; returns
    how many. Its codes stay zero and the QAT model computes the same, but the int8
    TFLite file no longer gives the channel a weight scale of about 4e-9, at which its
    bias (quantized at input scale x weight scale) overflows int32 and the channel puts out
    a wrong constant: on a digits CNN pruned to 80%, 7 of the 32 first-layer channels were
    empty and that layer's int8 output was 21.8 dB from the QAT model's, 65 dB after."""
    fitted = 0
    for layer in model.layers:
        for _, _, variables in internals.qat_weights(layer):
            low, high = variables.get("min_var"), variables.get("max_var")
            if low is None or low.shape.rank != 1:      # per-tensor ranges: not per channel
                continue
            lows, highs = low.numpy(), high.numpy()
            empty = (lows == 0) & (highs == 0)
            if not empty.any() or empty.all():
                continue
            size = float(np.median(np.maximum(-lows[~empty], highs[~empty])))
            lows[empty], highs[empty] = -size, size
            low.assign(lows)
            high.assign(highs)
            fitted += int(empty.sum())
    return fitted


def quantized_kernels(model) -> dict[str, np.ndarray]:
    """The effective float weights a QAT model quantizes (masked where prune-preserving),
    by wrapped layer name."""
    out = {}
    for layer in model.layers:
        for weight, _, variables in internals.qat_weights(layer):
            value = weight.numpy()
            if "sparsity_mask" in variables:
                value = value * np.asarray(variables["sparsity_mask"])
            out[layer.layer.name] = value
    return out
