"""The conversions the export kinds (`kinds`) write their files with, and the runtimes
they run them back with.

The SavedModel has a `serving_default` signature taking `inputs` and returning float32
`logits` whatever the training precision. TFLite models are converted from that
SavedModel (`float`, `dynamic`, `float16`, or full-integer `int8` calibrated on training
examples) and run with LiteRT (`ai-edge-litert`). ONNX files (`tftrain.export.onnx_export`) run
with ONNX Runtime.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.export.calibration import own_ranges
from tftrain.export.measures import dir_bytes, gzip_size
from tftrain.core import internals
from tftrain.export import file_memory
from tftrain.export.file_tensors import set_example
from tftrain.compress import quantization
from tftrain.training.heap import older_objects_frozen

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


def save_saved_model(model, path: Path) -> Path:
    """SavedModel with a named serving signature returning float32 logits."""
    return write_saved_model(inference_model(model), path)


def write_saved_model(plain, path: Path, serving=None) -> Path:
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
        return gzip_size(dir_bytes(Path(tmp) / "variables"))


def convert_tflite(saved_model: Path, mode: str, calibration: np.ndarray,
                   qat: bool = False, strict: bool = False) -> bytes:
    """TFLite flatbuffer from a SavedModel in the given mode. A quantization-aware
    trained model (`qat`) converts to int8 with the ranges it learned: no calibration.
    `strict` (QAT): an op whose kernel has no fake-quant stays float, not requantized."""
    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
    if mode in ("dynamic", "float16", "int8"):
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if strict:
        internals.strict_qdq(converter)
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
        return convert(converter)


def convert(converter) -> bytes:
    """`converter.convert()`, its garbage collection limited to what it makes
    (`older_objects_frozen`)."""
    with older_objects_frozen():
        return converter.convert()


def tflite_logits(flatbuffer: bytes, x: np.ndarray, threads: int = 1) -> tuple[np.ndarray, float]:
    """Run a TFLite model with LiteRT on each example; (logits, seconds per example)."""
    from ai_edge_litert.interpreter import Interpreter


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
    tensor name (kernels, as stored: int8 in quantized models): those its ops read and
    none writes (an activation of static shape holds data too once allocated)."""
    interp = file_memory.own_ops(flatbuffer)
    interp.allocate_tensors()
    read = file_memory.constants(interp)
    return {detail["name"]: interp.get_tensor(detail["index"]).copy()
            for detail in interp.get_tensor_details()
            if detail["index"] in read and np.prod(detail["shape"]) >= min_size}


def float_tflite(plain, saved_model: Path, out: Path, qat: bool) -> bytes:
    """The float TFLite file of `plain` (from its SavedModel), only to be timed; of a
    quantization-aware trained model, its float function: saved with every quantizer
    passing its input through (`quantization.quantizers_bypassed`), no fake-quant op."""
    if not qat:
        return convert_tflite(saved_model, "float", None)
    return converted_within(quantization.quantizers_bypassed(), plain,
                             out / "tflite_float_source", "float", None)


def converted_within(patch, plain, source: Path, mode: str, calibration, **options) -> bytes:
    """`plain` converted to TFLite (`convert_tflite`) from a SavedModel written at `source`
    inside `patch` (a context replacing tfmot's quantizers' computation), then removed."""
    with patch:
        write_saved_model(plain, source)
    try:
        return convert_tflite(source, mode, calibration, **options)
    finally:
        shutil.rmtree(source)
