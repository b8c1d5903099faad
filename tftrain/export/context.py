"""What every export kind shares (`ExportContext`): the inference model, the validation
inputs and labels, the model's reference logits, the calibration examples, the export
config and the run's flags (`ExportFlags`), and what one kind makes that a later one
reuses (the float SavedModel, the float and the int8 TFLite flatbuffers), each made
once, when first asked for."""
from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

from tftrain.data import BatchPlan, preprocess, val_dataset
from tftrain.export import artifacts, fidelity, file_memory, speed, verification
from tftrain.export.measures import (NOISE_EXAMPLES, accuracy, against, input_kind,
                                     layer_rounding_noise, rounding_noise, signature_latency,
                                     signature_logits, sizes, traced_logits)
from tftrain.models import hard_swish


@dataclass(frozen=True)
class ExportFlags:
    """How the run exports. `qat`: the model was quantization-aware trained (int8 uses
    its learned ranges). `layers`: reduced-precision files compared with the model layer
    by layer (`export.fidelity`). `timed` (None: as `layers`): each file timed
    (`export.speed`). `by_labels: False`: reduced-precision files judged against the
    model's logits and layers, not by accuracy (an untrained or smoke-trained model,
    whose accuracy is noise: `verification.verify`). `untrained`: the export preflight."""
    qat: bool = False
    layers: bool = True
    by_labels: bool = True
    timed: bool | None = None
    untrained: bool = False

    @property
    def timing(self) -> bool:
        return self.layers if self.timed is None else self.timed


