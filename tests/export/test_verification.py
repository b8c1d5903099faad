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


def test_a_file_that_only_loses_too_much_accuracy_is_a_budget_missed_with_something_to_ship():
    from tftrain.export.verification import best_within_budget, only_budget_missed

    cfg = load_config(None, ["export.max_accuracy_drop=0.01"]).export

    def report(float_diff=1e-5):
        grid = lambda ms: {"latency_grid": {"batch1_threads1": ms}}  # noqa: E731
        return verify({
            "saved_model": {"max_abs_logit_diff": 1e-5, "accuracy": 0.95, "size_bytes": 900},
            "tflite_float": {"max_abs_logit_diff": float_diff, "accuracy": 0.95,
                             "size_bytes": 400, **grid(0.2)},
            "tflite_float16": {"max_abs_logit_diff": 0.01, "accuracy": 0.949,
                               "size_bytes": 200, **grid(0.3)},
            "tflite_int8": {"max_abs_logit_diff": 0.4, "accuracy": 0.93, "size_bytes": 100,
                            **grid(0.1)}}, cfg, 0.95)
    missed = report()
    assert not missed["tflite_int8"]["verified"] and only_budget_missed(missed)
    assert best_within_budget(missed) == "tflite_float16"          # the smallest verified
    # a float file computing something else is a fault, not a budget missed
    broken = report(float_diff=0.5)
    assert not only_budget_missed(broken)
    assert not only_budget_missed(verify({"tflite_int8": {"max_abs_logit_diff": 0.0,
                                                          "accuracy": 0.95}}, cfg, 0.95))
    # judged without labels (a smoke run), a failure is never a budget missed
    smoke = verify({"tflite_int8": {"max_abs_logit_diff": 0.4, "accuracy": 0.1, "logit_sqnr_db": -16.0,
                                    "top1_agreement": 0.2, "logit_spread": 1.0}}, cfg, 0.95,
                   by_labels=False)
    assert not smoke["tflite_int8"]["verified"] and not only_budget_missed(smoke)
    assert best_within_budget({"tflite_int8": {"verified": False, "size_bytes": 1}}) is None
