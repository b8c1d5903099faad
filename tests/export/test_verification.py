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
    # a QAT model's accuracy is its traced model's (`ExportContext.reference_accuracy`)
    assert verify({"tflite_int8": {"accuracy": 0.939}}, cfg, 0.95, qat=True)["tflite_int8"][
        "check"] == "accuracy 0.9390 vs 0.9500 traced: drop 0.0110 > export.max_accuracy_drop 0.01"
    within = verify({"tflite_int8": {"max_abs_logit_diff": 0.4, "accuracy": 0.94}}, cfg, 0.95)
    assert within["tflite_int8"]["verified"]                      # exactly one point: allowed
    # a QAT model's SavedModel is held, as a float artifact, to the model traced as the
    # SavedModel runs it (`measures.against_traced`): one 8-bit step apart is a fault there
    for qat in (True, False):
        for by_labels in (True, False):
            step = verify({"saved_model": {"max_abs_logit_diff": 0.044, "accuracy": 0.95}}, cfg,
                          0.95, qat=qat, by_labels=by_labels)["saved_model"]
            assert not step["verified"] and step["check"] == (
                "largest logit difference 0.044 > export.max_logit_diff 0.001")
            assert verify({"saved_model": {"max_abs_logit_diff": 1e-6, "accuracy": 0.5}}, cfg,
                          0.95, qat=qat, by_labels=by_labels)["saved_model"]["verified"]


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


def test_without_labels_an_int8_file_compared_layer_by_layer_is_judged_by_its_noisiest_layer():
    """A smoke-trained deep model amplifies rounding: a QAT MobileNetV2's int8 layers each
    add noise 45-57 dB down and its logits end 6.3 dB above their difference. Judged by
    its layers it passes; one layer 8x off fails it, QAT model or not; without a layer
    comparison a QAT model's file is held to `export.min_layer_sqnr` at its logits."""
    cfg = load_config(None, []).export
    amplified = {"logit_sqnr_db": 6.3, "top1_agreement": 0.6, "logit_spread": 1.0,
                 "max_abs_logit_diff": 0.5, "accuracy": 0.1}
    layers = [{"layer": f"quant_block_{i}", "local_sqnr_db": 45.8 + i} for i in range(16)]
    x8 = [*layers[:5], {"layer": "quant_block_5", "local_sqnr_db": -16.0}, *layers[6:]]
    for qat in (True, False):
        ok = verify({"tflite_int8": {**amplified, "layers": layers}}, cfg, 0.1, qat=qat,
                    by_labels=False)["tflite_int8"]
        assert ok["verified"], ok["check"]
        assert ok["check"].startswith("the noisiest layer, quant_block_0, adds noise 45.8 dB "
                                      "below its values >= export.min_layer_sqnr 20")
        bad = verify({"tflite_int8": {**amplified, "layers": x8}}, cfg, 0.1, qat=qat,
                     by_labels=False)["tflite_int8"]
        assert not bad["verified"] and "quant_block_5, adds noise -16.0 dB" in bad["check"]
    bare = verify({"tflite_int8": dict(amplified)}, cfg, 0.1, qat=True, by_labels=False)
    assert not bare["tflite_int8"]["verified"]
    assert "6.3 dB above their difference from the QAT model's < export.min_layer_sqnr 20" in \
        bare["tflite_int8"]["check"]
    assert verify({"tflite_int8": {**amplified, "logit_sqnr_db": 39.0}}, cfg, 0.1, qat=True,
                  by_labels=False)["tflite_int8"]["verified"]


