"""Whether each exported artifact is what the model computes: float artifacts give its
logits within `export.max_logit_diff`, reduced-precision ones its accuracy within
`export.max_accuracy_drop`. A failed check leaves the artifact written and marked."""
from __future__ import annotations

FLOAT_ARTIFACTS = ("saved_model", "tflite_float", "tflite_sparse", "onnx")


def verify(report: dict, cfg, accuracy: float, qat: bool = False) -> dict:
    """Mark each artifact verified or failed: float artifacts must give the in-memory
    model's logits within `export.max_logit_diff`; reduced-precision ones (dynamic,
    float16, int8) its accuracy within `export.max_accuracy_drop`. The SavedModel of a
    quantization-aware trained model (`qat`) holds its fake-quant ops: where the traced
    graph rounds a float differently from the eager model (a fused or reordered sum,
    1e-7 apart), a value on a rounding edge moves one 8-bit step, and so may the logits
    after it; it is checked as the 8-bit model it is, by accuracy."""
    exact = tuple(n for n in FLOAT_ARTIFACTS if not (qat and n == "saved_model"))
    for name, entry in report.items():
        if name in exact:
            ok = entry["max_abs_logit_diff"] <= cfg.max_logit_diff
            entry["check"] = (f"largest logit difference {entry['max_abs_logit_diff']:.2g} "
                              f"{'<=' if ok else '>'} export.max_logit_diff {cfg.max_logit_diff:g}")
        else:
            drop = accuracy - entry["accuracy"]
            ok = drop <= cfg.max_accuracy_drop + 1e-9
            entry["check"] = (f"accuracy {entry['accuracy']:.4f} vs {accuracy:.4f} in memory: "
                              f"drop {drop:.4f} {'<=' if ok else '>'} export.max_accuracy_drop "
                              f"{cfg.max_accuracy_drop:g}")
        entry["verified"] = ok
    return report


def failures(report: dict) -> list[str]:
    """One line per artifact that failed its check."""
    return [f"{name}: {entry['check']}" for name, entry in report.items()
            if not entry.get("verified", True)]
