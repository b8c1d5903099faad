"""Optional extras a config asks for: checked before anything is written, so a missing
package is a config error (exit 2) naming the `pip install` that adds it."""
from __future__ import annotations

import importlib.util

from tftrain.core.config_types import ConfigError


def missing(*modules: str) -> list[str]:
    """Those of `modules` that are not installed."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require(cfg) -> None:
    """Raise `ConfigError` for each configured feature whose extra is not installed."""
    problems = []
    if cfg.export.onnx and (gone := missing("tf2onnx", "onnxruntime", "onnx")):
        problems.append(f"export.onnx: needs {', '.join(gone)}, not installed: "
                        "pip install -e \".[onnx]\" (or set export.onnx: false)")
    if cfg.tracking.mlflow is not None and (gone := missing("mlflow")):
        problems.append(f"tracking.mlflow: needs {', '.join(gone)}, not installed: "
                        "pip install -e \".[mlflow]\" (or remove tracking.mlflow)")
    if problems:
        raise ConfigError(*problems)