def test_a_layer_above_the_floor_fails_when_far_beyond_what_its_8_bit_steps_allow():
    """Above `export.min_layer_sqnr`, a layer still fails when it adds noise more than
    `layer_noise.LEEWAY_DB` beyond what its own 8-bit steps allow; within it, it passes.
    Below the floor a layer fails unless it is rounding-limited: as noisy as its steps
    allow, with a range its values fill."""
    cfg = load_config(None, []).export
    entry = {"logit_sqnr_db": 15.0, "top1_agreement": 0.9, "logit_spread": 1.0,
             "max_abs_logit_diff": 0.5, "accuracy": 0.1}
    fine = {"layer": "conv", "local_sqnr_db": 40.0, "allowed_sqnr_db": 42.0}

    def judged(row):
        return verify({"tflite_int8": {**entry, "layers": [fine, row]}}, cfg, 0.1,
                      by_labels=False)["tflite_int8"]
    far = judged({"layer": "dense", "local_sqnr_db": 30.0, "allowed_sqnr_db": 45.0})
    assert not far["verified"]
    assert far["check"].startswith("the noisiest failing layer, dense, adds noise 30.0 dB below "
                                   "its values >= export.min_layer_sqnr 20, beyond 10 dB of the "
                                   "45.0 dB its own 8-bit steps allow"), far["check"]
    near = judged({"layer": "dense", "local_sqnr_db": 30.0, "allowed_sqnr_db": 38.0})
    assert near["verified"] and "within 10 dB of the 38.0 dB" in near["check"], near["check"]
    low = judged({"layer": "dense", "local_sqnr_db": 18.0, "allowed_sqnr_db": 19.0})
    assert not low["verified"] and "18.0 dB below its values < export.min_layer_sqnr" in low["check"]
    assert "reach 0% of its 8-bit range's end (below 50%" in low["check"]
    # below the floor, as its own steps allow, with a range its values fill: a gate whose
    # input range was calibrated on a few large values (an untrained squeeze-excite's)
    gate = {"layer": "gate", "local_sqnr_db": 2.8, "allowed_sqnr_db": 3.1}
    limited = judged({**gate, "range_fill": 0.9})
    assert limited["verified"], limited["check"]
    assert "rounding-limited" in limited["check"] and "reach 90%" in limited["check"]
    wide = judged({**gate, "range_fill": 0.12})           # a range 8x wider than its values
    assert not wide["verified"] and "the range is wider than its values" in wide["check"]


def test_a_float_artifact_is_held_to_the_logit_difference_relative_to_the_largest_logit():
    """float32 rounds relative to a value's size: logits up to 400 (an untrained
    EfficientNetV2B0) may differ by 400 x 1e-3; 0.41 is one part in a thousand too many,
    and logits below 1 keep the absolute limit."""
    cfg = load_config(None, ["export.max_logit_diff=1e-3"]).export
    report = verify({"saved_model": {"max_abs_logit_diff": 0.0069, "logit_scale": 400.0},
                     "tflite_float": {"max_abs_logit_diff": 0.41, "logit_scale": 400.0},
                     "onnx": {"max_abs_logit_diff": 2e-3, "logit_scale": 0.5}}, cfg, 0.95)
    assert [name for name, e in report.items() if e["verified"]] == ["saved_model"]
    assert report["tflite_float"]["check"] == ("largest logit difference 0.41 > export.max_logit_diff "
                                               "0.001 x the largest logit 400")
    assert report["onnx"]["check"] == "largest logit difference 0.002 > export.max_logit_diff 0.001"


def test_a_float_file_whose_logits_are_apart_is_judged_by_its_layers():
    """Logits apart by more than float rounding at the logits: verified only when no layer
    adds noise above float rounding (the network amplified it), failed when one does (a
    layer converted to something else), failed without layers to judge by."""
    from tftrain.export.verification import FLOAT_LAYER_SQNR_DB
    cfg = load_config(None, ["export.max_logit_diff=1e-3"]).export
    apart = {"max_abs_logit_diff": 0.053, "logit_scale": 35.5}
    exact = [{"layer": "stem_conv", "local_sqnr_db": 99.0}, {"layer": "top_bn", "local_sqnr_db": 99.0}]
    broken = [{"layer": "stem_conv", "local_sqnr_db": 99.0}, {"layer": "top_bn", "local_sqnr_db": 12.0}]
    report = verify({"tflite_float": {**apart, "layers": exact}, "onnx": {**apart, "layers": broken},
                     "saved_model": dict(apart)}, cfg, 0.95)
    assert report["tflite_float"]["verified"] and not report["onnx"]["verified"]
    assert not report["saved_model"]["verified"]
    assert report["tflite_float"]["check"].endswith(
        "layer by layer the noisiest, stem_conv, adds noise 99.0 dB below its values >= 60 dB "
        "(float rounding, amplified by the network)")
    assert report["onnx"]["check"].endswith(f"top_bn, adds noise 12.0 dB below its values < "
                                            f"{FLOAT_LAYER_SQNR_DB:g} dB")


