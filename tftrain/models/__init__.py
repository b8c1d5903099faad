"""Models: builders that take the input spec and keyword params and return a tf_keras
functional model that outputs logits (`registry.py` holds them by name; each family
module registers its own). Models know nothing of strategy, precision, placement or
compression: those wrap them from outside.

May import: `tftrain.core`, `tftrain.config`.
"""
from tftrain.models.registry import (APPLICATIONS, MODELS, build_model, came_in_as_keras3,
                                     layer_parents, resolve_builder)
from tftrain.models import audio, cnn, mlp, resnet, text, transformer  # noqa: E402,F401  (registers)

__all__ = ["APPLICATIONS", "MODELS", "build_model", "came_in_as_keras3", "layer_parents",
           "resolve_builder"]
