"""The export kinds: every artifact tftrain can make, each one object, in the order they
are made (`KINDS`). A kind knows whether a config asks for it, its name in summary.json,
its title in the plan, where it is written, the precision it computes in, what it
refuses at plan time, and how it writes and measures its file from the shared
`context.ExportContext`, reusing what earlier kinds made there (the float SavedModel, the
int8 flatbuffer). The plan, `--dry-run`, the export phase, the preflight, verification,
the report and the search all read `KINDS`; no other list of exports exists. Adding an
export is one class here and one line in `KINDS`.

Importable without TensorFlow (the dry run reads it before TensorFlow loads): a kind's
`make` and `refusal` import what they convert with when they are called.
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from tftrain.core.config_types import ConfigError
from tftrain.core.keras_files import writer_of


class ExportKind:
    """One kind of artifact. Subclasses set the class attributes and `enabled`, `make`."""
    name: str            # its entry in summary.json, e.g. "tflite_int8"
    title: str           # as the plan and the export phase name it
    path: str            # where it is written, relative to the run directory
    precision: str       # what it computes in: float, int8, dynamic or float16
    runtime: str         # what runs it: tensorflow, tflite, onnx or keras3
    key: str             # the config key that asks for it
    fix: str             # the setting that avoids it when its conversion fails
    # its place in the run's headline accuracy (`report.deployed_accuracy`): the lowest
    # present is what the run was compressed for (None: never the headline)
    headline: int | None = None
    in_preflight: ClassVar[bool] = True     # converted from the untrained model first

    def enabled(self, cfg, qat: bool) -> bool:
        """Whether the run's config `cfg` (with `qat`: the last stage quantization-aware
        trains) makes this artifact."""
        raise NotImplementedError

    def planned(self, cfg, qat: bool) -> bool | None:
        """`enabled` as known from the config alone, before TensorFlow loads (the dry run);
        None: known only once the model is built."""
        return self.enabled(cfg, qat)

    def refusal(self, cfg, model, qat: bool) -> str | None:
        """Why this artifact cannot be made from `model` (the model the last stage hands
        to the export, as planned), checked at plan time; None: it can."""
        return None

    def target(self) -> str:
        """What a converter refusing an op says the op has no form in."""
        return "exported"

    def make(self, ctx) -> dict:
        """Write the artifact under `ctx.out`, run it back, and return its report entry."""
        raise NotImplementedError


class SavedModel(ExportKind):
    name, title, path = "saved_model", "SavedModel", "export/saved_model/"
    precision, runtime, headline = "float", "tensorflow", 8
    key, fix = "export.saved_model", "replace the layer"

    def enabled(self, cfg, qat):
        return cfg.export.saved_model

    def make(self, ctx):
        from tftrain.export.measures import (accuracy, against, against_traced, dir_bytes,
                                             input_kind, sizes)
        path, logits = ctx.saved_model
        return ctx.with_noise({
            **sizes(dir_bytes(path)), "accuracy": accuracy(logits, ctx.y),
            **(against_traced(logits, ctx.traced, ctx.reference) if ctx.flags.qat
               else against(logits, ctx.reference)),
            **ctx.latency(ctx.saved_signature),
            "input": input_kind(ctx.plain, ctx.serving)})


class Int8SavedModel(ExportKind):
    name, title, path = "saved_model_int8", "int8 SavedModel", "export/saved_model_int8/"
    precision, runtime, headline = "int8", "tensorflow", 6
    key, fix = "export.saved_model_int8", "set export.saved_model_int8: false"

    def enabled(self, cfg, qat):
        return cfg.export.saved_model_int8

    def make(self, ctx):
        """Write the int8-kernel SavedModel (`export.int8_saved_model`), load it back and
        evaluate it like the other artifacts, and compare it with the model layer by
        layer."""
        import numpy as np
        import tensorflow as tf

        from tftrain.export import artifacts, fidelity, int8_saved_model
        from tftrain.export.measures import (accuracy, against, dir_bytes, gzip_size,
                                             input_kind, signature_logits, sizes)

        path, qat = ctx.out / "saved_model_int8", ctx.flags.qat
        quantized, layers = int8_saved_model.quantized_model(ctx.plain, qat)
        artifacts.write_saved_model(quantized, path, ctx.serving)
        loaded = tf.saved_model.load(str(path)).signatures["serving_default"]
        logits = signature_logits(loaded, ctx.raw)
        zeros = [entry["zero_fraction"] for entry in layers.values()]
        return {**sizes(dir_bytes(path)),
                "variables_gzip_bytes": gzip_size(dir_bytes(path / "variables")),
                "accuracy": accuracy(logits, ctx.y), **against(logits, ctx.reference),
                **ctx.latency(loaded),
                "kernels": "int8 codes x per-channel scale from " + (
                    "the QAT ranges" if qat else "post-training weight-only quantization"),
                "int8_layers": len(layers),
                "folded_batch_norms": sum("folded" in e for e in layers.values()),
                "int8_zero_fraction": float(np.mean(zeros)) if zeros else 0.0,
                **(fidelity.saved_model_int8_entry(ctx.plain, quantized, layers,
                                                   ctx.calibration, ctx.e)
                   if ctx.flags.layers else {}),
                "input": input_kind(ctx.plain, ctx.serving)}


class TFLite(ExportKind):
    """`model.tflite` in one precision (`export.tflite`); a QAT model's is int8."""
    path, runtime = "export/model.tflite", "tflite"
    fix = "replace the layer or set export.tflite: none"

    def __init__(self, precision: str, headline: int):
        self.precision, self.headline = precision, headline
        self.name, self.title = f"tflite_{precision}", f"TFLite {precision}"
        self.key = f"export.tflite ({precision})"

    def enabled(self, cfg, qat):
        return cfg.export.tflite == self.precision

    def refusal(self, cfg, model, qat):
        """A post-training int8 or dynamic-range file of a model with an audio feature
        layer quantizes that layer's power spectrum to 8 bits as it enters the mel
        product (int8 at calibrated ranges; dynamic range: each call's own), a range far
        wider than 8 bits hold, and the features come out as noise (a smoke-trained
        DS-CNN's dynamic-range features 5.2 dB above their error)."""
        if qat or self.precision not in ("int8", "dynamic"):
            return None
        features = [layer.name for layer in model.layers
                    if type(layer).__name__ == "AudioFeatures"]
        if not features:
            return None
        return (f"export.tflite: post-training {self.precision} quantization makes 8-bit "
                f"values of the power spectrum in layer {features[0]} (the audio "
                "features), and the features come out as noise; quantize with QAT "
                "(compression.quantization: {enabled: true}), which quantizes each frame at its "
                "own scale (or keeps the features float), or export tflite: float16")

    def target(self):
        return "TFLite builtin"

    def make(self, ctx):
        from tftrain.export import fidelity

        blob, flags, e = ctx.flatbuffer(self.precision), ctx.flags, ctx.e
        quantized = self.precision != "float"
        entry = ctx.tflite_entry(blob, quantized and flags.layers, self.precision,
                                 beside=ctx.float_flatbuffer if quantized and flags.timing
                                 else None)
        if not quantized and flags.layers and not ctx.logits_within(entry) \
                and not ctx.logits_within(entry, noise=True):
            # judged by its layers: a deep untrained network amplifies float rounding
            rows, missing = fidelity.tflite_compared(blob, ctx.plain,
                                                     ctx.calibration[:fidelity.EXAMPLES])
            entry.update(layers=rows, worst_layers=[r["layer"] for r in fidelity.worst(rows)],
                         **({"uncompared": missing} if missing else {}))
        elif self.precision == "int8" and not (flags.layers or flags.by_labels) and \
                ctx.below_floor(entry, "int8"):
            # the preflight's untrained QAT model, its logits noise: judged by its layers
            # (an untrained EfficientNetV2B0 amplified its int8 rounding to -0.6 dB)
            entry.update(fidelity.tflite_entry(blob, ctx.plain, ctx.calibration, e))
        if flags.qat and e.int8_fallback != "off" and flags.timing and flags.by_labels and \
                ctx.reference_accuracy - entry["accuracy"] > e.max_accuracy_drop + 1e-9:
            blob, entry = _with_fallback(ctx, blob, entry)
        if self.precision == "int8":
            ctx.publish_int8(blob, entry["logits"])
        (ctx.out / "model.tflite").write_bytes(blob)
        entry.pop("logits")
        return entry if quantized else ctx.with_noise(entry)


