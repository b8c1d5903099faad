"""`export.tflite_sparse`: a float TFLite file whose pruned weights are stored sparse
(TFLite's EXPERIMENTAL_SPARSITY encoding: DENSIFY ops), for XNNPack's sparse inference.

XNNPack runs a sparse subgraph only when the model follows its rules
(tensorflow/lite/delegates/xnnpack/README.md, "Sparse Inference"); `refusal` checks them
on the Keras model at plan time and names the first that fails. Whether the sparse path
then runs also depends on the CPU: XNNPack's sparse kernels on x86 target SSE only, and
on a CPU with AVX it runs dense (`xnn_is_chw_compatible_config`), so `sparse_path` says
which it does here.
"""
from __future__ import annotations

from pathlib import Path

from tftrain.core import internals

RULES = "XNNPack's sparse inference (tensorflow/lite/delegates/xnnpack/README.md)"
ZEROS = 2 / 3          # of the 1x1 convolutions' weights, across the sparse subgraph
_ELEMENTWISE = ("InputLayer", "ReLU", "Activation", "BatchNormalization", "Dropout", "Add",
                "Multiply", "Preprocess", "Rescaling")


def _same_is_symmetric(size, kernel: int, stride: int) -> bool:
    """Whether TensorFlow's SAME padding pads both sides of an axis of `size` equally."""
    if size is None:
        return False
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total % 2 == 0


def refusal(model, pruning) -> str | None:
    """Why `model` (with `pruning`, the compression.pruning config) cannot run XNNPack's
    sparse path: the rule it breaks, or None."""
    if not (pruning.enabled and pruning.structure == "unstructured"
            and pruning.final_sparsity >= ZEROS - 1e-9):
        return (f"{RULES} needs at least 2/3 of the 1x1 convolutions' weights zero: enable "
                "compression.pruning (structure: unstructured) with final_sparsity >= 0.67")
    compute = [l for l in model.layers if type(l).__name__ not in _ELEMENTWISE]
    if not compute:
        return f"{RULES} needs convolutions; the model has none"
    first = compute[0]
    shape = first.input_shape
    if not (type(first).__name__ == "Conv2D" and first.kernel_size == (3, 3)
            and first.strides == (2, 2) and first.dilation_rate == (1, 1)
            and shape[-1] == 3 and first.padding == "same"
            and all(_same_is_symmetric(s, 3, 2) for s in shape[1:3])):
        return (f"{RULES} needs the model to start with a 3x3 stride-2 Conv2D over 3 "
                "channels padded 1 on each side (padding 'same' on an odd height and width); "
                f"it starts with {first.name} ({type(first).__name__}"
                + (f" {first.kernel_size} stride {first.strides} over {shape[-1]} channels, "
                   f"input {shape[1]}x{shape[2]}" if hasattr(first, "kernel_size") else "")
                + ")")
    for layer in compute[1:]:
        kind = type(layer).__name__
        if kind in ("GlobalAveragePooling2D",):
            return None
        if kind == "Conv2D" and layer.kernel_size == (1, 1) and layer.strides == (1, 1):
            continue
        if kind == "DepthwiseConv2D" and layer.kernel_size in ((3, 3), (5, 5)) \
                and layer.dilation_rate == (1, 1) and layer.padding == "same" \
                and layer.depth_multiplier == 1 and all(
                    _same_is_symmetric(s, layer.kernel_size[0], layer.strides[0])
                    for s in layer.input_shape[1:3]) and layer.strides in ((1, 1), (2, 2)):
            continue
        return (f"{RULES} allows only 1x1 stride-1 Conv2D, 3x3 or 5x5 DepthwiseConv2D "
                "(stride 1 or 2, padded equally on each side), batch norm, ReLU-like "
                f"activations, add and multiply before a global average pool; "
                f"{layer.name} ({kind}) is none of them")
    return f"{RULES} needs the sparse subgraph to end in a global average pool; the model has none"


def convert(saved_model: Path) -> bytes:
    """The float TFLite file with its sparse weights encoded (DENSIFY ops)."""
    import tensorflow as tf

    from tftrain.export.artifacts import convert as converted

    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
    converter.optimizations = [tf.lite.Optimize.EXPERIMENTAL_SPARSITY]
    return converted(converter)


def cpu_runs_sparse(flags: str | None = None) -> tuple[bool, str]:
    """(whether XNNPack's sparse kernels run on this CPU, why)."""
    import platform

    if flags is None:
        from tftrain.core.cpu import cpu_flags
        flags = cpu_flags()
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    if x86 and " avx" in flags:
        return False, ("this x86 CPU has AVX: XNNPack's sparse kernels target SSE only and "
                       "it runs dense inference here (faster with AVX); on ARM the sparse "
                       "path runs")
    return True, "XNNPack runs sparse inference on this CPU"


def report(blob: bytes, ops: dict) -> dict:
    """What the sparse file holds and whether XNNPack's sparse path runs it here (`ops`:
    its `speed.xnnpack` entry)."""
    densify = _densify_count(blob)
    runs, why = cpu_runs_sparse()
    ran = bool(densify) and runs and not any(f.startswith("DENSIFY") for f in ops["fallback"])
    return {"sparse_tensors": densify, "sparse_path": ran,
            "sparse_path_reason": why if densify else "no weight was stored sparse"}


def _densify_count(blob: bytes) -> int:
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_content=blob, num_threads=1)
    return sum(op["op_name"] == "DENSIFY" for op in internals.ops_details(interp))

