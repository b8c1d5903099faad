"""tftrain: config-driven TensorFlow/Keras training on several devices or machines.

The top level is the pipeline and its entry points (`run`, `plan`, `report`, `launch`,
`sweep`, `doctor`); the packages below are by concern, each importing only those before
it: core -> optim -> config -> data, models -> runtime -> training -> compress -> export
-> stages -> the top level (CONTRIBUTING.md has the map; tests/test_layout.py checks it).

Importing tftrain sets TF_USE_LEGACY_KERAS=1 (before TensorFlow is imported) so that
`tf.keras` is tf_keras, the Keras that tensorflow-model-optimization supports.
"""
import os
import sys

if "tensorflow" in sys.modules and os.environ.get("TF_USE_LEGACY_KERAS") != "1":
    import warnings

    warnings.warn("TensorFlow was imported before tftrain with TF_USE_LEGACY_KERAS unset, so "
                  "tf.keras is Keras 3 in this process; tftrain uses tf_keras. Import tftrain "
                  "first or set TF_USE_LEGACY_KERAS=1.", stacklevel=2)
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tftrain.config import Config, ConfigError, load_config  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "load_config", "build_strategy", "build_model",
           "configure_devices"]


def __getattr__(name):
    # TensorFlow-backed parts load on first use, so config handling stays fast.
    if name in ("build_strategy", "configure_devices"):
        from tftrain.runtime import strategy
        return getattr(strategy, name)
    if name == "build_model":
        from tftrain.models import build_model
        return build_model
    raise AttributeError(f"module 'tftrain' has no attribute {name!r}")
