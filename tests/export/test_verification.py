"""Export verification: float artifacts by their logits, reduced-precision ones by accuracy."""
from tftrain.config import load_config
from tftrain.export.verification import failures, verify


def test_verification_has_teeth():
    cfg = load_config(None, ["export.max_logit_diff=1e-3", "export.max_accuracy_drop=0.01"]).export
    report = verify({"saved_model": {"max_abs_logit_diff": 2e-3, "accuracy": 0.95},
                     "tflite_float": {"max_abs_logit_diff": 1e-3, "accuracy": 0.95},
                     "tflite_int8": {"max_abs_logit_diff": 0.4, "accuracy": 0.939}}, cfg, 0.95)
    assert [name for name, e in report.items() if e["verified"]] == ["tflite_float"]
    assert report["saved_model"]["check"] == ("largest logit difference 0.002 > "
                                              "export.max_logit_diff 0.001")
    assert report["tflite_int8"]["check"] == ("accuracy 0.9390 vs 0.9500 in memory: drop 0.0110 "
                                              "> export.max_accuracy_drop 0.01")
    assert failures(report) == [f"{n}: {report[n]['check']}" for n in ("saved_model", "tflite_int8")]
    within = verify({"tflite_int8": {"max_abs_logit_diff": 0.4, "accuracy": 0.94}}, cfg, 0.95)
    assert within["tflite_int8"]["verified"]                      # exactly one point: allowed
    # a QAT model's SavedModel holds fake-quant ops: one 8-bit step apart is no failure,
    # an accuracy drop is
    qat = verify({"saved_model": {"max_abs_logit_diff": 0.044, "accuracy": 0.95}}, cfg, 0.95,
                 qat=True)
    assert qat["saved_model"]["verified"] and qat["saved_model"]["check"].startswith("accuracy")
    assert not verify({"saved_model": {"max_abs_logit_diff": 0.044, "accuracy": 0.93}}, cfg,
                      0.95, qat=True)["saved_model"]["verified"]
