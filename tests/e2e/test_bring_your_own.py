"""Bring your own model: a model trained elsewhere (a Keras 3 or tf_keras file, or a
builder written with `import keras`) compressed and exported, with or without training."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from helpers import QUICKSTART, quick_config, shared_run, unwrapped
from tftrain.core.keras import keras3
from tftrain.run import main, run


def digits_x_y():
    from sklearn.datasets import load_digits
    d = load_digits()
    return (d.images / 16.0)[..., None].astype("float32"), d.target


@pytest.fixture(scope="session")
def keras3_cnn_file(tmp_path_factory):
    """A Keras 3 functional CNN (Conv2D, BatchNormalization, DepthwiseConv2D, Dense, a
    softmax head) trained by Keras 3 on the digits and saved as .keras."""
    def build(out):
        k3 = keras3()
        k3.utils.set_random_seed(0)
        x, y = digits_x_y()
        inputs = k3.Input((8, 8, 1), name="inputs")
        h = k3.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
        h = k3.layers.BatchNormalization()(h)
        h = k3.layers.ReLU()(h)
        h = k3.layers.DepthwiseConv2D(3, padding="same", activation="relu")(h)
        h = k3.layers.Conv2D(32, 1, activation="relu")(h)
        h = k3.layers.MaxPooling2D(2)(h)
        h = k3.layers.Flatten()(h)
        model = k3.Model(inputs, k3.layers.Dense(10, activation="softmax")(h))
        model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        model.fit(x, y, epochs=5, batch_size=32, verbose=0)
        model.save(str(out / "cnn.keras"))
        return str(out / "cnn.keras")
    return shared_run(tmp_path_factory, "keras3-cnn", build)[1]


def validation(cfg):
    from tftrain.data import BatchPlan, load_source, val_dataset
    source = load_source(cfg.data, cfg.run.seed)
    x, y = zip(*val_dataset(source, BatchPlan(1024, 1, 1), cfg.data).as_numpy_iterator())
    return np.concatenate(x), np.concatenate(y)


@pytest.mark.slow
def test_a_keras3_file_is_pruned_quantized_and_exported_without_training(tmp_path,
                                                                        keras3_cnn_file):
    """train.epochs: 0 + pruning + prune-preserving QAT + int8 TFLite of a model trained
    and saved by Keras 3: converted to Keras 3's outputs to 1e-5; the starting model, as
    loaded, scores what Keras 3's model scores on the validation examples; the int8 file
    is within the accuracy budget of the QAT model; the float model comes back as a
    Keras 3 file."""
    sets = [f"model={{name: 'file:{keras3_cnn_file}'}}", "train.epochs=0",
            "compression.pruning={enabled: true, epochs: 1, final_sparsity: 0.5}",
            "compression.quantization={enabled: true, epochs: 1}", "export.tflite=int8",
            "export.preflight=true"]
    cfg = quick_config(tmp_path, *sets)
    summary = run(cfg)
    source = summary["model_source"]
    assert source["kind"] == "file" and source["writer"] == "keras3" and source["softmax_removed"]
    assert source["converted_diff"] <= 1e-5
    x, y = validation(cfg)
    own = keras3().saving.load_model(keras3_cnn_file, compile=False)
    theirs = float(np.mean(np.argmax(np.asarray(own(x)), -1) == y))
    start = summary["stages"]["train"]
    assert start["updates"] == 0 and summary["steps"] == 0
    assert start["raw_metrics"]["val_accuracy"] == pytest.approx(theirs, abs=1e-6)
    lite, qat = summary["artifacts"]["tflite_int8"], summary["stages"]["qat"]["metrics"]
    assert lite["verified"] and qat["val_accuracy"] - lite["accuracy"] <= 0.01
    back = summary["artifacts"]["keras3_file"]
    assert back["verified"] and back["max_abs_logit_diff"] <= 1e-5
    model = keras3().saving.load_model(str(tmp_path / "quickstart" / "export" / "model.keras"))
    assert type(model).__module__.startswith("keras.")
    assert max(summary["sparsity"].values()) == pytest.approx(0.5, abs=0.01)


@pytest.mark.slow
def test_a_keras3_separable_conv_block_is_pruned_quantized_and_exported_int8(tmp_path):
    """Xception's block (SeparableConv2D -> BatchNormalization -> ReLU, a strided 1x1
    shortcut added) from a Keras 3 file trained by Keras 3: pruned 50%, prune-preserving
    QAT with each SeparableConv2D split in two, int8 TFLite within a point of the QAT
    model with every op int8, the 1x1 parts keeping the pruned zeros."""
    from tftrain.export import artifacts
    k3 = keras3()
    k3.utils.set_random_seed(0)
    x, y = digits_x_y()
    inputs = k3.Input((8, 8, 1))
    h = k3.layers.Conv2D(16, 3, padding="same", activation="relu", name="stem")(inputs)
    r = k3.layers.Conv2D(32, 1, strides=2, use_bias=False, name="shortcut")(h)
    r = k3.layers.BatchNormalization(name="shortcut_bn")(r)
    for i, filters in enumerate([32, 32]):
        h = k3.layers.SeparableConv2D(filters, 3, padding="same", use_bias=False,
                                      name=f"sep{i}")(h)
        h = k3.layers.BatchNormalization(name=f"sep{i}_bn")(h)
        h = k3.layers.ReLU(name=f"sep{i}_relu")(h)
    h = k3.layers.MaxPooling2D(3, strides=2, padding="same", name="pool")(h)
    h = k3.layers.Add(name="add")([h, r])
    h = k3.layers.GlobalAveragePooling2D(name="gap")(h)
    model = k3.Model(inputs, k3.layers.Dense(10, name="logits")(h))
    model.compile("adam", k3.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=4, batch_size=32, verbose=0)
    path = tmp_path / "xception_block.keras"
    model.save(str(path))
    summary = run(quick_config(
        tmp_path, f"model={{name: 'file:{path}'}}", "train.epochs=0",
        "compression.pruning={enabled: true, epochs: 1, final_sparsity: 0.5}",
        "compression.quantization={enabled: true, epochs: 1}", "export.tflite=int8",
        "export.saved_model_int8=true"))
    lite, qat = summary["artifacts"]["tflite_int8"], summary["stages"]["qat"]["metrics"]
    assert lite["verified"] and qat["val_accuracy"] - lite["accuracy"] <= 0.01, lite["check"]
    assert qat["val_accuracy"] >= 0.8 and lite["label"] == "int8"
    assert summary["artifacts"]["saved_model_int8"]["verified"]
    assert summary["sparsity"]["sep0"] == pytest.approx(0.5, abs=0.01)
    blob = (tmp_path / "quickstart" / "export" / "model.tflite").read_bytes()
    kernels = [w for w in artifacts.tflite_weights(blob).values() if w.ndim == 4]
    assert all(w.dtype == np.int8 for w in kernels)
    pointwise = [w for w in kernels if w.shape[1:3] == (1, 1) and w.shape[0] == 32
                 and w.shape[3] == 32]        # sep1's 1x1 part: [32 out, 1, 1, 32 in]
    assert pointwise and float(np.mean(pointwise[0] == 0)) == pytest.approx(0.5, abs=0.02)


@pytest.mark.slow
def test_a_keras3_mobilenet_v3_is_pruned_quantization_aware_trained_and_exported_int8(tmp_path):
    """Keras 3's own MobileNetV3Small (its hard-sigmoid written as operations on tensors,
    its hard-swish as an activation, squeeze-excite gates) from a `.keras` file: converted,
    trained, pruned to 50%, prune-preserving QAT and an int8 TFLite file that XNNPack
    runs whole, within a point of the QAT model, handed back as Keras 3. Its first five
    blocks (through the first residual add after a 5x5 squeeze-excite block with
    hard-swish: every kind of layer the whole one has), pooled: the whole backbone made
    this the slowest test (197 s in a default run; the cut one 72 s alone), for the same
    checks."""
    from ai_edge_litert.interpreter import Interpreter
    k3 = keras3()
    k3.utils.set_random_seed(0)
    inputs = k3.Input((32, 32, 3))
    backbone = k3.applications.MobileNetV3Small(
        include_top=False, weights=None, input_tensor=k3.layers.Rescaling(255.0)(inputs),
        alpha=0.75)
    x = k3.layers.GlobalAveragePooling2D()(backbone.get_layer("expanded_conv_4_add").output)
    path = tmp_path / "mobilenet_v3.keras"
    k3.Model(inputs, k3.layers.Dense(10, name="logits")(x)).save(str(path))
    summary = run(quick_config(
        tmp_path, f"model={{name: 'file:{path}'}}", "data.params={image_size: 32, channels: 3}",
        "distribute.strategy=one_device", "train.epochs=2",
        "compression.pruning={enabled: true, epochs: 1, final_sparsity: 0.5}",
        "compression.quantization={enabled: true, epochs: 1}", "export.tflite=int8"))
    assert summary["model_source"]["converted_diff"] <= 1e-5
    lite, qat = summary["artifacts"]["tflite_int8"], summary["stages"]["qat"]["metrics"]
    assert lite["verified"] and qat["val_accuracy"] - lite["accuracy"] <= 0.01, lite["check"]
    assert lite["xnnpack"]["fallback"] == [] and lite["label"] == "int8 with 2 float ops"
    ops = [op["op_name"] for op in Interpreter(
        model_path=str(tmp_path / "quickstart" / "export" / "model.tflite"))._get_ops_details()]
    assert "HARD_SWISH" not in ops and ops.count("DEQUANTIZE") == 1
    assert summary["artifacts"]["keras3_file"]["verified"]
    assert min(summary["sparsity"].values()) == pytest.approx(0.5, abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["model.h5", "saved_model"])
def test_a_tf_keras_file_starts_the_run_as_it_was_saved(tmp_path, form):
    """A tf_keras model saved as .h5 or as a SavedModel directory, run with
    train.epochs: 0: the exported SavedModel gives the file's own model's outputs on the
    validation examples to 1e-6."""
    from tftrain.core.keras import keras
    from tftrain.models import MODELS
    from tftrain.data import InputSpec

    keras.utils.set_random_seed(1)
    original = MODELS.get("cnn")(InputSpec((8, 8, 1), "float32", 10), filters=[8, 16],
                                 dense=[32], batch_norm=True)
    path = tmp_path / form
    original.save(str(path))
    cfg = quick_config(tmp_path, f"model={{name: 'file:{path}'}}", "train.epochs=0",
                       "train.recalibrate_batch_norm=off", "export.tflite=none")
    summary = run(cfg)
    assert summary["model_source"]["writer"] == "tf_keras"
    import tensorflow as tf
    x, _ = validation(cfg)
    served = tf.saved_model.load(str(tmp_path / "quickstart" / "export" / "saved_model"))
    logits = served.signatures["serving_default"](inputs=tf.constant(x))["logits"].numpy()
    np.testing.assert_allclose(logits, original(x).numpy(), rtol=0, atol=1e-6)
    assert not (tmp_path / "quickstart" / "export" / "model.keras").exists()


BUILDERS = textwrap.dedent('''
    import keras


    def block(spec, embed_dim=16, heads=2):
        """A Keras 3 transformer block on token ids."""
        tokens = keras.Input(spec.shape, dtype="int32", name="inputs")
        x = keras.layers.Embedding(spec.vocab_size, embed_dim)(tokens)
        y = keras.layers.LayerNormalization()(x)
        y = keras.layers.MultiHeadAttention(heads, embed_dim // heads)(y, y)
        x = keras.layers.Add()([x, y])
        y = keras.layers.LayerNormalization()(x)
        y = keras.layers.Dense(32, activation="gelu")(y)
        x = keras.layers.Add()([x, keras.layers.Dense(embed_dim)(y)])
        x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(x))
        return keras.Model(tokens, keras.layers.Dense(spec.num_classes)(x))


    def mobilenet(spec):
        return keras.applications.MobileNetV2(input_shape=spec.shape, alpha=0.35,
                                              weights=None, classes=spec.num_classes,
                                              classifier_activation=None)


    class Scale(keras.layers.Layer):
        def call(self, x):
            return x * 2.0


    def custom(spec):
        inputs = keras.Input(spec.shape)
        x = keras.layers.Flatten()(Scale(name="doubling")(inputs))
        return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))
''')


@pytest.fixture
def keras3_builders(tmp_path, monkeypatch):
    (tmp_path / "k3_models.py").write_text(BUILDERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "k3_models"


@pytest.mark.slow
def test_a_keras3_transformer_block_trains_mirrored_and_exports_int8(tmp_path, keras3_builders):
    """A builder written with `import keras` (no traceback, no refusal): its transformer
    block converted, trained on 2 virtual replicas, quantization-aware trained and
    exported as an int8 TFLite file as the bundled transformer is, and handed back as
    Keras 3."""
    summary = run(quick_config(
        tmp_path, f"model={{name: '{keras3_builders}:block'}}", "data.name=synthetic",
        "data.params={kind: tokens, num_examples: 1200, seq_len: 16, vocab_size: 200}",
        "train.epochs=2", "compression.quantization={enabled: true, epochs: 1}",
        "export.tflite=int8"))
    assert summary["strategy"] == "mirrored" and summary["replicas"] == 2
    source = summary["model_source"]
    assert source["kind"] == "keras3 builder" and source["converted_diff"] <= 1e-5
    lite = summary["artifacts"]["tflite_int8"]
    assert lite["verified"] and lite["label"].startswith("int8")
    assert summary["artifacts"]["keras3_file"]["verified"]


@pytest.mark.slow
def test_keras3_mobilenetv2_is_converted_fine_tuned_and_exported(tmp_path, keras3_builders):
    summary = run(quick_config(
        tmp_path, f"model={{name: '{keras3_builders}:mobilenet'}}",
        "data.params={image_size: 32, channels: 3}", "train.epochs=1",
        "distribute.strategy=one_device", "export.tflite=float"))
    source = summary["model_source"]
    assert source["converted_diff"] <= 1e-5
    assert summary["artifacts"]["tflite_float"]["verified"]
    assert summary["artifacts"]["keras3_file"]["verified"]
    # the float file scores what the model scored (one example's flip at most)
    lite = summary["artifacts"]["tflite_float"]
    assert lite["accuracy"] == pytest.approx(summary["metrics"]["val_accuracy"], abs=1.5 / 270)


def test_a_custom_keras3_layer_exits_2_naming_it_with_nothing_written(tmp_path, capsys,
                                                                     keras3_builders):
    runs = tmp_path / "runs"
    code = main([str(QUICKSTART), "--run-dir", str(runs), "--set",
                 f"model={{name: '{keras3_builders}:custom'}}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    line, = [x for x in err.splitlines() if x.startswith("tftrain: config error: ")]
    assert line == ("tftrain: config error: model.name: k3_models:custom is a Keras 3 model: "
                    "layer doubling (Scale, from k3_models) has no tf_keras form tftrain knows; "
                    "rewrite it with tf_keras, or register a converter "
                    "(tftrain.models.keras3.register_converter)")
    assert not runs.exists()


@pytest.mark.slow
def test_the_plan_and_summary_say_where_the_model_came_from(tmp_path, capsys, keras3_cnn_file):
    assert main([str(QUICKSTART), "--run-dir", str(tmp_path), "--dry-run", "--full", "--set",
                 f"model={{name: 'file:{keras3_cnn_file}'}}"]) == 0
    line, = [x for x in unwrapped(capsys.readouterr().out) if x.startswith("model from ")]
    assert line.startswith(f"model from {keras3_cnn_file}: Keras 3 .keras, 9 layers, converted "
                           "to tf_keras (outputs equal Keras 3's to ") and "softmax taken off" in line
    cfg = quick_config(tmp_path, f"model={{name: 'file:{keras3_cnn_file}'}}", "train.epochs=0",
                       "export.tflite=none", "export.saved_model=false")
    summary = run(cfg)
    assert json.loads((tmp_path / "quickstart" / "summary.json").read_text())["model_source"] == \
        summary["model_source"]
