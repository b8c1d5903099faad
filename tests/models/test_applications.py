"""Keras Applications backbones by name: local weights restored exactly, the backbone's
preprocessing inside the model, the frozen-backbone stage, and clear errors."""
import re

import numpy as np
import pytest

from tftrain.core.keras import keras
from tftrain.config import ModelConfig
from tftrain.data.source import InputSpec
from tftrain.models import build_model
from tftrain.models.applications import Preprocess, application
from tftrain.run import main

from helpers import ROOT, model_weights, quick_config

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
DIGITS_32 = "data.params={image_size: 32, channels: 3}"


@pytest.fixture(scope="module")
def backbone_file(tmp_path_factory):
    """A MobileNetV2 (alpha 0.35, 32x32) weights file with seeded random weights and
    non-trivial batch-norm statistics, standing in for a downloaded one."""
    keras.utils.set_random_seed(3)
    net = keras.applications.MobileNetV2(include_top=False, weights=None, input_shape=(32, 32, 3),
                                         alpha=0.35, pooling="avg")
    rng = np.random.default_rng(0)
    for layer in net.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.moving_mean.assign(rng.normal(size=layer.moving_mean.shape) * 0.1)
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, size=layer.moving_variance.shape))
    path = tmp_path_factory.mktemp("weights") / "mobilenet_v2_035_32_no_top.h5"
    net.save_weights(str(path))
    return path, {layer.name: [w.copy() for w in layer.get_weights()] for layer in net.layers
                  if layer.weights}