class SparseTFLite(ExportKind):
    name, title, path = "tflite_sparse", "sparse TFLite", "export/model_sparse.tflite"
    precision, runtime = "float", "tflite"
    key, fix = "export.tflite_sparse", "set export.tflite_sparse: false"

    def enabled(self, cfg, qat):
        return cfg.export.tflite_sparse

    def refusal(self, cfg, model, qat):
        from tftrain.export import sparse
        why = ("a quantization-aware trained model exports int8; disable "
               "compression.quantization" if qat
               else sparse.refusal(model, cfg.compression.pruning))
        return f"export.tflite_sparse: {why}" if why else None

    def target(self):
        return "TFLite builtin"

    def make(self, ctx):
        """Float, its pruned weights stored sparse (`export.sparse`)."""
        from tftrain.export import sparse

        blob = sparse.convert(ctx.saved_model[0])
        (ctx.out / "model_sparse.tflite").write_bytes(blob)
        timed = ctx.flags.timing
        entry = ctx.tflite_entry(blob, False, beside=ctx.float_flatbuffer if timed else None)
        entry.pop("logits")
        return ctx.with_noise({**entry, **(sparse.report(blob, entry["xnnpack"]) if timed
                                           else {})})


class Onnx(ExportKind):
    """`model.onnx`: float32; not of a QAT model, whose float graph holds fake-quant ops."""
    name, title, path = "onnx", "ONNX", "export/model.onnx"
    precision, runtime, headline = "float", "onnx", 7
    key, fix = "export.onnx", "replace the layer or set export.onnx: false"

    def enabled(self, cfg, qat):
        return cfg.export.onnx and not qat

    def target(self):
        from tftrain.export.onnx_export import OPSET
        return f"ONNX opset {OPSET}"

    filename = "model.onnx"

    def convert(self, ctx) -> bytes:
        from tftrain.export.onnx_export import float_onnx
        return float_onnx(ctx.plain)

    def make(self, ctx):
        """Written, run with ONNX Runtime on the validation set and timed; an int8 file
        also compared with the model layer by layer (`onnx_fidelity`)."""
        import numpy as np

        from tftrain.export import onnx_export as ox, speed
        from tftrain.export.measures import accuracy, against, input_kind, sizes

        blob, quantized, timed = self.convert(ctx), self.precision == "int8", ctx.flags.timing
        (ctx.out / self.filename).write_bytes(blob)
        sess = ox.session(blob, int8=quantized)
        logits = ox.logits(sess, ctx.x)
        reference = ctx.e.latency_reference
        entry = {
            **sizes(blob), "accuracy": accuracy(logits, ctx.y), **against(logits, ctx.reference),
            "max_abs_diff_vs_saved_model": float(np.max(np.abs(logits - ctx.saved_model[1]))),
            "latency_ms": ox.latency(sess, ctx.x) * 1e3, "input": input_kind(ctx.plain, None),
            **({"latency_grid": speed.onnx_grid(blob, ctx.x, quantized)} if timed else {}),
            **(speed.versus_reference(blob, "onnx", ctx.x, reference, quantized)
               if timed and reference else {})}
        if not quantized:
            return ctx.with_noise(entry)
        entry["max_abs_diff_vs_tflite_int8"] = float(np.max(np.abs(logits - ctx.int8_logits())))
        graph = ox.optimized_graph(blob)
        entry.update(int8_kernels=ox.int8_kernels(graph),
                     session_config=dict(ox.INT8_SESSION_CONFIG), layout=self.layout(ctx))
        if ctx.flags.layers:
            from tftrain.export import onnx_fidelity
            entry.update(onnx_fidelity.entry(blob, ox.float_ops(graph), ctx.plain,
                                             ctx.calibration, ctx.e))
        return entry


