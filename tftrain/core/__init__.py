"""The base every other package stands on: the config value types and `ConfigError`
(`config_types`), registries with helpful errors (`registry`), optional packages
(`extras`), and `keras`, the one place tftrain imports Keras (tf_keras).

May import: nothing of tftrain. No TensorFlow at import time, except `core.keras`,
which only TensorFlow-backed packages import (config handling stays fast without it).
"""
