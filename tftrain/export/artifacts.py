"""Export to SavedModel, TFLite and ONNX, then load every artifact back and evaluate it.

The SavedModel has a `serving_default` signature taking `inputs` and returning float32
`logits` whatever the training precision. TFLite models are converted from that
SavedModel (`float`, `dynamic`, `float16`, or full-integer `int8` calibrated on training
examples) and run with LiteRT (`ai-edge-litert`). ONNX files (`tftrain.export.onnx_export`) run
with ONNX Runtime.
"""
from __future__ import annotations

import functools
import gzip
import shutil
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.models import tensor_ops
from tftrain.export.calibration import own_ranges
from tftrain.export.measures import (accuracy, against, against_traced, dir_bytes, input_kind,
                                     layer_rounding_noise, rounding_noise, signature_latency,
                                     signature_logits, sizes)

# examples each layer's own rounding noise is measured on (an eager replay: slow)
NOISE_EXAMPLES = 256


def inference_model(model):
    """A plain float32 functional model with the same weights (no training wrappers):
    the same layers when they already compute in float32, else float32 copies."""
    pinned = any(getattr(layer, "_tftrain_pinned", False) for layer in model.layers)
    if not pinned and all(layer.compute_dtype in (None, "float32") for layer in model.layers
                          if not isinstance(layer, keras.layers.InputLayer)):
        return keras.Model(model.inputs, model.outputs, name=model.name)
    # float32 copies, unpinned from model-parallel devices the serving host may not have
    clone = keras.models.clone_model(model, clone_function=_float32_layer)
    clone.set_weights(model.get_weights())
    return clone


def _float32_layer(layer):
    config = layer.get_config()
    if "dtype" in config:
        config["dtype"] = "float32"
    return layer.__class__.from_config(config)


def refusal(model, cfg, qat: bool) -> str | None:
    """Why the export `cfg` asks for cannot be made from `model` (None: it can): a
    post-training int8 or dynamic-range TFLite file of a model with an audio feature
    layer quantizes that layer's DFT and mel matrices as 8-bit weights, and the features
    come out as noise (the logits of an untrained DS-CNN -1.3 dB above their error)."""
    if qat or cfg.tflite not in ("int8", "dynamic"):
        return None
    features = [layer.name for layer in model.layers if type(layer).__name__ == "AudioFeatures"]
    if not features:
        return None
    return (f"post-training {cfg.tflite} quantization makes 8-bit weights of the DFT and mel "
            f"matrices of layer {features[0]} (the audio features), and the features come out "
            "as noise; quantize with QAT (compression.quantization: {enabled: true}), which "
            "keeps the feature layer float, or export tflite: float16")


def save_saved_model(model, path: Path) -> Path:
    """SavedModel with a named serving signature returning float32 logits."""
    return _write_saved_model(inference_model(model), path)


def _write_saved_model(plain, path: Path, serving=None) -> Path:
    """`serving` (an `InputSpec.serving`): the signature takes its raw input and runs its
    layer (e.g. the fitted tokenizer) in front of the model.

    The root is a plain `tf.Module` holding the model's variables and the serving
    function, not the Keras model: saving a Keras model also traces and writes every
    layer's call functions for Keras reloading (5-7x the time of the save), and the
    artifact's contract is its signature alone."""
    root = tf.Module()
    root.variables_ = list(plain.variables)
    if serving is None:
        shape, dtype, prepare = plain.input_shape[1:], plain.inputs[0].dtype, None
    else:
        (shape, dtype), prepare = serving.spec, serving.layer
        root.preprocess = prepare          # tracks the tokenizer's vocabulary
    spec = tf.TensorSpec([None, *shape], dtype, name="inputs")

    @tf.function(input_signature=[spec])
    def serve(inputs):
        x = inputs if prepare is None else prepare(inputs)
        return {"logits": tf.cast(plain(x, training=False), tf.float32)}

    tf.saved_model.save(root, str(path), signatures={"serving_default": serve})
    return path