class OnnxInt8(Onnx):
    """`model_int8.onnx` (QDQ) from the int8 TFLite flatbuffer, where there is one."""
    name, title, path = "onnx_int8", "ONNX int8", "export/model_int8.onnx"
    precision, headline = "int8", 5

    def enabled(self, cfg, qat):
        return cfg.export.onnx and (qat or cfg.export.tflite == "int8")

    filename = "model_int8.onnx"

    def layout(self, ctx) -> str:
        from tftrain.export.onnx_export import int8_format
        return int8_format() if ctx.e.onnx_int8_layout == "auto" else ctx.e.onnx_int8_layout

    def convert(self, ctx) -> bytes:
        from tftrain.export.onnx_export import int8_onnx
        return int8_onnx(ctx.int8_flatbuffer(), self.layout(ctx))


class Keras3File(ExportKind):
    """`model.keras`: the float model handed back as Keras 3, for a model that came in as
    Keras 3 (`export.keras3_file`)."""
    name, title, path = "keras3_file", "Keras 3 file", "export/model.keras"
    precision, runtime = "float", "keras3"
    key, fix = "model.name", "give the model as tf_keras"
    in_preflight = False        # made from the float model before any QAT, not the last

    def enabled(self, cfg, qat):
        from tftrain.models import came_in_as_keras3
        return came_in_as_keras3(cfg.model.name)

    def planned(self, cfg, qat):
        """A file written by Keras 3 says so in its metadata; a builder of the user's
        says so only when it returns its model."""
        name = cfg.model.name
        if name.startswith("file:"):
            try:
                return writer_of(Path(name[len("file:"):]))[0] == "keras3"
            except (ConfigError, OSError):     # (a bad file is the full plan's to name)
                return None
        return None if ":" in name and not name.startswith("keras_applications:") else False

    def make(self, ctx):
        from tftrain.export import keras3_file
        return keras3_file.write(ctx)


