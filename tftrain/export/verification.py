"""Whether each exported artifact is what the model computes: float artifacts give its
logits within `export.max_logit_diff`; reduced-precision ones its accuracy within
`export.max_accuracy_drop` or, where accuracy says nothing (the export preflight's
untrained model, a `--smoke` run's few updates), its logits to within the noise their
precision adds. A failed check leaves the artifact written and marked."""
from __future__ import annotations

FLOAT_ARTIFACTS = ("saved_model", "tflite_float", "tflite_sparse", "onnx")

# The least signal-to-noise ratio (dB) of a reduced-precision artifact's logits against
# the model it came from. A b-bit quantizer over a full-range tensor adds noise 6.02 b +
# 1.76 dB below it (49.9 dB at 8 bits; 68 dB for float16's 11-bit significand); the floors
# leave about 35 dB and 28 dB for tensors that use part of their range and for noise
# accumulated over layers. Measured on --smoke models (float32, 3 updates): int8 24-53 dB
# (an embedding bag 24, a ResNet-8 30, a QAT CNN 53), dynamic 40-43 dB, float16 57-72 dB;
# a layer whose int8 scale is 8x off gives about -10 dB.
SQNR_FLOOR_DB = {"int8": 15.0, "dynamic": 15.0, "float16": 40.0}


def precision_of(name: str, qat: bool) -> str:
    """The precision an artifact computes in (`float`, `int8`, `dynamic`, `float16`)."""
    if name == "saved_model" and qat:
        return "int8"                 # its fake-quant ops round every activation to 8 bits
    if name in FLOAT_ARTIFACTS:
        return "float"
    if name in ("tflite_dynamic", "tflite_float16"):
        return name.split("_")[1]
    return "int8"


def verify(report: dict, cfg, accuracy: float, qat: bool = False, by_labels: bool = True) -> dict:
    """Mark each artifact verified or failed: float artifacts must give the in-memory
    model's logits within `export.max_logit_diff`; reduced-precision ones (dynamic,
    float16, int8) its accuracy within `export.max_accuracy_drop` or, without
    `by_labels` (a model whose accuracy is noise), logits no noisier than their
    precision's floor (`SQNR_FLOOR_DB`). The SavedModel of a quantization-aware trained
    model (`qat`) holds its fake-quant ops: where the traced graph rounds a float
    differently from the eager model (a fused or reordered sum, 1e-7 apart), a value on a
    rounding edge moves one 8-bit step, and so may the logits after it; it is checked as
    the 8-bit model it is."""
    for name, entry in report.items():
        precision = precision_of(name, qat)
        if precision == "float":
            ok = entry["max_abs_logit_diff"] <= cfg.max_logit_diff
            entry["check"] = (f"largest logit difference {entry['max_abs_logit_diff']:.2g} "
                              f"{'<=' if ok else '>'} export.max_logit_diff {cfg.max_logit_diff:g}")
        elif by_labels:
            drop = accuracy - entry["accuracy"]
            ok = drop <= cfg.max_accuracy_drop + 1e-9
            entry["check"] = (f"accuracy {entry['accuracy']:.4f} vs {accuracy:.4f} in memory: "
                              f"drop {drop:.4f} {'<=' if ok else '>'} export.max_accuracy_drop "
                              f"{cfg.max_accuracy_drop:g}")
        else:
            floor, sqnr = SQNR_FLOOR_DB[precision], entry["logit_sqnr_db"]
            ok = sqnr >= floor
            entry["check"] = (f"logits {sqnr:.1f} dB above their difference from the model's "
                              f"{'>=' if ok else '<'} {floor:g} dB ({precision}; top-1 agrees "
                              f"on {entry['top1_agreement']:.1%}; accuracy is not judged: "
                              "the model is untrained or smoke-trained)")
        entry["verified"] = ok
    return report


def failures(report: dict) -> list[str]:
    """One line per artifact that failed its check."""
    return [f"{name}: {entry['check']}" for name, entry in report.items()
            if not entry.get("verified", True)]