def test_a_float_artifact_may_be_as_far_apart_as_the_models_own_logit_noise_allows():
    """A model whose logits move by 0.005 when its input moves by float rounding (an
    untrained EfficientNetV2B0's SavedModel was 0.045 apart on logits up to 40): a float
    artifact within 10 x that passes and says why; one beyond it fails."""
    cfg = load_config(None, ["export.max_logit_diff=1e-3"]).export
    report = verify({"saved_model": {"max_abs_logit_diff": 0.045, "logit_scale": 40.3,
                                     "logit_noise": 0.005},
                     "onnx": {"max_abs_logit_diff": 0.06, "logit_scale": 40.3, "logit_noise": 0.005}},
                    cfg, 0.95)
    assert report["saved_model"]["verified"] and not report["onnx"]["verified"]
    assert report["saved_model"]["check"] == (
        "largest logit difference 0.045 <= 0.05, 10 x the model's own logit noise (its logits "
        "moved by 0.005 under input rounding)")


def test_flat_logits_pass_unjudged_only_in_the_preflight_and_an_empty_comparison_fails():
    """Logits without signal (spread 1e-6) and a layer at -30 dB: the preflight's
    untrained model passes unjudged (it is judged again at the run's end); after training
    the same file is not verified, and says why. An int8 file compared layer by layer
    with no layer found fails too (it passed on its logits' 0 dB floor)."""
    cfg = load_config(None, []).export
    flat = {"logit_sqnr_db": 1.0, "top1_agreement": 0.3, "logit_spread": 1e-6,
            "max_abs_logit_diff": 1e-6, "accuracy": 0.1,
            "layers": [{"layer": "conv", "local_sqnr_db": -30.0}]}
    pre = verify({"onnx_int8": dict(flat)}, cfg, 0.1, by_labels=False, untrained=True)
    assert pre["onnx_int8"]["verified"]
    assert pre["onnx_int8"]["check"].endswith("judged again at the run's end")
    after = verify({"onnx_int8": dict(flat)}, cfg, 0.1, by_labels=False)["onnx_int8"]
    assert not after["verified"]
    assert after["check"].startswith("not judged: the model's logits carry no signal to compare "
                                     "(they spread 1.0e-06 across classes")
    assert "after training this file cannot be told from a broken one" in after["check"]
    empty = {"logit_sqnr_db": 1.0, "top1_agreement": 0.5, "logit_spread": 1.0,
             "max_abs_logit_diff": 0.5, "accuracy": 0.1, "layers": []}
    bad = verify({"tflite_int8": empty}, cfg, 0.1, by_labels=False)["tflite_int8"]
    assert not bad["verified"]
    assert bad["check"].startswith("compared layer by layer, but none of the model's layers "
                                   "was found in the file")
    # without a layer comparison at all: after training not verified; in the preflight,
    # on an untrained model, the logits' floor decides and the run's end judges again
    bare = {k: v for k, v in empty.items() if k != "layers"}
    assert not verify({"tflite_int8": dict(bare)}, cfg, 0.1, by_labels=False)["tflite_int8"][
        "verified"]
    assert verify({"tflite_int8": dict(bare)}, cfg, 0.1, by_labels=False,
                  untrained=True)["tflite_int8"]["verified"]


