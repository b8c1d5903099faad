"""Export: SavedModel signature and float32 logits, TFLite in LiteRT, verification."""

import numpy as np
import pytest
import tensorflow as tf
from helpers import saved_model_cli_show_and_run

from tftrain.runtime import precision
from tftrain.config import load_config
from tftrain.core.keras import keras
from tftrain.data import load_source
from tftrain.export.exports import export_all
from tftrain.export.artifacts import (convert_tflite, inference_model,
                                      save_saved_model, tflite_logits)
from tftrain.models import MODELS
from tftrain.training.train_step import TrainModel


@pytest.fixture(scope="module")
def trained():
    # seeded: the tests that ran before it in this process must not decide its weights (an
    # unseeded, weakly trained MLP moved int8's accuracy by 4 examples of 270 in one run)
    tf.keras.utils.set_random_seed(0)
    source = load_source(load_config().data, 0)
    model = TrainModel.wrap(MODELS.get("mlp")(source.spec, hidden=[32]))
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(source.calibration(source.num_train).batch(64), epochs=3, verbose=0)
    return model, source


@pytest.mark.parametrize("mode", ["float", "dynamic", "float16", "int8"])
def test_tflite_modes_match_the_model(tmp_path, trained, mode):
    model, source = trained
    cfg = load_config(None, [f"export.tflite={mode}"])
    report = export_all(model, cfg, tmp_path, source)
    saved, lite = report["saved_model"], report[f"tflite_{mode}"]
    assert saved["max_abs_logit_diff"] < 1e-4
    if mode == "float":
        assert lite["max_abs_logit_diff"] < 1e-4
    assert abs(lite["accuracy"] - saved["accuracy"]) <= 0.01
    assert (tmp_path / "model.tflite").stat().st_size == lite["size_bytes"]
    assert saved["verified"] and lite["verified"], (saved["check"], lite["check"])
    if mode == "int8":
        assert lite["size_bytes"] < report["saved_model"]["size_bytes"] / 3
    # a reduced-precision file is timed beside the float file of the same model
    if mode == "float":
        assert "float_latency_grid" not in lite
    else:
        assert list(lite["float_latency_grid"]) == list(lite["latency_grid"])
        assert all(np.isfinite(v) and v > 0 for v in lite["float_latency_grid"].values())


def test_the_converters_garbage_collection_passes_over_the_objects_made_before(tmp_path, trained):
    """TensorFlow's converter collects all garbage on each conversion from a SavedModel;
    the objects alive before it (here a million lists besides the process's own) are
    frozen meanwhile, and nothing stays frozen afterwards."""
    import gc

    from tftrain.export.artifacts import write_saved_model

    model, _ = trained
    write_saved_model(inference_model(model), tmp_path / "saved")
    held = [[] for _ in range(1_000_000)]
    before = len(gc.get_objects())
    full = []

    def seen(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(gc.get_freeze_count())
    gc.callbacks.append(seen)
    try:
        flatbuffer = convert_tflite(tmp_path / "saved", "float", None)
    finally:
        gc.callbacks.remove(seen)
    assert flatbuffer[4:8] == b"TFL3" and len(held) == 1_000_000
    # the converter's own full collection happened, with every older object frozen
    assert full and min(full) >= before
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_the_float_file_beside_a_qat_models_int8_one_is_its_float_function(qat_cnn, tmp_path):
    """Converted with every quantizer passing its input through: no quantize or dequantize
    op and no int8 tensor, and the logits of the QAT model's float function."""
    from ai_edge_litert.interpreter import Interpreter

    from tftrain.compress import quantization
    from tftrain.export.artifacts import float_tflite
    q, x, _, _ = qat_cnn
    blob = float_tflite(q, None, tmp_path, qat=True)
    interp = Interpreter(model_content=blob)
    ops = {op["op_name"] for op in interp._get_ops_details()}
    assert "CONV_2D" in ops and not ops & {"QUANTIZE", "DEQUANTIZE"}, ops
    assert {t["dtype"] for t in interp.get_tensor_details()} <= {np.float32, np.int32}
    with quantization.quantizers_bypassed():
        want = q(x[:64], training=False).numpy()
    fake_quantized = q(x[:64], training=False).numpy()
    got = tflite_logits(blob, x[:64])[0]
    assert np.max(np.abs(got - want)) < 1e-4
    assert np.max(np.abs(fake_quantized - want)) > 1e-3     # what the int8 file would give
    assert not (tmp_path / "tflite_float_source").exists()      # converted, not kept


@pytest.mark.slow
def test_a_failed_export_check_exits_1_and_marks_the_artifact(tmp_path, capsys, monkeypatch):
    import json
    from helpers import ROOT
    from tftrain.export import verification
    from tftrain.run import main
    # a float file held to its logits alone: no allowance for the model's own logit noise,
    # no layer of it passes the layer-by-layer judgement
    monkeypatch.setattr(verification, "NOISE_FACTOR", 0.0)
    monkeypatch.setattr(verification, "FLOAT_LAYER_SQNR_DB", 1000.0)
    code = main([str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path),
                 "--set", "train.epochs=1", "--set", "train.verbose=0",
                 "--set", "export.max_logit_diff=1e-12",    # float TFLite rounds differently
                 "--set", "export.preflight=false"])        # (the preflight refuses it: exit 2)
    assert code == 1
    err = capsys.readouterr().err
    assert "export verification failed: " in err and "tflite_float: largest logit difference" in err
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["status"] == "export verification failed"
    assert summary["artifacts"]["tflite_float"]["verified"] is False
    assert (tmp_path / "quickstart" / "export" / "model.tflite").exists()
    # from Python the rerun (trained already: it exports again) raises ExportFailed, with
    # the failed lines and the summary it wrote
    from tftrain.config import load_config
    from tftrain.run import ExportFailed, run
    with pytest.raises(ExportFailed) as failed:
        run(load_config(ROOT / "configs" / "quickstart.yaml", [
            f"run.dir={tmp_path}", "train.epochs=1", "train.verbose=0",
            "export.max_logit_diff=1e-12", "export.preflight=false"]))
    assert failed.value.failed == [f"tflite_float: {summary['artifacts']['tflite_float']['check']}"]
    assert failed.value.summary["status"] == "export verification failed"
    assert json.loads(json.dumps(failed.value.summary, default=str)) == json.loads(
        (tmp_path / "quickstart" / "summary.json").read_text())


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_model_exports_float32(tmp_path, policy):
    precision.apply_policy(policy)
    source = load_source(load_config().data, 0)
    model = precision.float32_outputs(MODELS.get("cnn")(source.spec, filters=[4], dense=[8]))
    plain = inference_model(model)
    assert all(l.compute_dtype == "float32" for l in plain.layers)
    path = save_saved_model(model, tmp_path / "sm")
    out = tf.saved_model.load(str(path)).signatures["serving_default"](inputs=tf.zeros((2, 8, 8, 1)))
    assert out["logits"].dtype == tf.float32 and out["logits"].shape == (2, 10)
    lite = convert_tflite(path, "float", np.zeros((0,), np.float32))   # converts (tensorflow#35379)
    logits, _ = tflite_logits(lite, np.zeros((2, 8, 8, 1), np.float32))
    np.testing.assert_allclose(logits, out["logits"].numpy(), atol=1e-5)


