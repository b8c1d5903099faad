"""The artifacts a config's `export` section asks for, named once: the plan (`--dry-run`)
and the run's export phase print this list. Importable without TensorFlow."""
from __future__ import annotations


def titles(e) -> list[str]:
    """The artifacts `e` (an `ExportConfig`) makes, as the plan and the console name them,
    in the order they are made."""
    return [title for title, wanted in (
        ("SavedModel", e.saved_model),
        ("int8 SavedModel", e.saved_model_int8),
        (f"TFLite {e.tflite}", e.tflite != "none"),
        ("sparse TFLite", e.tflite_sparse),
        ("ONNX", e.onnx)) if wanted]
