"""The ONNX artifacts of a run: `model.onnx` (float) and `model_int8.onnx` (QDQ, from the
int8 TFLite file), each written, run with ONNX Runtime on the validation set, timed and,
for int8, compared with the model layer by layer (`onnx_export` converts)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tftrain.export.onnx_export import (INT8_SESSION_CONFIG, float_onnx, float_ops, int8_format,
                                        int8_kernels, int8_onnx, latency, logits,
                                        optimized_graph, session)


def entries(plain, out: Path, x_val, y_val, reference, int8: bytes | None, int8_logits,
          qat: bool, saved_model_logits, calibration, cfg, layers: bool, timed: bool) -> dict:
    """`model.onnx` (float32; not for a QAT model, whose float graph holds fake-quant
    ops) and, where there is an int8 TFLite model, `model_int8.onnx` (QDQ); each run with
    ONNX Runtime on the validation set."""
    from tftrain.export import speed
    from tftrain.export.errors import making
    from tftrain.export.measures import accuracy, against, input_kind, sizes

    found = {}
    layout = int8_format() if cfg.onnx_int8_layout == "auto" else cfg.onnx_int8_layout
    files = ([] if qat else [("onnx", "model.onnx", lambda: float_onnx(plain), False)]) \
        + ([] if int8 is None else [("onnx_int8", "model_int8.onnx",
                                     lambda: int8_onnx(int8, layout), True)])
    for name, filename, convert, quantized in files:
        with making(name):
            blob = convert()
            (out / filename).write_bytes(blob)
            sess = session(blob, int8=quantized)
            out_logits = logits(sess, x_val)
            entry = found[name] = {
                **sizes(blob), "accuracy": accuracy(out_logits, y_val),
                **against(out_logits, reference),
                "max_abs_diff_vs_saved_model": float(np.max(np.abs(out_logits - saved_model_logits))),
                "latency_ms": latency(sess, x_val) * 1e3, "input": input_kind(plain, None),
                **({"latency_grid": speed.onnx_grid(blob, x_val, quantized)} if timed else {}),
                **(speed.versus_reference(blob, "onnx", x_val, cfg.latency_reference, quantized)
                   if timed and cfg.latency_reference else {})}
            if quantized:
                entry["max_abs_diff_vs_tflite_int8"] = float(np.max(np.abs(out_logits - int8_logits)))
                graph = optimized_graph(blob)
                entry.update(int8_kernels=int8_kernels(graph),
                             session_config=dict(INT8_SESSION_CONFIG), layout=layout)
                if layers:
                    from tftrain.export import onnx_fidelity
                    entry.update(onnx_fidelity.entry(blob, float_ops(graph), plain, calibration,
                                                     cfg))
    return found
