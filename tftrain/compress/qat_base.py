"""The 8-bit QuantizeConfig tftrain's per-layer configs share (`qat_configs`,
`qat_transformer`): tfmot's default scheme for the attributes a class names,
prune-preserving on request."""
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
