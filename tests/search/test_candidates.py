"""The search's candidates: names, files, configs, predictions, the order they are tried
in and what Optuna proposes after them."""
from __future__ import annotations

import pytest
import yaml

from tftrain.config import dump_config, load_config
from tftrain.config.loading import validate
from tftrain.search import candidates as cands
from tftrain.search.candidates import Candidate

from helpers import QUICKSTART


def target(*sets):
    """A target with fine-tuning lengths set (a search resolves unset ones: `resolved`)."""
    sets = ("fine_tune_epochs=2", "qat_epochs=1", *sets)
    return load_config(None, [f"compression.target.{s}" for s in sets]).compression.target


def test_unset_fine_tuning_lengths_come_from_the_run_s_config():
    from tftrain.search.runner import resolved
    assert (lambda t: (t.fine_tune_epochs, t.qat_epochs))(resolved(load_config(QUICKSTART))) == (7, 2)
    pruned = load_config(QUICKSTART, ["compression.pruning={enabled: true, epochs: 5}",
                                      "compression.quantization={enabled: true, epochs: 3}",
                                      "export.tflite=int8"])
    assert (resolved(pruned).fine_tune_epochs, resolved(pruned).qat_epochs) == (5, 3)
    given = load_config(QUICKSTART, ["compression.target.fine_tune_epochs=1"])
    assert resolved(given).fine_tune_epochs == 1


def test_names_and_the_file_each_deploys():
    assert cands.DENSE.name == "float" and cands.DENSE.reference
    qat = Candidate("qat", channels=0.35)
    assert qat.name == "channels35-qat" and not qat.reference
    assert qat.artifact("tflite") == "tflite_int8" and qat.artifact("onnx") == "onnx_int8"
    assert Candidate("float16").artifact("tflite") == "tflite_float16"
    assert Candidate("float", sparsity=0.5).name == "sparse50-float"
    assert Candidate("float").artifact("onnx") == "onnx"
    assert cands.from_dict(qat.as_dict()) == qat
    assert qat.as_dict() == {"precision": "qat", "channels": 0.35, "origin": "list"}


def test_a_candidate_s_config_changes_compression_and_export_only_and_validates(tmp_path):
    base = yaml.safe_load(dump_config(load_config(QUICKSTART)))
    t = target("fine_tune_epochs=3", "qat_epochs=2", "max_accuracy_drop=0.02")
    config = Candidate("qat", channels=0.5).config(base, t, str(tmp_path / "dense.tflite"))
    assert config["compression"]["pruning"] == {"enabled": True, "structure": "channels",
                                                "target_flops": 0.5, "epochs": 3,
                                                "importance": "auto", "distill": True}
    assert config["compression"]["quantization"]["enabled"] is True
    assert config["compression"]["quantization"]["epochs"] == 2
    export = config["export"]
    assert (export["tflite"], export["int8_fallback"], export["max_accuracy_drop"]) == \
        ("int8", "auto", 0.02)
    assert export["latency_reference"] == str(tmp_path / "dense.tflite")
    assert not export["saved_model"] and not export["onnx"] and not export["preflight"]
    unchanged = {k: v for k, v in config.items() if k not in ("compression", "export")}
    assert unchanged == {k: v for k, v in base.items() if k not in ("compression", "export")}
    (tmp_path / "dense.tflite").write_bytes(b"x")
    validate(config)                                      # a config tftrain.run takes
    plain = Candidate("int8").config(base, t, None)
    assert plain["compression"]["pruning"] == {"enabled": False}
    assert plain["export"]["tflite"] == "int8" and plain["export"]["int8_fallback"] == "off"
    onnx = Candidate("float", channels=0.5).config(base, target("latency={runtime: onnx}"), None)
    assert onnx["export"]["onnx"] and onnx["export"]["tflite"] == "none"
    assert base["compression"]["pruning"]["enabled"] is False          # base left as it was


def test_fine_tuning_cost_counts_pruning_and_weighs_qat():
    t = target("fine_tune_epochs=2", "qat_epochs=1")
    assert Candidate("int8").updates(10, t) == 0
    assert Candidate("qat").updates(10, t) == 10 * cands.QAT_STEP
    assert Candidate("float", channels=0.5).updates(10, t) == pytest.approx(2 * 10 * (0.5 + 1 / 3))
    assert Candidate("qat", channels=0.5).updates(10, t) == pytest.approx(
        2 * 10 * (0.5 + 1 / 3) + 10 * 0.5 * cands.QAT_STEP)


