"""Quantization configs for layers tfmot's default 8-bit scheme leaves out.

tfmot's registry refuses `Conv1D` (its entry is commented out) and `MaxPooling1D`, and
knows nothing of tftrain's own layers, so a 1-D speech model could not be quantized at
all. TFLite runs a Conv1D as a Conv2D over a height-1 map, so the config is the one
tfmot gives Conv2D: per-output-channel symmetric int8 kernels (the last axis in both
layouts), an 8-bit activation range, and, for prune-preserving QAT, the quantizer that
keeps pruned zeros. Max pooling passes ranges through (no quantizer); the feature layer
of the speech models computes in float and only its output is quantized, so the int8
TFLite file takes a float waveform and runs every layer after the features in int8.
"""
from __future__ import annotations

from typing import Optional

from tftrain._keras import keras


def config_for(layer, preserve_sparsity: bool) -> Optional[object]:
    """The QuantizeConfig tftrain gives `layer`, or None when tfmot's registry has one."""
    from tensorflow_model_optimization.python.core.quantization.keras.collab_opts.prune_preserve import (  # noqa: E501
        prune_preserve_quantize_registry as pqat_registry,
    )
    from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
        default_8bit_quantize_configs as configs,
        default_8bit_quantize_registry as registry,
    )
    from tftrain.models.audio import AudioFeatures

    if isinstance(layer, keras.layers.Conv1D) and type(layer) is keras.layers.Conv1D:
        config = registry.Default8BitConvQuantizeConfig(["kernel"], ["activation"], False)
        if preserve_sparsity:
            config.weight_quantizer = pqat_registry.PrunePreserveDefault8BitConvWeightsQuantizer()
        return config
    if isinstance(layer, (keras.layers.MaxPooling1D, keras.layers.GlobalMaxPooling1D)):
        return configs.NoOpQuantizeConfig()
    if isinstance(layer, AudioFeatures):
        return configs.Default8BitOutputQuantizeConfig()
    return None


def supported(layer) -> bool:
    """Whether tftrain has a config of its own for this layer."""
    return config_for(layer, False) is not None