def _with_fallback(ctx, int8: bytes, entry: dict) -> tuple[bytes, dict]:
    """`export.int8_fallback: auto` (`export.fallback`): the int8 file with layers fallen
    back to float kernels until within `export.max_accuracy_drop`, and its entry."""
    from tftrain.compress import quantization
    from tftrain.export import artifacts, fallback
    from tftrain.export.measures import accuracy

    def convert(wrappers) -> bytes:         # strict QDQ, those layers' kernels float
        return artifacts.converted_within(quantization.kernels_unquantized(wrappers), ctx.plain,
                                          ctx.out / "tflite_fallback", "int8", ctx.calibration,
                                          qat=True, strict=True)

    return fallback.within_budget(
        ctx.plain, int8, entry, convert,
        lambda b: accuracy(artifacts.tflite_logits(b, ctx.x)[0], ctx.y),
        lambda b: ctx.tflite_entry(b, True, beside=ctx.float_flatbuffer),
        ctx.reference_accuracy, ctx.e)


# The order artifacts are made in: each may reuse what those before it made.
KINDS: tuple[ExportKind, ...] = (
    SavedModel(),
    Int8SavedModel(),
    TFLite("float", headline=4),
    TFLite("dynamic", headline=3),
    TFLite("float16", headline=2),
    TFLite("int8", headline=1),
    SparseTFLite(),
    Onnx(),
    OnnxInt8(),
    Keras3File(),
)


def enabled(cfg, qat: bool) -> list[ExportKind]:
    """The kinds the run's config makes, in the order they are made."""
    return [kind for kind in KINDS if kind.enabled(cfg, qat)]


def named(name: str) -> ExportKind:
    """The kind whose summary entry is `name` (a KeyError naming the kinds otherwise)."""
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise KeyError(f"no export kind {name!r}; kinds: {', '.join(k.name for k in KINDS)}")


def exports_line(cfg, qat: bool, built: bool = True) -> str:
    """The artifacts the config makes, as both plans and the export phase print them;
    before the model is `built` (the dry run), the kinds only the model decides are
    named as such."""
    if built:
        return "exports: " + (", ".join(kind.title for kind in enabled(cfg, qat)) or "none")
    known = [kind.title for kind in KINDS if kind.planned(cfg, qat)]
    open_ = [kind.title for kind in KINDS if kind.planned(cfg, qat) is None]
    return "exports: " + (", ".join(known) or "none") + "".join(
        f"\nexports the model decides: a {title} if it comes in as one (known when it is "
        "built)" for title in open_)


def headline_order() -> list[str]:
    """The artifacts a run's headline accuracy is taken from, first choice first."""
    ranked = [(kind.headline, kind.name) for kind in KINDS if kind.headline is not None]
    return [name for _, name in sorted(ranked)]


def deployed(runtime: str, precision: str) -> str:
    """The artifact of `runtime` a file of `precision` is deployed as (a precision the
    runtime has no kind for: its float file)."""
    mine = [kind for kind in KINDS if kind.runtime == runtime and kind.headline is not None]
    return next((kind.name for kind in mine if kind.precision == precision),
                next(kind.name for kind in mine if kind.precision == "float"))