@pytest.mark.slow
def test_saved_model_cli_show_and_run(tmp_path, trained):
    model, _ = trained
    path = save_saved_model(model, tmp_path / "sm")
    saved_model_cli_show_and_run(path, np.zeros((2, 8, 8, 1), np.float32), tmp_path)


def test_each_saved_model_is_checked_in_bounded_batches(tmp_path, trained, monkeypatch):
    """The validation split goes through every exported SavedModel a batch at a time, not
    in one call (the whole split of an ImageNet-sized model is gigabytes at once)."""
    model, source = trained
    sizes = []
    load = tf.saved_model.load

    def recording(path, *args, **kwargs):
        loaded = load(path, *args, **kwargs)
        signature = loaded.signatures["serving_default"]

        def call(inputs):
            sizes.append(int(inputs.shape[0]))
            return signature(inputs=inputs)
        return type("Loaded", (), {"signatures": {"serving_default": call}})()
    monkeypatch.setattr(tf.saved_model, "load", recording)
    cfg = load_config(None, ["export.tflite=none", "export.saved_model_int8=true"])
    report = export_all(model, cfg, tmp_path, source)
    assert report["saved_model"]["verified"] and report["saved_model_int8"]["verified"]
    assert source.num_val > 64 and max(sizes) <= 64
    assert sum(s for s in sizes if s > 1) == 2 * source.num_val     # every example, each model


def test_post_training_int8_of_a_token_model_is_integer_throughout(tmp_path):
    """`export.tflite: int8` without QAT on a model taking token ids: calibrated on token
    ids, so every FULLY_CONNECTED takes int8 activations and int8 weights, and the
    embedding table is an int8 GATHER (not a dynamic-range model with float activations)."""
    from ai_edge_litert.interpreter import Interpreter
    source = load_source(load_config(None, [
        "data.name=synthetic",
        "data.params={kind: tokens, num_examples: 300, seq_len: 12, vocab_size: 50}"]).data, 0)
    model = TrainModel.wrap(MODELS.get("embedding_bag")(source.spec, embed_dim=8))
    # trained a little: an untrained model's predictions are near ties, and int8 rounding
    # moves its accuracy by more than export.max_accuracy_drop at random
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(source.calibration(source.num_train).batch(32), epochs=5, verbose=0)
    report = export_all(model, load_config(None, ["export.tflite=int8"]), tmp_path, source)
    assert report["tflite_int8"]["verified"]
    ops = Interpreter(model_path=str(tmp_path / "model.tflite"))._get_ops_details()
    dense = [op for op in ops if op["op_name"] == "FULLY_CONNECTED"]
    assert dense and all([t.__name__ for t in op["operand_types"][:2]] == ["int8", "int8"]
                         for op in dense)
    gather, = [op for op in ops if op["op_name"] == "GATHER"]
    assert gather["operand_types"][0].__name__ == "int8"


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_the_float32_baseline_size_is_the_saved_models_variables_gzip(tmp_path, policy):
    """The compression ratios' baseline (a checkpoint of the float32 inference model's
    variables, written without a signature) is the gzip size of the float32 SavedModel's
    `variables/` to within the object graph's bytes, under any policy."""
    import gzip

    from tftrain.export.artifacts import saved_model_variables_gzip
    from tftrain.export.measures import GZIP_LEVEL, dir_bytes
    precision.apply_policy(policy)
    try:
        model = MODELS.get("cnn")(load_source(load_config().data, 0).spec)
    finally:
        precision.apply_policy("float32")
    saved = save_saved_model(model, tmp_path / "saved_model")
    expected = len(gzip.compress(dir_bytes(saved / "variables"), GZIP_LEVEL))
    assert abs(saved_model_variables_gzip(model) - expected) <= 100
    assert expected > 4 * 53_002 * 0.8     # float32 weights (53,002), not 16-bit copies


