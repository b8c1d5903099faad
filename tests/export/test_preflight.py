"""Export preflight: every requested export converted and run once before training; a
conversion that cannot work is a config error (exit 2) with nothing written."""
import json
import re

import pytest

from helpers import QUICKSTART, quick_config, unwrapped
from tftrain.core.keras import keras
from tftrain.run import main, run


def unconvertible(spec):
    """A model whose Bessel-function layer no TFLite builtin computes."""
    import tensorflow as tf
    inputs = keras.Input(spec.shape)
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Lambda(lambda t: tf.math.special.bessel_i1e(t), name="bessel")(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes, name="logits")(x))


def args(tmp_path, *sets, flags=()):
    return [str(QUICKSTART), "--run-dir", str(tmp_path), *flags,
            *[a for s in sets for a in ("--set", s)]]


def test_an_export_that_cannot_convert_is_refused_before_training(tmp_path, capsys):
    code = main(args(tmp_path, "model={name: 'test_preflight:unconvertible'}", "export.tflite=int8",
                     "train.epochs=50"))
    out, err = capsys.readouterr()
    assert code == 2, err[-3000:]
    line, = [x for x in err.splitlines() if x.startswith("tftrain: config error: ")]
    assert line == ("tftrain: config error: export.tflite (int8): the untrained model does not "
                    "convert: op BesselI1e (layer bessel) has no TFLite builtin form; replace the "
                    "layer or set export.tflite: none, or set export.preflight: false to find out "
                    "after training")
    assert "export.preflight: false" in line and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [] and "training:" not in out      # nothing trained
    # off: the plan goes on (and this model then fails at the export, after training)
    cfg = quick_config(tmp_path, "model={name: 'test_preflight:unconvertible'}",
                       "export.tflite=int8", "export.preflight=false")
    assert cfg.export.preflight is False


def test_the_plan_says_what_preflight_converted_and_how_long_it_took(tmp_path, capsys):
    assert main(args(tmp_path, "export.tflite=int8", "export.saved_model_int8=true",
                     flags=["--dry-run", "--preflight"])) == 0
    out = capsys.readouterr().out
    line, = [x for x in unwrapped(out) if x.startswith("export preflight: ")]
    assert re.fullmatch(r"export preflight: saved_model, saved_model_int8, tflite_int8 converted "
                        r"and run untrained in \d+\.\d s \(export\.preflight: "
                        r"false skips it\)", line), line
    assert main(args(tmp_path, "export.preflight=false", flags=["--dry-run", "--preflight"])) == 0
    assert "export preflight" not in capsys.readouterr().out


@pytest.mark.slow
def test_preflight_follows_the_last_stage_qat_and_records_its_time(tmp_path):
    summary = run(quick_config(tmp_path, "train.epochs=1", "export.tflite=int8",
                               "compression.quantization={enabled: true, epochs: 1}",
                               "export.preflight=true"))
    assert summary["preflight"]["artifacts"] == ["saved_model", "tflite_int8"]
    assert 0 < summary["preflight"]["seconds"]
    assert json.loads((tmp_path / "quickstart" / "summary.json").read_text())["preflight"] == \
        summary["preflight"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["transformer", "speech", "speech_fft"])
