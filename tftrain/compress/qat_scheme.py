"""tfmot's default 8-bit quantization scheme as tftrain applies it (`scheme`): its layout
transforms in tfmot's order, with the two tftrain changes described there, and the
names a split SeparableConv2D's parts take (`split_names`, `split_source`)."""
from __future__ import annotations

from tftrain.compress import qat_configs

# the parts a SeparableConv2D is split into, after its name: (depthwise, pointwise)
SPLIT_SUFFIXES = ("_depthwise", "_pointwise")


def split_names(name: str) -> tuple[str, str]:
    """The names of the DepthwiseConv2D and 1x1 Conv2D that SeparableConv2D `name` becomes
    in QAT."""
    return tuple(name + suffix for suffix in SPLIT_SUFFIXES)


def split_source(model, name: str, weight: str):
    """(layer of `model`, its attribute) holding the weight `weight` of QAT layer `name`:
    the layer of that name, or for a part of a split SeparableConv2D the SeparableConv2D
    (its `depthwise_kernel`, or its `pointwise_kernel` for the 1x1 Conv2D's `kernel`)."""
    names = {layer.name for layer in model.layers}
    if name not in names:
        for suffix, attribute in zip(SPLIT_SUFFIXES, ("depthwise_kernel", "pointwise_kernel")):
            base = name[:-len(suffix)]
            if name.endswith(suffix) and base in names and \
                    type(model.get_layer(base)).__name__ == "SeparableConv2D":
                return model.get_layer(base), (attribute if weight in ("kernel", attribute)
                                               else weight)
    return model.get_layer(name), weight


def scheme(preserve_sparsity: bool, quantize_input: bool = True):
    """tfmot's default 8-bit scheme (prune-preserving or not), with two layout fixes.

    tfmot marks a Conv2D/Dense that feeds a separate ReLU layer "no-op" so no fake-quant
    sits between them (TFLite fuses the pair), but that also leaves the layer's weights
    unquantized during QAT and, with prune-preserving QAT, unmasked: the pruned zeros of
    every `Conv2D -> ReLU` were lost. Here such a layer quantizes its weights and only
    its output is left to the ReLU. And a SeparableConv2D, which tfmot splits into a
    DepthwiseConv2D and a 1x1 Conv2D with an 8-bit range between them, names its two
    parts after itself (`split_names`), not by Keras' counters: a prune-preserving
    quantizer finds the pruned zeros it keeps by name (`split_source`). Without
    `quantize_input` the model's input is not fake-quantized (a raw waveform feeding
    float feature extraction)."""
    from tensorflow_model_optimization.python.core.quantization.keras.collab_opts.prune_preserve import (  # noqa: E501
        default_8bit_prune_preserve_quantize_scheme as pqat,
        prune_preserve_quantize_registry as pqat_registry,
    )
    from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
        default_8bit_quantize_configs as configs,
        default_8bit_quantize_layout_transform as layout,
        default_8bit_quantize_registry as registry,
        default_8bit_quantize_scheme as default,
        default_8bit_transforms as transforms,
    )

    def weights_only(class_name: str):
        if class_name == "Add":
            return configs.NoOpQuantizeConfig()
        if class_name == "DepthwiseConv2D" and preserve_sparsity:
            return qat_configs.DepthwisePrunePreserveConfig(activation=False)
        if class_name in ("Conv2D", "DepthwiseConv2D"):
            attr = "kernel" if class_name == "Conv2D" else "depthwise_kernel"
            config = registry.Default8BitConvQuantizeConfig([attr], [], False)
            if preserve_sparsity:
                config.weight_quantizer = pqat_registry.PrunePreserveDefault8BitConvWeightsQuantizer()
            return config
        config = registry.Default8BitQuantizeConfig(["kernel"], [], False)
        if preserve_sparsity:
            config.weight_quantizer = pqat_registry.PrunePreserveDefault8BitWeightsQuantizer()
        return config

    class ReLUAfterLayer(transforms.LayerReLUQuantize):
        def replacement(self, match_layer):
            node = match_layer.input_layers[0]
            node.metadata["quantize_config"] = weights_only(node.layer["class_name"])
            return match_layer

    class ReLUActivationAfterLayer(transforms.LayerReluActivationQuantize):
        replacement = ReLUAfterLayer.replacement

    class NamedSeparableSplit(transforms.SeparableConvQuantize):
        def replacement(self, match_layer):
            pointwise = super().replacement(match_layer)
            if pointwise is match_layer:          # a quantize config of its own: kept whole
                return pointwise
            names = split_names(match_layer.layer["config"]["name"])
            for node, name in zip((pointwise.input_layers[0], pointwise), names):
                node.layer["name"] = node.layer["config"]["name"] = name
            return pointwise

    dropped = (transforms.LayerReLUQuantize, transforms.LayerReluActivationQuantize)
    swapped = {transforms.SeparableConvQuantize: NamedSeparableSplit()}
    relu_fixes = [ReLUAfterLayer(), ReLUActivationAfterLayer()]

    class Layout(layout.Default8BitQuantizeLayoutTransform):
        def apply(self, model, layer_quantize_map):
            from tensorflow_model_optimization.python.core.quantization.keras.graph_transformations import (  # noqa: E501
                model_transformer,
            )
            chosen = [swapped.get(type(t), t) for t in _default_transforms(transforms)
                      if type(t) not in dropped
                      and (quantize_input or not isinstance(t, transforms.InputLayerQuantize))]
            return model_transformer.ModelTransformer(
                model, chosen + relu_fixes, set(layer_quantize_map), layer_quantize_map
            ).transform()

    base = pqat.Default8BitPrunePreserveQuantizeScheme if preserve_sparsity else \
        default.Default8BitQuantizeScheme

    class Scheme(base):
        def get_layout_transformer(self):
            return Layout()

    return Scheme()


def _default_transforms(module) -> list:
    """tfmot's default 8-bit layout transforms, in its order."""
    return [module.InputLayerQuantize(), module.SeparableConv1DQuantize(),
            module.SeparableConvQuantize(), module.Conv2DReshapeBatchNormReLUQuantize(),
            module.Conv2DReshapeBatchNormActivationQuantize(),
            module.Conv2DBatchNormReLUQuantize(), module.Conv2DBatchNormActivationQuantize(),
            module.Conv2DReshapeBatchNormQuantize(), module.Conv2DBatchNormQuantize(),
            module.ConcatTransform6Inputs(), module.ConcatTransform5Inputs(),
            module.ConcatTransform4Inputs(), module.ConcatTransform3Inputs(),
            module.ConcatTransform(), module.DenseBatchNormQuantize(),
            module.DenseBatchNormReLUQuantize(), module.DenseBatchNormActivationQuantize(),
            module.LayerReLUQuantize(), module.LayerReluActivationQuantize()]