def test_post_training_int8_of_hard_swish_is_int8_ops_xnnpack_runs(tmp_path):
    """A model with HardSwish layers (MobileNetV3's): its post-training int8 TFLite file
    has no HARD_SWISH (the converter fuses one, whose int8 kernel XNNPack lacks, when the
    expression is traced whole), XNNPack runs every op, and the file keeps the model's
    accuracy; its float file keeps the fused HARD_SWISH."""
    from ai_edge_litert.interpreter import Interpreter
    from tftrain.export import speed
    from tftrain.models.hard_swish import HardSwish
    source = load_source(load_config().data, 0)
    keras.utils.set_random_seed(0)
    inputs = keras.Input(source.spec.shape)
    h = keras.layers.Conv2D(16, 3, padding="same", name="conv")(inputs)
    h = HardSwish(name="swish")(keras.layers.BatchNormalization(name="bn")(h))
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise")(h)
    h = HardSwish(name="swish_1")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    model = TrainModel.wrap(keras.Model(inputs, keras.layers.Dense(10, name="logits")(h)))
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(source.calibration(source.num_train).batch(32), epochs=3, verbose=0)
    report = export_all(model, load_config(None, ["export.tflite=int8"]), tmp_path, source)
    entry = report["tflite_int8"]
    assert entry["verified"] and entry["xnnpack"]["fallback"] == [], entry["xnnpack"]
    # (x / 6) * relu6(x + 3), each tensor calibrated on its own values (`calibration`):
    # within 1 dB of what the layer's steps allow (28.7 and 27.0 dB, 7 dB short of it,
    # when the converter's calibration held x / 6 on the product's range)
    rows = {row["layer"]: row for row in entry["layers"]}
    for name in ("swish", "swish_1"):
        assert rows[name]["local_sqnr_db"] >= rows[name]["allowed_sqnr_db"] - 1.0, rows[name]
    ops = [op["op_name"] for op in Interpreter(model_path=str(tmp_path / "model.tflite"))._get_ops_details()]
    assert "HARD_SWISH" not in ops and ops.count("MUL") == 4 and ops.count("ADD") == 2, ops
    blob = convert_tflite(tmp_path / "saved_model", "float", None)
    assert "HARD_SWISH" in {op["op_name"] for op in Interpreter(model_content=blob)._get_ops_details()}
    assert speed.xnnpack(blob)["fallback"] == []
    # an input far beyond relu6's [0, 6] is traced fused: LiteRT's int8 ADD of x and 3
    # into [0, 6] miscomputed a large negative x (6 for x = -1275)
    from tftrain.models import hard_swish
    x = next(iter(source.calibration(64).batch(64)))[0].numpy()
    assert hard_swish.unfusable(model, x) == ["swish", "swish_1"]
    model.get_layer("bn").gamma.assign(model.get_layer("bn").gamma * 1000.0)
    assert hard_swish.unfusable(model, x) == []       # both inputs now reach beyond 96


def test_a_float_tflite_file_beyond_the_logit_limit_is_compared_layer_by_layer(tmp_path, trained,
                                                                            monkeypatch):
    """The limit at the logits made tighter than float32 rounding: the float file is
    compared layer by layer, every layer exact to float rounding, and so verified, with
    the check saying so (the SavedModel runs TensorFlow's kernels: 0 apart)."""
    from tftrain.export import verification
    model, source = trained
    monkeypatch.setattr(verification, "NOISE_FACTOR", 0.0)      # the limit at the logits alone
    cfg = load_config(None, ["export.tflite=float", "export.max_logit_diff=1e-12"])
    report = export_all(model, cfg, tmp_path, source)
    lite = report["tflite_float"]
    assert "dense_0" in [row["layer"] for row in lite["layers"]]
    assert min(row["local_sqnr_db"] for row in lite["layers"]) >= 60 and lite["worst_layers"]
    assert lite["verified"] and "layer by layer the noisiest" in lite["check"], lite["check"]
    assert lite["max_abs_logit_diff"] > 1e-12 and "layers" not in report["saved_model"]
