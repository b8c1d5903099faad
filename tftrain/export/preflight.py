"""Export preflight: every requested export converted once, before the first update.

A conversion that fails (an op TFLite or ONNX has no form for, a layer tfmot cannot
quantize, a runtime that refuses the converted file) used to fail after all of training.
Here the model the export will get is built as planned, untrained, outside any strategy;
each requested artifact is converted from it (one calibration batch; the int8 ones through
a throwaway QAT copy when QAT is enabled), loaded and run by its runtime, and checked as
after training (float artifacts give the model's logits; reduced-precision ones agree
with it). A converter or runtime refusing the model (known from where the exception was
raised, `errors.refused`) is a config error naming the artifact (known from which one was
being made, `errors.making`), the op or layer, and what to do; nothing is written.
Anything else raised is a bug in tftrain: exit 1 with its traceback and a line saying so.
`export.preflight: false` turns it off.
"""
from __future__ import annotations

import contextlib
import io
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tftrain.config import ConfigError
from tftrain.export import kinds

EXAMPLES = 8            # validation and calibration examples the preflight converts with
QUANTIZING = "compression.quantization"    # what fails when tfmot cannot wrap a layer


@dataclass(frozen=True)
class Preflight:
    seconds: float
    artifacts: tuple[str, ...]

    def describe(self) -> str:
        return (f"export preflight: {', '.join(self.artifacts)} converted and run "
                f"untrained in {self.seconds:.1f} s (export.preflight: false skips it)")


def wanted(cfg, qat: bool) -> bool:
    return cfg.export.preflight and any(kind.in_preflight for kind in kinds.enabled(cfg, qat))


def run(cfg, net, source, qat: bool) -> Preflight | None:
    """Convert every export `cfg` asks for from a fresh copy of `net` (the model the last
    stage will hand to the export, as planned), load and run each artifact, and check
    what it computes. A converter or runtime refusing the model, or an artifact that
    does not compute the model, is a ConfigError naming the artifact (the model or the
    config must change); anything else is a bug in tftrain: a RuntimeError saying so,
    its traceback kept."""
    if not wanted(cfg, qat):
        return None
    from tftrain.core import console

    began = time.perf_counter()
    with console.phase("preflight", "converting every export from the untrained model",
                       ended=False), \
            contextlib.redirect_stdout(io.StringIO()):   # (the untrained layers' warnings)
        found = _converted(cfg, net, source, qat)
    return Preflight(time.perf_counter() - began, found)


def _converted(cfg, net, source, qat: bool) -> tuple[str, ...]:
    """The artifacts converted, run and checked (a ConfigError or a bug otherwise)."""
    from tftrain.export import exports, verification
    from tftrain.export.context import ExportFlags
    from tftrain.export.errors import ArtifactError, making

    model = _copy(net)
    from tftrain.core.native_log import quiet
    with tempfile.TemporaryDirectory(prefix="tftrain-preflight-") as tmp, quiet():
        try:
            sample = _Sample(source)
            if qat:
                from tftrain.compress import quantization
                from tftrain.data import preprocess
                with making(QUANTIZING):
                    model = quantization.quantize_configured(model, cfg)
                    # ranges calibrated as the QAT stage calibrates them before its first
                    # update: tfmot's [-6, 6] rounds an untrained network's small values
                    # to nothing (EfficientNetV2B0's squeeze-excite pooling at -0.8 dB)
                    quantization.calibrate_ranges(model, (x for x, _ in preprocess(
                        sample.validation(), cfg.data).batch(64).as_numpy_iterator()))
            report = exports.export_all(model, cfg, Path(tmp), sample, ExportFlags(
                qat=qat, layers=not qat, by_labels=False, timed=False, untrained=True))
        except ArtifactError as err:
            raise _classified(cfg, err) from err.error
    failed = verification.failures(report)
    if failed:
        first = failed[0].split(":", 1)[0]
        raise ConfigError(f"{setting(cfg, first)[0]}: the untrained model's {first} does not "
                          f"compute the model: {'; '.join(failed)}; {setting(cfg, first)[1]}, "
                          "or set export.preflight: false to find out after training")
    return tuple(report)