def saved_model_variables_gzip(model) -> int:
    """gzip size of the variables of `model`'s float32 SavedModel (the usual baseline
    for compression ratios). A SavedModel's `variables/` is a TensorFlow checkpoint of
    its variables (float32 under every policy), written here as they are: a MobileNetV2's
    in 0.3 s, against 3.6 s with a serving function and 4 s more for a float32 copy of a
    mixed-precision model; its gzip size is the SavedModel's to within a few dozen bytes."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tftrain-size-") as tmp:
        checkpoint = tf.train.Checkpoint(variables_=list(model.variables))
        checkpoint.write(str(Path(tmp) / "variables" / "variables"))
        return len(gzip.compress(dir_bytes(Path(tmp) / "variables"), 9))


def convert_tflite(saved_model: Path, mode: str, calibration: np.ndarray,
                   qat: bool = False, strict: bool = False) -> bytes:
    """TFLite flatbuffer from a SavedModel in the given mode. A quantization-aware
    trained model (`qat`) converts to int8 with the ranges it learned: no calibration.
    `strict` (QAT): an op whose kernel has no fake-quant stays float, not requantized."""
    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
    if mode in ("dynamic", "float16", "int8"):
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if strict:
        converter._experimental_strict_qdq = True
    if mode == "float16":
        converter.target_spec.supported_types = [tf.float16]
    if mode == "int8" and not qat:     # full integer: activations calibrated, int8 kernels
        dtype = np.float32 if calibration.dtype.kind == "f" else np.int32   # or token ids

        def representative():
            for row in calibration:
                yield [row[None].astype(dtype)]
        converter.representative_dataset = representative
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    with own_ranges():        # each tensor calibrated on its own values (`calibration`)
        return converter.convert()


def tflite_logits(flatbuffer: bytes, x: np.ndarray, threads: int = 1) -> tuple[np.ndarray, float]:
    """Run a TFLite model with LiteRT on each example; (logits, seconds per example)."""
    from ai_edge_litert.interpreter import Interpreter

    from tftrain.export.fidelity import set_example

    interp = Interpreter(model_content=flatbuffer, num_threads=threads)
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    interp.resize_tensor_input(inp["index"], [1, *x.shape[1:]])
    interp.allocate_tensors()
    oscale, ozero = out["quantization"]
    results, start = [], time.perf_counter()
    for row in x:
        set_example(interp, inp, row)
        interp.invoke()
        y = interp.get_tensor(out["index"]).astype(np.float32)
        results.append((y - ozero) * oscale if oscale else y)
    seconds = (time.perf_counter() - start) / max(len(x), 1)
    return np.concatenate(results), seconds


def tflite_weights(flatbuffer: bytes, min_size: int = 64) -> dict[str, np.ndarray]:
    """The constant tensors of a TFLite model with at least `min_size` elements, by
    tensor name (kernels, as stored: int8 in quantized models)."""
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=flatbuffer)
    interp.allocate_tensors()
    inputs = {d["index"] for d in interp.get_input_details()}
    found = {}
    for detail in interp.get_tensor_details():
        if detail["index"] in inputs or np.prod(detail["shape"]) < min_size:
            continue
        try:
            found[detail["name"]] = interp.get_tensor(detail["index"]).copy()
        except ValueError:            # intermediate tensors hold no data
            continue
    return found


def export_all(model, cfg, out: Path, source, qat: bool = False, data_cfg=None,
               layers: bool = True, by_labels: bool = True, timed: bool | None = None,
               untrained: bool = False) -> dict:
    """Write and verify every configured artifact; returns their report entries.
    `qat`: the model was quantization-aware trained (int8 uses its learned ranges).
    `layers`: compare int8 artifacts with the model layer by layer (`export.fidelity`);
    `timed` (default: as `layers`): time each file (`export.speed`), not for the export
    preflight.
    Artifacts take validation's input (decoded, resized and the deterministic steps of
    `data.augment`, e.g. normalize), checked on the validation set; `by_labels: False`
    checks reduced-precision ones against the model's logits instead of by accuracy (an
    untrained or smoke-trained model, whose accuracy is noise: `verification.verify`)."""
    from tftrain.data import BatchPlan, preprocess, val_dataset
    from tftrain.export import verification
    from tftrain.export.errors import making

    timed = layers if timed is None else timed
    report = {}
    if not (cfg.saved_model or cfg.saved_model_int8 or cfg.tflite != "none"
            or cfg.tflite_sparse or cfg.onnx):
        return report
    x_val, y_val = (np.concatenate(parts) for parts in zip(
        *val_dataset(source, BatchPlan(1024, 1, 1), data_cfg).as_numpy_iterator()))
    plain = inference_model(model)
    # the model called eagerly, batch by batch (a trace costs 2-3 s for a MobileNetV2)
    reference = signature_logits(
        lambda inputs: {"logits": tf.cast(plain(inputs, training=False), tf.float32)}, x_val)
    serving = source.spec.serving
    raw = x_val if serving is None else serving.validation
    with making("saved_model"):
        saved = _write_saved_model(plain, out / "saved_model", serving)
        loaded = tf.saved_model.load(str(saved)).signatures["serving_default"]
        saved_logits = logits = signature_logits(loaded, raw)
        report["saved_model"] = {**sizes(dir_bytes(saved)), "accuracy": accuracy(logits, y_val),
                                 **(against_traced(plain, x_val, logits, reference) if qat
                                    else against(logits, reference)),
                                 "latency_ms": signature_latency(loaded, raw) * 1e3,
                                 "input": input_kind(plain, serving)}
    calibration = None
    if cfg.saved_model_int8 or cfg.tflite != "none" or (cfg.onnx and qat):
        examples = preprocess(source.calibration(cfg.calibration_examples), data_cfg)
        calibration = np.concatenate([x for x, _ in examples.batch(256).as_numpy_iterator()])
    if cfg.saved_model_int8:
        with making("saved_model_int8"):
            report["saved_model_int8"] = {
                **_int8_saved_model(plain, out / "saved_model_int8", serving, raw, y_val,
                                    reference, qat, calibration, cfg, layers),
                "input": input_kind(plain, serving)}
    if serving is not None and hasattr(serving.layer, "get_vocabulary"):
        (out / "vocabulary.txt").write_text(
            "\n".join(serving.layer.get_vocabulary()) + "\n", encoding="utf-8")
    int8 = None            # the int8 TFLite flatbuffer, also the source of the int8 ONNX
    # the float TFLite file of the same model, timed beside a reduced-precision or sparse
    # one (not written): what the smaller file is faster or slower than
    beside = None
    tflite = f"tflite_{cfg.tflite}" if cfg.tflite != "none" else "onnx_int8"
    if cfg.tflite != "none" or (cfg.onnx and qat):
        mode = "int8" if qat else cfg.tflite
        with making(tflite):
            # TFLite takes the model's own input (token ids for text): convert a plain copy
            source_dir = saved if serving is None else _write_saved_model(plain,
                                                                          out / "tflite_source")
            if mode == "int8" and not qat and tensor_ops.has_hard_swish(plain):
                # post-training int8 of HardSwish layers: traced unfused where safe (tensor_ops)
                blob = _converted_within(tensor_ops.unfused(tensor_ops.unfusable(
                    plain, calibration)), plain, out / "tflite_int8_source", "int8", calibration)
            else:
                blob = convert_tflite(source_dir, mode, calibration, qat=qat)
            if timed and (cfg.tflite not in ("none", "float") or cfg.tflite_sparse):
                beside = blob if mode == "float" else _float_tflite(plain, source_dir, out, qat)
            if serving is not None:
                shutil.rmtree(source_dir)
        int8 = blob if mode == "int8" else None
    elif timed and cfg.tflite_sparse:
        with making("tflite_sparse"):
            beside = _float_tflite(plain, saved, out, qat)
    # the model's own logit noise (`measures.rounding_noise`), measured only when a float
    # artifact is further apart than float rounding at its logits: one more pass
    noise = functools.cache(lambda: 0.0 if qat else max(    # (QAT: `against_traced`)
        rounding_noise(lambda v: plain(v, training=False), x_val, reference),
        layer_rounding_noise(plain, x_val[:NOISE_EXAMPLES], reference)))
    int8_logits = None
    if cfg.tflite != "none":
        with making(tflite):
            entry = _tflite_entry(blob, plain, x_val, y_val, reference,
                                  mode != "float" and layers, calibration, cfg, timed=timed,
                                  beside=None if cfg.tflite == "float" else beside,
                                  precision=mode)
            if mode == "float" and layers and not verification.logits_within(entry, cfg) \
                    and not verification.logits_within({**entry, "logit_noise": noise()}, cfg):
                # judged by its layers: a deep untrained network amplifies float rounding
                from tftrain.export import fidelity
                rows = fidelity.tflite_report(blob, plain, calibration[:fidelity.EXAMPLES])
                entry.update(layers=rows, worst_layers=[r["layer"] for r in fidelity.worst(rows)])
            elif int8 is not None and not (layers or by_labels) and \
                    entry["logit_sqnr_db"] < verification.SQNR_FLOOR_DB["int8"]:
                # the preflight's untrained QAT model, its logits noise: judged by its layers
                # (an untrained EfficientNetV2B0 amplified its int8 rounding to -0.6 dB)
                from tftrain.export import fidelity
                entry.update(fidelity.tflite_entry(blob, plain, calibration, cfg))
            if qat and cfg.int8_fallback != "off" and timed and by_labels and \
                    accuracy(reference, y_val) - entry["accuracy"] > cfg.max_accuracy_drop + 1e-9:
                blob, entry = _with_fallback(plain, out, blob, entry, x_val, y_val, reference,
                                             calibration, cfg, beside)
                int8 = blob
        (out / "model.tflite").write_bytes(blob)
        logits = entry.pop("logits")
        int8_logits = logits if int8 is not None else None
        report[tflite] = entry
    if cfg.tflite_sparse:                # float, its pruned weights stored sparse
        with making("tflite_sparse"):
            report["tflite_sparse"] = _sparse_entry(saved, plain, out, x_val, y_val, reference,
                                                    calibration, cfg, timed, beside)
    if cfg.onnx:
        if int8 is not None and int8_logits is None:   # a QAT model without a TFLite file
            int8_logits = tflite_logits(int8, x_val)[0]
        from tftrain.export import onnx_artifacts
        report.update(onnx_artifacts.entries(plain, out, x_val, y_val, reference, int8, int8_logits,
                                          qat, saved_logits, calibration, cfg, layers, timed))
    if not cfg.saved_model:   # it was only the conversion's source
        shutil.rmtree(saved)
        del report["saved_model"]
    for name in report.keys() & set(verification.FLOAT_ARTIFACTS):
        if not verification.logits_within(report[name], cfg):
            report[name]["logit_noise"] = noise()       # what its check may allow for
    return verification.verify(report, cfg, accuracy(reference, y_val), qat, by_labels,
                               untrained)


def _sparse_entry(saved: Path, plain, out: Path, x_val, y_val, reference, calibration, cfg,
                  timed: bool, beside) -> dict:
    """`model_sparse.tflite` (float, its pruned weights stored sparse) and its entry."""
    from tftrain.export import sparse

    blob = sparse.convert(saved)
    (out / "model_sparse.tflite").write_bytes(blob)
    entry = _tflite_entry(blob, plain, x_val, y_val, reference, False, calibration, cfg, timed,
                          beside)
    entry.pop("logits")
    return {**entry, **(sparse.report(blob, entry["xnnpack"]) if timed else {})}


def _float_tflite(plain, saved_model: Path, out: Path, qat: bool) -> bytes:
    """The float TFLite file of `plain` (from its SavedModel), only to be timed; of a
    quantization-aware trained model, its float function: saved with every quantizer
    passing its input through (`quantization.quantizers_bypassed`), no fake-quant op."""
    if not qat:
        return convert_tflite(saved_model, "float", None)
    from tftrain.compress import quantization
    return _converted_within(quantization.quantizers_bypassed(), plain,
                             out / "tflite_float_source", "float", None)


def _converted_within(patch, plain, source: Path, mode: str, calibration, **options) -> bytes:
    """`plain` converted to TFLite (`convert_tflite`) from a SavedModel written at `source`
    inside `patch` (a context replacing tfmot's quantizers' computation), then removed."""
    with patch:
        _write_saved_model(plain, source)
    try:
        return convert_tflite(source, mode, calibration, **options)
    finally:
        shutil.rmtree(source)


def _tflite_entry(blob: bytes, plain, x_val, y_val, reference, layers: bool, calibration,
                  cfg, timed: bool = True, beside: bytes | None = None,
                  precision: str = "int8") -> dict:
    """A TFLite file's report entry (its `logits` too, for the caller to take), `timed` (in
    turn with the float file `beside`), its `layers` compared as a file of `precision`."""
    from tftrain.export import speed

    logits, latency = tflite_logits(blob, x_val)
    entry = {**sizes(blob), "accuracy": accuracy(logits, y_val),
             **against(logits, reference),
             "latency_ms": latency * 1e3, "input": input_kind(plain, None), "logits": logits,
             **(speed.tflite_entry(blob, x_val, beside) if timed else {}),
             **(speed.versus_reference(blob, "tflite", x_val, cfg.latency_reference)
                if timed and cfg.latency_reference else {})}
    if layers:
        from tftrain.export import fidelity
        entry.update(fidelity.tflite_entry(blob, plain, calibration, cfg, precision))
    return entry


def _with_fallback(plain, out: Path, int8: bytes, entry: dict, x_val, y_val, reference,
                   calibration, cfg, beside: bytes | None) -> tuple[bytes, dict]:
    """`export.int8_fallback: auto` (`tftrain.export.fallback`)."""
    from tftrain.compress import quantization
    from tftrain.export import fallback

    def convert(wrappers) -> bytes:         # strict QDQ, those layers' kernels float
        return _converted_within(quantization.kernels_unquantized(wrappers), plain,
                                 out / "tflite_fallback", "int8", calibration, qat=True,
                                 strict=True)

    return fallback.within_budget(
        plain, int8, entry, convert, lambda b: accuracy(tflite_logits(b, x_val)[0], y_val),
        lambda b: _tflite_entry(b, plain, x_val, y_val, reference, True, calibration, cfg,
                                beside=beside),
        accuracy(reference, y_val), cfg)


def _int8_saved_model(model, path: Path, serving, raw, y_val, reference, qat: bool,
                      calibration: np.ndarray, cfg, layers_too: bool) -> dict:
    """Write the int8-kernel SavedModel (`tftrain.export.int8_saved_model`), load it back and
    evaluate it like the other artifacts, and compare it with `model` layer by layer."""
    from tftrain.export import fidelity, int8_saved_model

    quantized, layers = int8_saved_model.quantized_model(model, qat)
    _write_saved_model(quantized, path, serving)
    loaded = tf.saved_model.load(str(path)).signatures["serving_default"]
    logits = signature_logits(loaded, raw)
    zeros = [entry["zero_fraction"] for entry in layers.values()]
    return {**sizes(dir_bytes(path)),
            "variables_gzip_bytes": len(gzip.compress(dir_bytes(path / "variables"), 9)),
            "accuracy": accuracy(logits, y_val),
            **against(logits, reference),
            "latency_ms": signature_latency(loaded, raw) * 1e3,
            "kernels": "int8 codes x per-channel scale from " + (
                "the QAT ranges" if qat else "post-training weight-only quantization"),
            "int8_layers": len(layers),
            "folded_batch_norms": sum("folded" in e for e in layers.values()),
            "int8_zero_fraction": float(np.mean(zeros)) if zeros else 0.0,
            **(fidelity.saved_model_int8_entry(model, quantized, layers, calibration, cfg)
               if layers_too else {})}
