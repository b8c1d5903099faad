"""The 8-bit QuantizeConfig tftrain's per-layer configs share (`qat_configs`,
`qat_transformer`): tfmot's default scheme for the attributes a class names,
prune-preserving on request; a kernel range set to its kernel's extent (`kernel_range`);
an activation range calibrated at a percentile of its values (`bounds`)."""
import numpy as np
import tensorflow as tf
from tensorflow_model_optimization.python.core.quantization.keras.collab_opts.prune_preserve import (  # noqa: E501
    prune_preserve_quantize_registry as pqat_registry,
)
from tensorflow_model_optimization.python.core.keras.utils import smart_cond
from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
    default_8bit_quantize_registry as registry,
)


def fake_quant(quantizer, x, ranges, training):
    """`x` through a tfmot activation quantizer holding its range in `ranges`, learning
    it when `training` (a tensor or a bool)."""
    return smart_cond(training, lambda: quantizer(x, True, weights=ranges),
                      lambda: quantizer(x, False, weights=ranges))


def bounds(quantizer, inputs, axes):
    """The range calibration gives an activation quantizer from `inputs`: their min and
    max over `axes` (None: all), or for a quantizer with a `percentile` (per tensor) the
    values at that percentile of each tail, so that rare outliers do not widen its steps
    for every other value."""
    q = getattr(quantizer, "percentile", None)
    if q is None:
        return tf.reduce_min(inputs, axis=axes), tf.reduce_max(inputs, axis=axes)
    flat = tf.sort(tf.reshape(inputs, [-1]))
    last = tf.cast(tf.size(flat) - 1, tf.float32)
    at = lambda f: tf.gather(flat, tf.cast(tf.round(last * f), tf.int32))  # noqa: E731
    return at(1 - q / 100), at(q / 100)


def kernel_range(low_var, high_var, weight: np.ndarray, symmetric: bool) -> None:
    """A last-value quantizer's range set to `weight`'s extent, per tensor or per its last
    axis (what its variables' shape says; any other shape is left as tfmot has it)."""
    if low_var.shape.rank == 0:
        low, high = weight.min(), weight.max()
    elif tuple(low_var.shape) == weight.shape[-1:]:
        axes = tuple(range(weight.ndim - 1))
        low, high = weight.min(axis=axes), weight.max(axis=axes)
    else:
        return
    low, high = np.minimum(low, 0.0), np.maximum(high, 0.0)
    if symmetric:
        high = np.maximum(-low, high)
        low = -high
    low_var.assign(np.asarray(low, np.float32).reshape(low_var.shape))
    high_var.assign(np.asarray(high, np.float32).reshape(high_var.shape))


class PrunePreservingConfig(registry.Default8BitQuantizeConfig):
    """tfmot's 8-bit config for the class's `WEIGHTS` (per-tensor symmetric),
    `ACTIVATIONS` and (`OUTPUT`) output, with the prune-preserving weight quantizer if
    asked. Serializable by that one setting: `quantize_apply` rebuilds configs from their
    config (a quantizer set on an instance is lost)."""
    WEIGHTS: tuple = ()
    ACTIVATIONS: tuple = ()
    OUTPUT = False

    def __init__(self, preserve_sparsity: bool = False):
        super().__init__(list(self.WEIGHTS), list(self.ACTIVATIONS), self.OUTPUT)
        self.preserve_sparsity = preserve_sparsity
        if preserve_sparsity:
            self.weight_quantizer = pqat_registry.PrunePreserveDefault8BitWeightsQuantizer()

    def get_config(self):
        return {"preserve_sparsity": self.preserve_sparsity}