def _classified(cfg, err) -> Exception:
    """A ConfigError when a converter or runtime refused the model (`errors.refused`),
    else a RuntimeError saying it is a bug in tftrain."""
    from tftrain.export.errors import refused

    library = refused(err.error)
    if library is None:
        return RuntimeError(
            f"export preflight, making {err.artifact}: {type(err.error).__name__}: {err.error}; "
            "this is a bug in tftrain, not a problem of your config or model: please report "
            "it with the traceback above (export.preflight: false skips the preflight)")
    return ConfigError(refusal(cfg, err.artifact, err.error, library))


def _copy(net):
    """A float32 copy of `net` with fresh variables, made outside any strategy (planning
    ends its scope first): no collective, no device placement, what the chief exports."""
    import tensorflow_model_optimization as tfmot

    from tftrain.core.keras import keras
    from tftrain.export.artifacts import inference_model

    with tfmot.quantization.keras.quantize_scope():
        return keras.models.clone_model(inference_model(net))


class _Sample:
    """The first few validation examples of a source: enough to convert, calibrate and run.
    An int8 file is calibrated on the very examples it is checked on, so its ranges hold
    them: an untrained network's activations can be near dead or saturated, and ranges
    from other examples would clip what the check then sees (an untrained MobileNetV2's
    14th block: 0 dB) although the conversion is sound."""

    def __init__(self, source, n: int = EXAMPLES):
        self._source, self.num_val = source, min(n, source.num_val)
        serving = source.spec.serving
        self.spec = source.spec if serving is None else replace(
            source.spec, serving=replace(serving, validation=serving.validation[:self.num_val]))

    def validation(self):
        return self._source.validation().take(self.num_val)

    def calibration(self, n: int):
        return self.validation()


# --- what a failure means -----------------------------------------------------------
_OPS = (re.compile(r"'tf\.(\w+)' op is neither a custom op nor a flex op"),     # TFLite
        re.compile(r"Custom ops: (\w+)"),
        re.compile(r"Unsupported ops: Counter\(\{'(\w+)'"),                     # tf2onnx
        re.compile(r"\b(\w+) is not supported\b"))


def refusal(cfg, artifact: str, err: Exception, library: str) -> str:
    """One config-error line for an artifact whose conversion `library` refused: which
    export, which op and layer (when the converter names them) and the settings that
    avoid it."""
    text = str(err)
    op = next((m.group(1) for m in (p.search(text) for p in _OPS) if m), None)
    key, fix = setting(cfg, artifact)
    if op:
        layer = re.search(rf'fused\["{op}:", "[^/"]+/([^/"]+)/', text)
        found = f"op {op}" + (f" (layer {layer.group(1)})" if layer else "") + \
            f" has no {_target(artifact)} form"
    else:
        # the first line that says something (TensorFlow's own start "in user code:")
        lines = [line.strip() for line in text.splitlines()
                 if line.strip() and line.strip() != "in user code:"]
        found = f"{library}: " + (lines[0] if lines else type(err).__name__)[:300]
    return (f"{key}: the untrained model does not convert: {found}; {fix}, or set "
            "export.preflight: false to find out after training")


def setting(cfg, artifact: str) -> tuple[str, str]:
    """(the config key that asks for `artifact`, the setting that avoids it): its kind's,
    or QAT's when the model was being quantized."""
    if artifact == QUANTIZING:
        return artifact, ("leave the layer out of QAT (compression.quantization.layers, or "
                          "skip_unsupported: true) or disable compression.quantization")
    kind = kinds.named(artifact)
    return kind.key, kind.fix


def _target(artifact: str) -> str:
    return "exported" if artifact == QUANTIZING else kinds.named(artifact).target()