class ExportContext:
    """The model `model` exported under `out` for the run's config `cfg`, checked on the
    validation set of `source` (validation's input: decoded, resized and the
    deterministic steps of `data.augment`). `float_model`: the float model before any
    QAT, for the kinds that hand it back (the Keras 3 file)."""

    def __init__(self, model, cfg, out: Path, source, flags: ExportFlags,
                 float_model=None):
        self.cfg, self.e, self.out, self.source, self.flags = cfg, cfg.export, out, source, flags
        self.model = model
        self.float_model = float_model if float_model is not None else model
        self.x, self.y = (np.concatenate(parts) for parts in zip(
            *val_dataset(source, BatchPlan(1024, 1, 1), cfg.data).as_numpy_iterator()))
        self.plain = artifacts.inference_model(model)
        # the model called eagerly, batch by batch (a trace costs 2-3 s for a MobileNetV2)
        self.reference = signature_logits(self.call, self.x)
        self.serving = source.spec.serving
        self.raw = self.x if self.serving is None else self.serving.validation
        self._int8: tuple[bytes, np.ndarray | None] | None = None
        self._scratch: list[Path] = []

    def call(self, inputs) -> dict:
        return {"logits": tf.cast(self.plain(inputs, training=False), tf.float32)}

    # -- what kinds share, made when first asked for -------------------------------------
    @functools.cached_property
    def traced(self) -> np.ndarray:
        """The model's logits with the model traced as a function (`measures.traced_logits`),
        as its SavedModel and Keras' `evaluate` compute them."""
        return traced_logits(self.plain, self.x)

    @functools.cached_property
    def reference_accuracy(self) -> float:
        """The accuracy reduced-precision files are held to: the model's on the validation
        set; a quantization-aware trained model's as traced (`traced`), what its stage
        logged and its SavedModel serves. Eager, a fake-quant value on an 8-bit rounding
        edge moves a whole step (`measures.against_traced`): an EfficientNetB3's QAT model
        was one of 270 examples apart (0.8222 eager, 0.8185 traced and logged), which put
        an int8 file two examples below the model three below it, over a budget of 2.7."""
        return accuracy(self.traced if self.flags.qat else self.reference, self.y)

    @functools.cached_property
    def calibration(self) -> np.ndarray:
        """`export.calibration_examples` training examples, as validation's input."""
        examples = preprocess(self.source.calibration(self.e.calibration_examples), self.cfg.data)
        return np.concatenate([x for x, _ in examples.batch(256).as_numpy_iterator()])

    @functools.cached_property
    def saved_model_path(self) -> Path:
        """The float SavedModel (`saved_model/`, removed at the end unless
        `export.saved_model`)."""
        path = artifacts.write_saved_model(self.plain, self.out / "saved_model", self.serving)
        if not self.e.saved_model:
            self._scratch.append(path)
        return path

    @functools.cached_property
    def saved_signature(self):
        """The float SavedModel's serving signature, loaded back once."""
        return tf.saved_model.load(str(self.saved_model_path)).signatures["serving_default"]

    @functools.cached_property
    def saved_model(self) -> tuple[Path, np.ndarray]:
        """The float SavedModel's path and its logits on the validation set."""
        return self.saved_model_path, signature_logits(self.saved_signature, self.raw)

    @functools.cached_property
    def tflite_source(self) -> Path:
        """The SavedModel TFLite converts from: the float one, or, where the serving
        signature takes raw input (text), a copy taking the model's own (token ids)."""
        if self.serving is None:
            return self.saved_model[0]
        path = artifacts.write_saved_model(self.plain, self.out / "tflite_source")
        self._scratch.append(path)
        return path

    @functools.cached_property
    def float_flatbuffer(self) -> bytes:
        """The float TFLite file of the model: `model.tflite` of `export.tflite: float`,
        else timed beside a reduced-precision or sparse file (not written); of a QAT
        model, its float function (`artifacts.float_tflite`)."""
        return artifacts.float_tflite(self.plain, self.tflite_source, self.out, self.flags.qat)

    def flatbuffer(self, precision: str) -> bytes:
        """The TFLite file in `precision` (the int8 one: `int8_flatbuffer`)."""
        if precision == "int8":
            return self.int8_flatbuffer()
        if precision == "float":
            return self.float_flatbuffer
        return artifacts.convert_tflite(self.tflite_source, precision, self.calibration)

    def int8_flatbuffer(self) -> bytes:
        """The int8 TFLite file: from the QAT ranges, or calibrated (HardSwish layers
        traced unfused where safe, `hard_swish`); once `publish_int8` was called (the
        int8 TFLite kind, after any fallback), the file it published."""
        if self._int8 is None:
            if not self.flags.qat and hard_swish.has_hard_swish(self.plain):
                blob = artifacts.converted_within(
                    hard_swish.unfused(hard_swish.unfusable(self.plain, self.calibration)),
                    self.plain, self.out / "tflite_int8_source", "int8", self.calibration)
            else:
                blob = artifacts.convert_tflite(self.tflite_source, "int8", self.calibration,
                                                qat=self.flags.qat)
            self._int8 = (blob, None)
        return self._int8[0]

    def int8_logits(self) -> np.ndarray:
        """The int8 TFLite file's logits on the validation set."""
        blob = self.int8_flatbuffer()
        if self._int8[1] is None:
            self._int8 = (blob, artifacts.tflite_logits(blob, self.x)[0])
        return self._int8[1]

    def publish_int8(self, blob: bytes, logits: np.ndarray) -> None:
        """The int8 file later kinds (the int8 ONNX file) take, and its logits."""
        self._int8 = (blob, logits)

    def noise(self) -> float:
        """The model's own logit noise (`measures.rounding_noise`): one more pass, only
        for a float file further apart than float rounding at its logits; a QAT model's
        SavedModel is held to its traced graph instead (`measures.against_traced`)."""
        return self._noise

    @functools.cached_property
    def _noise(self) -> float:
        if self.flags.qat:
            return 0.0
        return max(rounding_noise(lambda v: self.plain(v, training=False), self.x, self.reference),
                   layer_rounding_noise(self.plain, self.x[:NOISE_EXAMPLES], self.reference))

    # -- measuring a file -------------------------------------------------------------------
    def latency(self, signature) -> dict:
        """A loaded SavedModel signature's `latency_ms`, one example a call, when the run
        times its files (not a smoke run)."""
        return {"latency_ms": signature_latency(signature, self.raw) * 1e3} \
            if self.flags.timing else {}

    def with_noise(self, entry: dict) -> dict:
        """A float file's entry, with the model's own logit noise where its logits are
        further apart than `export.max_logit_diff` allows (what its check may allow for)."""
        if not self.logits_within(entry):
            entry["logit_noise"] = self.noise()
        return entry

    def logits_within(self, entry: dict, noise: bool = False) -> bool:
        """Whether a float file's logits are within its limit (`verification.logits_within`),
        with the model's own logit noise allowed for (`noise`)."""
        return verification.logits_within({**entry, "logit_noise": self.noise()} if noise
                                          else entry, self.e)

    @staticmethod
    def below_floor(entry: dict, precision: str) -> bool:
        """Whether a file's logits are below its precision's floor without labels
        (`verification.SQNR_FLOOR_DB`): noise, to be judged by its layers instead."""
        return entry["logit_sqnr_db"] < verification.SQNR_FLOOR_DB[precision]

    def tflite_entry(self, blob: bytes, layers: bool, precision: str = "int8",
                     beside: bytes | None = None) -> dict:
        """A TFLite file's report entry (its `logits` too, for the caller to take), timed
        when the run times (in turn with the float file `beside`), its `layers` compared
        as a file of `precision`."""
        logits, latency = artifacts.tflite_logits(blob, self.x)
        timed, reference = self.flags.timing, self.e.latency_reference
        front = next((inner.name for inner in (getattr(layer, "layer", layer)   # QAT's wrapper
                                               for layer in self.plain.layers)
                      if getattr(inner, "front_end", False)), None)
        entry = {**sizes(blob), **file_memory.layout(blob, front), "accuracy": accuracy(logits, self.y),
                 **against(logits, self.reference),
                 "latency_ms": latency * 1e3, "input": input_kind(self.plain, None),
                 "logits": logits,
                 **(speed.tflite_entry(blob, self.x, beside) if timed else {}),
                 **(speed.versus_reference(blob, "tflite", self.x, reference)
                    if timed and reference else {})}
        if layers:
            entry.update(fidelity.tflite_entry(blob, self.plain, self.calibration, self.e,
                                               precision))
        return entry

    def write_vocabulary(self) -> None:
        """`vocabulary.txt` beside the artifacts, where the serving signature tokenizes."""
        if self.serving is not None and hasattr(self.serving.layer, "get_vocabulary"):
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "vocabulary.txt").write_text(
                "\n".join(self.serving.layer.get_vocabulary()) + "\n", encoding="utf-8")

    def close(self) -> None:
        """Remove what was made only as a conversion's source."""
        for path in self._scratch:
            shutil.rmtree(path, ignore_errors=True)
