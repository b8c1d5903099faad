"""Export preflight: every requested export converted once, before the first update.

A conversion that fails (an op TFLite or ONNX has no form for, a layer tfmot cannot
quantize, a runtime that refuses the converted file) used to fail after all of training.
Here the model the export will get is built as planned, untrained, outside any strategy;
each requested artifact is converted from it (one calibration batch; the int8 ones through
a throwaway QAT copy when QAT is enabled) and loaded and run once by its runtime. A
failure is a config error naming the artifact, the op or layer, and what to do; nothing is
written. `export.preflight: false` turns it off.
"""
from __future__ import annotations

import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tftrain.config import ConfigError

EXAMPLES = 8            # validation and calibration examples the preflight converts with


@dataclass(frozen=True)
class Preflight:
    seconds: float
    artifacts: tuple[str, ...]

    def describe(self) -> str:
        return (f"export preflight: {', '.join(self.artifacts)} converted and run from the "
                f"untrained model in {self.seconds:.1f} s (export.preflight: false to skip)")


def wanted(cfg) -> bool:
    e = cfg.export
    return e.preflight and (e.saved_model or e.saved_model_int8 or e.tflite != "none" or e.onnx)


def run(cfg, net, source, qat: bool) -> Preflight | None:
    """Convert every export `cfg` asks for from a fresh copy of `net` (the model the last
    stage will hand to the export, as planned); a ConfigError when one fails."""
    if not wanted(cfg):
        return None
    from tftrain.export import artifacts

    began = time.perf_counter()
    model = _copy(net)
    if qat:
        from tftrain.compress import quantization
        model = quantization.quantize_configured(model, cfg)
    with tempfile.TemporaryDirectory(prefix="tftrain-preflight-") as tmp:
        try:
            report = artifacts.export_all(model, cfg.export, Path(tmp), _Sample(source), qat=qat,
                                          data_cfg=cfg.data, layers=False)
        except ConfigError:
            raise
        except Exception as err:      # a converter or runtime refusing the model
            raise ConfigError(refusal(cfg, err)) from None
    return Preflight(time.perf_counter() - began, tuple(report))


def _copy(net):
    """A float32 copy of `net` with fresh variables, made outside any strategy (planning
    ends its scope first): no collective, no device placement, what the chief exports."""
    import tensorflow_model_optimization as tfmot

    from tftrain.core.keras import keras
    from tftrain.export.artifacts import inference_model

    with tfmot.quantization.keras.quantize_scope():
        return keras.models.clone_model(inference_model(net))


class _Sample:
    """The first few examples of a source: enough to convert, calibrate and run."""

    def __init__(self, source, n: int = EXAMPLES):
        self._source, self.num_val = source, min(n, source.num_val)
        serving = source.spec.serving
        self.spec = source.spec if serving is None else replace(
            source.spec, serving=replace(serving, validation=serving.validation[:self.num_val]))

    def validation(self):
        return self._source.validation().take(self.num_val)

    def calibration(self, n: int):
        return self._source.calibration(min(n, EXAMPLES))


# --- what a failure means -----------------------------------------------------------
_OPS = (re.compile(r"'tf\.(\w+)' op is neither a custom op nor a flex op"),     # TFLite
        re.compile(r"Custom ops: (\w+)"),
        re.compile(r"Unsupported ops: Counter\(\{'(\w+)'"),                     # tf2onnx
        re.compile(r"\b(\w+) is not supported\b"))


def refusal(cfg, err: Exception) -> str:
    """One config-error line for a conversion that failed: which export, which op and
    layer (when the converter names them) and the settings that avoid it."""
    text = str(err)
    op = next((m.group(1) for m in (p.search(text) for p in _OPS) if m), None)
    what, target, fix = _artifact(cfg, text)
    if op:
        layer = re.search(rf'fused\["{op}:", "[^/"]+/([^/"]+)/', text)
        found = f"op {op}" + (f" (layer {layer.group(1)})" if layer else "") + \
            f" has no {target} form"
    else:
        # the first line that says something (TensorFlow's own start "in user code:")
        lines = [line.strip() for line in text.splitlines()
                 if line.strip() and line.strip() != "in user code:"]
        found = (lines[0] if lines else type(err).__name__)[:300]
    return (f"{what}: the untrained model does not convert: {found}; {fix}, or set "
            "export.preflight: false to find out after training")


def _artifact(cfg, text: str) -> tuple[str, str, str]:
    """(the export's key, what it converts to, the setting that avoids it)."""
    e = cfg.export
    lowered = text.lower()
    if e.onnx and ("onnx" in lowered or "opset" in lowered):
        return ("export.onnx", f"ONNX opset {_opset()}",
                "replace the layer or set export.onnx: false")
    if e.tflite != "none" and ("tflite" in lowered or "flatbuffer" in lowered
                               or "converter" in lowered or "custom op" in lowered):
        return (f"export.tflite ({e.tflite})", "TFLite builtin",
                "replace the layer or set export.tflite: none")
    if e.saved_model_int8:
        return "export.saved_model_int8", "int8 SavedModel", "set export.saved_model_int8: false"
    return "export", "exported", "change the export settings"


def _opset() -> int:
    from tftrain.export.onnx_export import OPSET
    return OPSET