def test_the_list_puts_predicted_feasible_first_then_milder_then_cheaper():
    dense = {"bytes": 200_000}
    t = target("max_bytes=60KB", "candidates=6", "refine=1")
    order = cands.ordered(t, dense, 10, int8_fast=True)
    assert len(order) == 5
    predicted = [cands.feasible(cands.predicted(c, t, dense, True), t, dense) for c in order]
    assert predicted == sorted(predicted, reverse=True)             # feasible ones first
    # the dense width first (no fine-tuning, the most kept), then narrower
    assert [c.name for c in order[:3]] == ["int8", "dynamic", "qat"]
    kept = [c.channels or 1.0 for c in order if predicted[order.index(c)]]
    assert kept == sorted(kept, reverse=True)
    assert "float16" not in [c.name for c in order]                 # 104 KB: predicted too big
    # a latency target without VNNI: int8 predicted slower, channel pruning first
    slow = cands.ordered(target("max_latency_ratio=0.6", "candidates=4", "refine=0"), dense, 10,
                         int8_fast=False)
    assert all(c.channels for c in slow[:2]), [c.name for c in slow]
    # ONNX Runtime: float and int8 only; sparsity where the size counts gzipped
    onnx = cands.listed(target("latency={runtime: onnx}"))
    assert {c.precision for c in onnx} == {"int8", "qat", "float"}
    assert not any(c.sparsity for c in onnx)
    assert any(c.sparsity for c in cands.listed(target("size=gzip")))


def test_a_measured_miss_rules_out_the_harsher_or_the_milder_of_its_kind():
    """channels50-float lost 2 pt: channels35-float and channels25-float will lose more;
    its 0.62x latency was over 0.5x: channels70-float will be slower. QAT candidates,
    and a sparser or denser one at another width, are not judged by it."""
    t = target("max_accuracy_drop=0.01", "max_latency_ratio=0.5")
    lost = {"drop": 0.02, "bytes": 700_000, "latency_ms": 0.03, "latency_ratio": 0.62}
    measured = [(Candidate("float", channels=0.5), lost)]
    assert "lost 2.00 pt" in cands.ruled_out(Candidate("float", channels=0.35), measured, t)
    assert "over the size or latency limit" in cands.ruled_out(Candidate("float", channels=0.7),
                                                               measured, t)
    # a latency miss within its timing's uncertainty (borderline) rules nothing out
    unsure = [(Candidate("float", channels=0.5), {**lost, "drop": 0.0, "borderline": True})]
    assert cands.ruled_out(Candidate("float", channels=0.7), unsure, t) == ""
    assert cands.ruled_out(Candidate("qat", channels=0.35), measured, t) == ""
    assert cands.ruled_out(Candidate("qat", sparsity=0.5), measured, t) == ""
    # an int8 file after training over the size limit: QAT's int8 file of that width too
    # (its accuracy is its own: QAT trains)
    big = [(Candidate("int8"), {**lost, "drop": 0.0, "bytes": 63_000, "latency_ratio": 0.4})]
    sized = target("max_bytes=60KB")
    assert "over the size" in cands.ruled_out(Candidate("qat"), big, sized)
    assert cands.ruled_out(Candidate("qat", channels=0.7), big, sized) == ""
    assert cands.ruled_out(Candidate("dynamic"), big, sized) == ""
    worse = [(Candidate("int8"), {**lost, "bytes": 50_000, "latency_ratio": 0.4})]
    assert cands.ruled_out(Candidate("qat"), worse, sized) == ""
    # within the budget and the limits: rules out nothing
    fine = {**lost, "drop": 0.005, "latency_ratio": 0.45}
    assert cands.ruled_out(Candidate("float", channels=0.35), [(measured[0][0], fine)], t) == ""
    # sparsity at one width: a sparser one after an accuracy miss
    sparse = [(Candidate("qat", sparsity=0.5), {**lost, "latency_ratio": 0.4})]
    assert cands.ruled_out(Candidate("qat", sparsity=0.7), sparse, t)
    assert cands.ruled_out(Candidate("qat", sparsity=0.3), sparse, t) == ""


def test_violations_are_shares_past_each_limit():
    t = target("max_accuracy_drop=0.01", "max_bytes=1000", "max_latency_ms=2.0")
    over = {"drop": 0.02, "bytes": 1500, "latency_ms": 1.0, "latency_ratio": 0.5}
    assert cands.violations(over, t) == pytest.approx([1.0, 0.5, -0.5, -1.0])


def test_optuna_proposes_an_untried_candidate_alike_for_a_seed():
    t = target("max_bytes=60KB")
    history = [(Candidate(p, channels=k), {"accuracy": 0.99 - 0.1 * (1 - (k or 1)), "drop": 0.0,
                                          "bytes": 200_000 * (k or 1) * cands.BYTES[p],
                                          "latency_ms": 0.01 * (k or 1), "latency_ratio": k or 1})
               for p in ("float", "qat") for k in (None, 0.5, 0.25)]
    tried = {c.name for c, _ in history}
    first = cands.proposed(history, t, seed=3, tried=tried)
    assert first is not None and first.origin == "optuna" and first.name not in tried
    assert first.precision in ("float", "qat")
    assert cands.proposed(history, t, seed=3, tried=tried) == first
