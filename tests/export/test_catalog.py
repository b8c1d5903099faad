"""The artifacts a config asks for, named once for the plan and the export phase."""
from tftrain.config import load_config
from tftrain.export.catalog import titles


def test_the_plan_and_the_export_phase_name_the_same_artifacts_in_order():
    every = load_config(None, ["export.saved_model=true", "export.saved_model_int8=true",
                               "export.tflite=int8", "export.tflite_sparse=true",
                               "export.onnx=true"]).export
    assert titles(every) == ["SavedModel", "int8 SavedModel", "TFLite int8", "sparse TFLite", "ONNX"]
    none = load_config(None, ["export.saved_model=false", "export.tflite=none"]).export
    assert titles(none) == []
