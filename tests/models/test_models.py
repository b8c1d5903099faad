"""Model registry: builders, custom builders, params, Keras 3 guard."""
import sys
import types

import numpy as np
import pytest

from tftrain.core.keras import ensure_tf_keras_model, keras
from tftrain.config import ConfigError, load_config
from tftrain.data import InputSpec
from tftrain.models import MODELS, build_model

IMAGES = InputSpec((8, 8, 1), "float32", 10)
TOKENS = InputSpec((16,), "int32", 5, vocab_size=100)


def mcfg(*sets):
    return load_config(None, list(sets)).model


@pytest.mark.parametrize("name,spec,params", [
    ("mlp", IMAGES, {"hidden": [16]}),
    ("cnn", IMAGES, {"filters": [8, 8, 8, 8], "batch_norm": True, "dropout": 0.1}),
    ("resnet", IMAGES, {"depth": 8, "width": 8}),
    ("resnet", IMAGES, {"depth": 8, "width": 8, "preact": True}),
    ("transformer", TOKENS, {"embed_dim": 16, "num_heads": 2, "num_layers": 1, "mlp_dim": 32}),
])
def test_builders_output_logits(name, spec, params):
    model = MODELS.get(name)(spec, **params)
    x = (np.random.rand(3, *spec.shape).astype(np.float32) if spec.vocab_size is None
         else np.random.randint(0, 100, (3, *spec.shape)))
    assert model(x).shape == (3, spec.num_classes)


def test_resnet_depth_and_batch_norm():
    model = MODELS.get("resnet")(IMAGES, depth=14, width=4)
    convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D) and "proj" not in l.name]
    assert len(convs) == 1 + 2 * 2 * 3                       # stem + 2 blocks x 2 convs x 3 stages
    assert any(isinstance(l, keras.layers.BatchNormalization) for l in model.layers)
    with pytest.raises(ValueError, match="depth must be 6n\\+2"):
        MODELS.get("resnet")(IMAGES, depth=10)


def test_the_preactivation_resnet_normalizes_before_each_convolution():
    """ResNetV2's order: every 3x3 convolution after the stem reads a ReLU of a batch
    norm, each block's sum is left as it is (an Add, no ReLU after it), and a batch norm
    and ReLU close the network; the same convolutions as the plain form."""
    from tftrain.models import layer_parents
    plain = MODELS.get("resnet")(IMAGES, depth=14, width=4)
    model = MODELS.get("resnet")(IMAGES, depth=14, width=4, preact=True)
    parents = layer_parents(model)
    convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
    assert len(convs) == len([l for l in plain.layers if isinstance(l, keras.layers.Conv2D)])
    assert all(parents[c.name] == ["ReLU"] for c in convs if c.name != "stem_conv")
    assert all("ReLU" not in parents[l.name] for l in model.layers
               if isinstance(l, keras.layers.Add))
    assert [type(l).__name__ for l in model.layers[-4:]] == [
        "BatchNormalization", "ReLU", "GlobalAveragePooling2D", "Dense"]
    assert model.name == "resnet14v2"


def test_custom_builder_by_module_path(monkeypatch):
    module = types.ModuleType("my_models")
    module.tiny = lambda spec, units=4: keras.Sequential(
        [keras.Input(spec.shape), keras.layers.Flatten(), keras.layers.Dense(units),
         keras.layers.Dense(spec.num_classes)])
    monkeypatch.setitem(sys.modules, "my_models", module)
    model = build_model(mcfg("model.name=my_models:tiny", "model.params={units: 3}"), IMAGES)
    assert model.count_params() == 64 * 3 + 3 + 3 * 10 + 10
    with pytest.raises(ConfigError, match="model.name: module 'my_models' has no function 'nope'"):
        build_model(mcfg("model.name=my_models:nope"), IMAGES)
    with pytest.raises(ConfigError, match="model.name: cannot import module 'no_such_mod'"):
        build_model(mcfg("model.name=no_such_mod:f"), IMAGES)
    # a built-in is named as no builder, before its parameters are checked against it
    with pytest.raises(ConfigError, match=r"^model\.name: os:system is a built-in function, not a "
                                          r"model builder; a builder is a Python function"):
        build_model(mcfg("model.name=os:system", "model.params={dense: [128]}"), IMAGES)


def test_a_bug_in_a_user_builder_is_not_a_config_error(monkeypatch):
    def buggy(spec, units=4):
        return keras.layers.Dense(units)(None, "oops")    # TypeError inside user code
    module = types.ModuleType("buggy_models")
    module.buggy = buggy
    monkeypatch.setitem(sys.modules, "buggy_models", module)
    with pytest.raises(TypeError) as info:
        build_model(mcfg("model.name=buggy_models:buggy"), IMAGES)
    assert not isinstance(info.value, ConfigError)
    assert info.traceback[-1].name != "build_model"   # raised in the user's code, kept as is


def test_unknown_param_and_transformer_needs_tokens():
    from tftrain.config import ModelConfig
    with pytest.raises(ConfigError, match=r"model\.params\.widht: unknown parameter of resnet in "
                                          r"tftrain/models/resnet\.py; did you mean width\?"):
        mcfg("model.name=resnet", "model.params={widht: 3}")       # read from its source
    # built from a config made in Python (not loaded): checked against the builder itself
    with pytest.raises(ConfigError, match=r"model\.params\.widht: unknown parameter; did you mean width\?"):
        build_model(ModelConfig(name="resnet", params={"widht": 3}), IMAGES)
    with pytest.raises(ConfigError, match="transformer needs token inputs"):
        build_model(mcfg("model.name=transformer"), IMAGES)


def test_keras3_model_is_refused_with_reason():
    fake = type("Sequential", (), {"__module__": "keras.src.models.sequential"})()
    with pytest.raises(TypeError, match="Keras 3 model .*tf_keras.*TF_USE_LEGACY_KERAS=1"):
        ensure_tf_keras_model(fake)
