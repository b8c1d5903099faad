"""The export kinds: the one list of what tftrain exports, read by the plan, the dry run,
the export phase, the preflight, verification, the report and the search."""
import json

import numpy as np
import pytest
from helpers import QUICKSTART

from tftrain.config import load_config
from tftrain.export import kinds
from tftrain.export.kinds import ExportKind

EVERY = ["export.saved_model=true", "export.saved_model_int8=true", "export.tflite=int8",
         "export.tflite_sparse=true", "export.onnx=true"]


def test_the_plan_and_the_export_phase_name_the_same_artifacts_in_order():
    every = load_config(None, EVERY)
    assert [k.title for k in kinds.enabled(every, qat=False)] == [
        "SavedModel", "int8 SavedModel", "TFLite int8", "sparse TFLite", "ONNX", "ONNX int8"]
    assert kinds.exports_line(every, qat=False) == \
        "exports: SavedModel, int8 SavedModel, TFLite int8, sparse TFLite, ONNX, ONNX int8"
    none = load_config(None, ["export.saved_model=false", "export.tflite=none"])
    assert kinds.enabled(none, qat=False) == [] and kinds.exports_line(none, False) == "exports: none"


def test_a_qat_model_exports_onnx_only_as_int8_even_without_a_tflite_file():
    qat = load_config(None, ["compression.quantization.enabled=true", "export.tflite=none",
                             "export.onnx=true", "export.saved_model=false"])
    assert [k.name for k in kinds.enabled(qat, qat=True)] == ["onnx_int8"]


def test_each_kind_names_its_file_precision_and_setting():
    assert kinds.named("tflite_int8").path == "export/model.tflite"
    assert kinds.named("onnx_int8").path == "export/model_int8.onnx"
    assert kinds.named("saved_model").path == "export/saved_model/"
    assert [kinds.named(n).precision for n in ("tflite_dynamic", "tflite_float16", "onnx",
                                               "saved_model_int8", "keras3_file")] == \
        ["dynamic", "float16", "float", "int8", "float"]
    assert kinds.named("tflite_sparse").key == "export.tflite_sparse"
    with pytest.raises(KeyError, match="no export kind 'tflite_int4'"):
        kinds.named("tflite_int4")


def test_the_headline_is_what_the_run_was_compressed_for_first():
    assert kinds.headline_order() == ["tflite_int8", "tflite_float16", "tflite_dynamic",
                                      "tflite_float", "onnx_int8", "saved_model_int8", "onnx",
                                      "saved_model"]
    assert kinds.deployed("tflite", "int8") == "tflite_int8"
    assert kinds.deployed("tflite", "float16") == "tflite_float16"
    assert kinds.deployed("onnx", "int8") == "onnx_int8"
    assert kinds.deployed("onnx", "float16") == "onnx"        # ONNX has no float16 file


def test_before_the_model_is_built_the_dry_run_names_what_the_model_decides():
    builder = load_config(None, ["model.name=tests.builders:keras3_mlp"])
    line = kinds.exports_line(builder, False, built=False)
    assert line.splitlines() == [
        "exports: SavedModel, TFLite float",
        "exports the model decides: a Keras 3 file if it comes in as one (known when it is built)"]
    assert kinds.exports_line(load_config(None, []), False, built=False) == \
        "exports: SavedModel, TFLite float"


class Float16SavedModel(ExportKind):
    """A toy export: the SavedModel with float16 variables (every layer computing in
    float16, its logits cast back to float32)."""
    name, title, path = "saved_model_float16", "float16 SavedModel", "export/saved_model_float16/"
    precision, runtime = "float16", "tensorflow"
    key, fix = "export.saved_model", "set export.saved_model: false"

    def enabled(self, cfg, qat):
        return cfg.export.saved_model

    def make(self, ctx):
        import tensorflow as tf

        from tftrain.core.keras import keras
        from tftrain.export import artifacts
        from tftrain.export.measures import accuracy, against, dir_bytes, signature_logits, sizes

        def half(layer):
            config = layer.get_config()
            if "dtype" in config and not isinstance(layer, keras.layers.InputLayer):
                config["dtype"] = "float16"
            return layer.__class__.from_config(config)
        model = keras.models.clone_model(ctx.plain, clone_function=half)
        model.set_weights([w.astype(np.float16) for w in ctx.plain.get_weights()])
        path = artifacts.write_saved_model(model, ctx.out / "saved_model_float16")
        logits = signature_logits(tf.saved_model.load(str(path)).signatures["serving_default"],
                                  ctx.x)
        return {**sizes(dir_bytes(path)), "accuracy": accuracy(logits, ctx.y),
                **against(logits, ctx.reference)}


def test_a_new_export_is_one_class_and_one_line(tmp_path, monkeypatch, capsys):
    """The toy kind, added to `KINDS` only, is planned, dry-run, converted by the
    preflight, written, verified, reported and summarised."""
    from tftrain.run import main

    monkeypatch.setattr(kinds, "KINDS", (*kinds.KINDS, Float16SavedModel()))   # the one line
    args = [str(QUICKSTART), "--run-dir", str(tmp_path), "--set", "train.epochs=2",
            "--set", "export.tflite=none"]
    assert main([*args, "--dry-run"]) == 0
    assert "exports: SavedModel, float16 SavedModel" in capsys.readouterr().out.splitlines()
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "exports: SavedModel, float16 SavedModel" in lines                    # the plan
    assert any(line.startswith("export preflight: saved_model, saved_model_float16 converted")
               for line in lines)
    run = tmp_path / "quickstart"
    summary = json.loads((run / "summary.json").read_text())
    entry = summary["artifacts"]["saved_model_float16"]
    assert entry["path"] == "export/saved_model_float16/" and entry["verified"]
    assert entry["judged_by"] == "accuracy" and abs(entry["accuracy"] -
                                                    summary["artifacts"]["saved_model"]["accuracy"]) < 0.01
    assert (run / "export" / "saved_model_float16" / "saved_model.pb").exists()
    # float16 variables: half the float32 SavedModel's bytes, to within its graph
    assert entry["size_bytes"] < 0.6 * summary["artifacts"]["saved_model"]["size_bytes"]
    assert any(line.startswith("export saved_model_float16  export/saved_model_float16/")
               for line in lines)                                            # the report