def test_onnx_int8_of_the_transformer_and_speech_models_is_made_and_verified(
        tmp_path, capsys, recipe, spoken_digits):
    """The transformer's exact GELU (Erfc) and the speech models' spectrogram (RFFT,
    ComplexAbs) have no ONNX opset 17 form, but a QAT model's ONNX file is converted from
    its int8 TFLite file, where the GELU and the features are TFLite ops tf2onnx
    converts: the int8 ONNX file is made and verified for both (one outcome each; the
    test once also passed on a refusal). The speech model both ways: its spectrum an int8
    matrix product (`spectrum: matrix`, with its int8 SavedModel, whose feature layer
    once took the spectrum's range for its output's) and the float FFT (`conv1d`)."""
    sets = {"transformer": ["data.name=synthetic",
                            "data.params={kind: tokens, num_examples: 600, seq_len: 16, vocab_size: 200}",
                            "model={name: transformer, params: {embed_dim: 16, num_heads: 2, "
                            "num_layers: 1, mlp_dim: 32}}"],
            # the int8 spectrum (an int8 matrix product; its int8 SavedModel too) and the
            # float FFT before int8 layers
            "speech": ["data.name=audio_folder", "data.validation_fraction=0.25",
                       f"data.params={{path: {spoken_digits}, sample_rate: 16000}}",
                       "model={name: ds_cnn, params: {filters: 16, spectrum: matrix}}",
                       "export.saved_model_int8=true"],
            "speech_fft": ["data.name=audio_folder", "data.validation_fraction=0.25",
                           f"data.params={{path: {spoken_digits}, sample_rate: 16000}}",
                           "model={name: conv1d, params: {filters: [16, 16]}}"]}[recipe]
    # a smoke run (a few batches per stage): the claim is the conversion; its int8 files
    # are held against the QAT model they came from (a smoke run's accuracy is noise),
    # with the default budgets
    code = main(args(tmp_path, *sets, "export.onnx=true", "export.tflite=int8",
                     "train.jit_compile=false",
                     "compression.quantization={enabled: true, epochs: 1, skip_unsupported: true}",
                     flags=["--smoke"]))
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    summary = json.loads((tmp_path / "quickstart-smoke" / "summary.json").read_text())
    assert summary["preflight"]["artifacts"] == [
        "saved_model", *(["saved_model_int8"] if recipe == "speech" else []), "tflite_int8",
        "onnx_int8"]
    for kind in summary["preflight"]["artifacts"]:
        assert summary["artifacts"][kind]["verified"], (kind, summary["artifacts"][kind]["check"])
    onnx = summary["artifacts"]["onnx_int8"]
    assert onnx["verified"] and onnx["label"].startswith("int8"), onnx["check"]
    assert onnx["logit_sqnr_db"] >= 20 and onnx["layers"]


def test_a_bug_in_tftrain_during_the_preflight_exits_1_with_its_traceback(tmp_path, capsys,
                                                                       monkeypatch):
    """An exception from tftrain's own code while an artifact is made is not a config
    error: exit 1, the traceback, the artifact and a line saying it is a bug."""
    from tftrain.export import measures

    def broken(blob):
        raise KeyError("size_bytes")
    monkeypatch.setattr(measures, "sizes", broken)
    code = main(args(tmp_path, "export.tflite=float", flags=["--dry-run", "--preflight"]))
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" in err and "in broken" in err
    assert ("tftrain: error: RuntimeError: export preflight, making saved_model: KeyError: "
            "'size_bytes'; this is a bug in tftrain, not a problem of your config or model") in err
    assert list(tmp_path.iterdir()) == []


def test_an_op_onnx_runtime_cannot_run_is_refused_naming_the_onnx_export(tmp_path, capsys):
    """tf2onnx writes the Bessel function's op, ONNX Runtime has no kernel for it: the
    refusal names export.onnx (the artifact being made when ONNX Runtime raised)."""
    code = main(args(tmp_path, "model={name: 'test_preflight:unconvertible'}", "export.tflite=none",
                     "export.onnx=true"))
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    line, = [x for x in err.splitlines() if x.startswith("tftrain: config error: ")]
    assert line.startswith("tftrain: config error: export.onnx: the untrained model does not "
                           "convert: ") and "BesselI1e" in line, line
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_a_sparse_only_export_goes_through_the_preflight(tmp_path, capsys, monkeypatch):
    import sys
    import types

    from test_sparse import sparse_net
    module = types.ModuleType("sparse_models")
    module.net = lambda spec: sparse_net(size=spec.shape[0])
    monkeypatch.setitem(sys.modules, "sparse_models", module)
    assert main(args(tmp_path, "data.params={image_size: 9, channels: 3}",
                     "model={name: 'sparse_models:net', params: {}}",
                     "compression.pruning={enabled: true, final_sparsity: 0.7, epochs: 1}",
                     "export.tflite=none", "export.saved_model=false", "export.tflite_sparse=true",
                     flags=["--dry-run", "--preflight"])) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("export preflight: ")]
    assert line.startswith("export preflight: tflite_sparse converted and run"), line
