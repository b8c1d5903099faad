"""Which artifact an export failure belongs to, and whether it is a property of the
model (a converter or runtime refusing it) or a bug.

`export_all` makes each artifact inside `making(name)`, so a failure says which artifact
raised it, known from where it raised rather than guessed from its message. `refused`
tells a refusal by a converter or runtime (TFLite's converter, tf2onnx, ONNX Runtime,
LiteRT, tfmot: the library in whose code the exception was raised) from anything else,
which the export preflight reports as a bug in tftrain with its traceback.
"""
from __future__ import annotations

import contextlib
import traceback

from tftrain.config import ConfigError

# where a converter or runtime's own code lives: an exception raised there is the
# library refusing the model (an op it has no form for, a layer it cannot quantize)
_LIBRARIES = {"tensorflow/lite/": "the TFLite converter", "tf2onnx/": "tf2onnx",
              "onnxruntime/": "ONNX Runtime", "onnx/": "ONNX", "ai_edge_litert/": "LiteRT",
              "tensorflow_model_optimization/": "tfmot"}


class ArtifactError(Exception):
    """Making `artifact` (e.g. "tflite_int8") raised `error` (also the `__cause__`)."""

    def __init__(self, artifact: str, error: BaseException):
        super().__init__(f"export {artifact}: {type(error).__name__}: {error}")
        self.artifact, self.error = artifact, error


@contextlib.contextmanager
def making(artifact: str):
    """Failures inside are `ArtifactError`s naming `artifact` (config errors pass as they
    are, and an artifact made inside another keeps the inner name)."""
    try:
        yield
    except (ArtifactError, ConfigError):
        raise
    except Exception as err:
        raise ArtifactError(artifact, err) from err


def refused(error: BaseException) -> str | None:
    """The library that refused the model, when `error` was raised in a converter's or
    runtime's own code (or one of its messages says the model has an op it cannot run);
    None for anything else (a bug)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = frames[-1].filename.replace("\\", "/") if frames else ""
    for part, name in _LIBRARIES.items():
        if f"/{part}" in where:
            return name
    module = type(error).__module__ or ""
    if module.startswith(("onnxruntime", "tensorflow.lite")):
        return "ONNX Runtime" if module.startswith("onnxruntime") else "the TFLite converter"
    return None