def test_weights_file_is_restored_exactly_and_preprocessing_is_the_backbones(backbone_file):
    path, saved = backbone_file
    spec = InputSpec((32, 32, 3), "float32", 10)
    model = build_model(ModelConfig(name="keras_applications:MobileNetV2",
                                    params={"weights": str(path), "alpha": 0.35}), spec)
    restored = 0
    for name, weights in saved.items():
        for a, b in zip(weights, model.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
            restored += 1
    assert restored > 200
    assert isinstance(model.get_layer("preprocess"), Preprocess)
    np.testing.assert_allclose(model.get_layer("preprocess")(np.array([[0.0, 0.5, 1.0]])).numpy(),
                               [[-1.0, 0.0, 1.0]])               # mobilenet_v2: "tf" mode
    assert model.layers[-1].name == "logits" and model.output_shape == (None, 10)


def test_a_backbone_cut_until_a_layer_holds_the_layers_up_to_it_with_their_weights(backbone_file):
    path, saved = backbone_file
    spec = InputSpec((32, 32, 3), "float32", 10)
    model = build_model(ModelConfig(name="keras_applications:MobileNetV2", params={
        "weights": str(path), "alpha": 0.35, "until": "block_2_add"}), spec)
    whole = keras.applications.MobileNetV2(include_top=False, weights=None, input_shape=(32, 32, 3),
                                           alpha=0.35)
    upto = [layer.name for layer in whole.layers]
    upto = upto[1:upto.index("block_2_add") + 1]          # (no layer of a later block feeds it)
    assert [layer.name for layer in model.layers] == \
        ["inputs", "preprocess", *upto, "block_2_add_pool", "head_dropout", "logits"]
    for name in upto:
        for a, b in zip(saved.get(name, []), model.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)           # the file's weights, as whole
    assert model.get_layer("block_2_add_pool").output_shape == (None, 8)   # block 2: 8 channels
    assert model.output_shape == (None, 10)


@pytest.mark.parametrize("name", ["ConvNeXtTiny", "RegNetX002"])
def test_a_backbone_that_skips_its_input_tensor_still_reads_the_preprocessed_image(name):
    """tf_keras' ConvNeXt and RegNet build on the `Input` under `input_tensor`, skipping
    what came between: made again on the preprocessing's output, the model computes on
    [0, 1] images what the backbone computes on the same images as [0, 255] (ConvNeXt
    had seen [0, 1] as [0, 255] and trained at chance)."""
    keras.utils.set_random_seed(0)
    model = application(name)(InputSpec((32, 32, 3), "float32", 10), dropout=0)
    backbone = getattr(keras.applications, name)(include_top=False, weights=None,
                                                 input_shape=(32, 32, 3), pooling="avg")
    ours = [layer for layer in model.layers if layer.weights and layer.name != "logits"]
    theirs = [layer for layer in backbone.layers if layer.weights]
    assert [type(a) for a in ours] == [type(b) for b in theirs] and len(ours) > 20
    for a, b in zip(ours, theirs):
        b.set_weights(a.get_weights())
    x = np.random.default_rng(0).uniform(0, 1, (2, 32, 32, 3)).astype("float32")
    want = model.get_layer("logits")(backbone(x * 255.0)).numpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(model(x).numpy(), want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("sets,pattern", [
    (["model={name: 'keras_applications:MobileNetV2', params: {alpha: 0.35, until: block_99_add}}"], r"model\.params: .*until: the backbone has no layer 'block_99_add'"),
    (["model={name: 'keras_applications:MobileNetV2', params: {alpha: 0.35, until: block_2_add, pooling: null}}"], r"model\.params: .*until: pooling must be avg or max"),
    (["model.name=keras_applications:MobileNetV9"], r"model\.name: keras\.applications has no model 'MobileNetV9'; known: .*MobileNetV2"),
    (["model={name: 'keras_applications:MobileNetV2', params: {weights: /nope/w.h5}}"], r"model\.params: .*weights file /nope/w\.h5 does not exist"),
    (["model={name: 'keras_applications:MobileNetV2', params: {alpha: 0.35}}", "train.freeze={layers: [nope]}"], r"train\.freeze\.layers\[0\]: rule 'nope' matches no layer"),
])
def test_bad_applications_exit_2(tmp_path, capsys, sets, pattern):
    runs = tmp_path / "runs"
    sets = [DIGITS_32, *sets]
    assert main([str(QUICKSTART), "--run-dir", str(runs), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err
    assert "Traceback" not in err and not runs.exists()


@pytest.mark.slow
def test_frozen_phase_keeps_the_backbone_then_fine_tuning_trains_it(tmp_path, backbone_file):
    from tftrain.run import run
    path, saved = backbone_file
    summary = run(quick_config(
        tmp_path, "run.name=ft", DIGITS_32, "distribute.strategy=default",
        f"model={{name: 'keras_applications:MobileNetV2', params: {{weights: {path}, alpha: 0.35, "
        "until: block_2_add}}", "train.freeze={epochs: 1, learning_rate: 0.01}", "train.epochs=2",
        "export.tflite=none", "export.saved_model=false"))
    assert list(summary["stages"]) == ["frozen", "train"]
    assert summary["steps"] == summary["stages"]["train"]["updates"]
    frozen = model_weights(tmp_path / "ft", "frozen")
    trained = model_weights(tmp_path / "ft")
    first_kernel = "model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    bn_mean = "model/layer_with_weights-1/moving_mean/.ATTRIBUTES/VARIABLE_VALUE"
    head = [n for n in frozen if "kernel" in n and frozen[n].ndim == 2 and frozen[n].shape[1] == 10]
    np.testing.assert_array_equal(frozen[first_kernel], saved["Conv1"][0])     # frozen exactly
    np.testing.assert_array_equal(frozen[bn_mean], saved["bn_Conv1"][2])       # BN statistics too
    assert not np.array_equal(trained[first_kernel], saved["Conv1"][0])       # then fine-tuned
    assert head and all(np.isfinite(frozen[n]).all() for n in head)
    loss = np.genfromtxt(tmp_path / "ft" / "metrics.csv", delimiter=",", names=True)["loss"]
    assert loss[-1] < loss[0] - 0.1, loss                      # fine-tuning learns