def test_without_labels_every_reduced_precision_file_passes_only_on_its_layers():
    """A dynamic-range file at 0.5 dB and a float16 file at 10.5 dB at their logits,
    without a layer comparison: not verified after training, saying why. Compared layer by
    layer, each precision has its own floor: a layer adding noise 45 dB down passes in a
    dynamic-range file and fails in a float16 one (float16 rounds 8 bits finer)."""
    cfg = load_config(None, []).export
    base = {"top1_agreement": 0.3, "logit_spread": 1.0, "max_abs_logit_diff": 0.9,
            "accuracy": 0.1}
    report = verify({"tflite_dynamic": {**base, "logit_sqnr_db": 0.5},
                     "tflite_float16": {**base, "logit_sqnr_db": 10.5}}, cfg, 0.1,
                    by_labels=False)
    for name in ("tflite_dynamic", "tflite_float16"):
        assert not report[name]["verified"]
        assert report[name]["check"].startswith("not compared layer by layer: without labels "
                                                "to judge it by, nothing shows it computes"), name
    layers = [{"layer": "conv", "local_sqnr_db": 70.0}, {"layer": "dense", "local_sqnr_db": 45.0}]
    judged = verify({"tflite_dynamic": {**base, "logit_sqnr_db": 0.5, "layers": layers},
                     "tflite_float16": {**base, "logit_sqnr_db": 10.5, "layers": layers}}, cfg,
                    0.1, by_labels=False)
    assert judged["tflite_dynamic"]["verified"], judged["tflite_dynamic"]["check"]
    assert not judged["tflite_float16"]["verified"]
    assert judged["tflite_float16"]["check"].startswith(
        "the noisiest failing layer, dense, adds noise 45.0 dB below its values < float16's "
        "layer floor 50")


def test_a_float_file_of_a_model_that_amplifies_rounding_past_its_logits_is_not_verified_by_them():
    """An untrained EfficientNetV2M at 32 x 32: its logits move by 447 under float32
    input rounding on a largest logit of 326, so 10 times that noise allows any file. Not
    verified at its logits, saying why; compared layer by layer within float rounding
    (a float TFLite file), verified."""
    cfg = load_config(None, []).export
    chaotic = {"max_abs_logit_diff": 401.0, "logit_scale": 325.7, "logit_noise": 447.1,
               "accuracy": 0.1}
    found = verify({"saved_model": dict(chaotic)}, cfg, 0.1)["saved_model"]
    assert not found["verified"]
    assert "which is as large as the largest logit 326: the model amplifies float32 rounding " \
           "past its signal" in found["check"], found["check"]
    layered = verify({"tflite_float": {**chaotic, "layers": [
        {"layer": "conv", "local_sqnr_db": 99.0}, {"layer": "dense", "local_sqnr_db": 71.0}]}},
        cfg, 0.1)["tflite_float"]
    assert layered["verified"] and "layer by layer the noisiest, dense" in layered["check"]
    tame = verify({"saved_model": {**chaotic, "logit_noise": 3.0, "max_abs_logit_diff": 20.0}},
                  cfg, 0.1)["saved_model"]
    assert tame["verified"], tame["check"]


def test_a_partial_comparison_fails_naming_the_layers_it_missed():
    """Layers with weights that the per-layer comparison could not find in the file
    (`fidelity.uncompared`): an int8 file without labels and a float file judged by its
    layers are not verified, and the check names the layers (at most five, then ...)."""
    cfg = load_config(None, []).export
    fine = [{"layer": "relu_0", "local_sqnr_db": 45.0}]
    missed = [f"conv_{i}" for i in range(7)]
    base = {"logit_sqnr_db": 30.0, "top1_agreement": 1.0, "logit_spread": 1.0,
            "max_abs_logit_diff": 0.1, "accuracy": 0.9, "layers": fine}
    whole = verify({"tflite_int8": dict(base)}, cfg, 0.9, by_labels=False)["tflite_int8"]
    assert whole["verified"], whole["check"]
    part = verify({"tflite_int8": {**base, "uncompared": missed[:2]}}, cfg, 0.9,
                  by_labels=False)["tflite_int8"]
    assert not part["verified"]
    assert part["check"].startswith("compared layer by layer, but 2 of the model's layers with "
                                    "weights have no counterpart in the file (conv_0, conv_1): "
                                    "nothing shows it computes them")
    many = verify({"onnx_int8": {**base, "uncompared": missed}}, cfg, 0.9,
                  by_labels=False)["onnx_int8"]
    assert "7 of the model's layers" in many["check"] and \
        "(conv_0, conv_1, conv_2, conv_3, conv_4, ...)" in many["check"]
    apart = {"max_abs_logit_diff": 5.0, "logit_scale": 10.0, "layers": [
        {"layer": "relu_0", "local_sqnr_db": 99.0}], "uncompared": ["logits"]}
    floating = verify({"tflite_float": apart}, cfg, 0.9)["tflite_float"]
    assert not floating["verified"] and floating["check"].endswith(
        "1 of the model's layers with weights have no counterpart in the file (logits): "
        "nothing shows it computes them")
