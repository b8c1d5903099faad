"""A model from a file (`model.name: file:PATH`): read by the Keras that wrote it, checked
against the data, given as logits."""
import json
import zipfile

import numpy as np
import pytest

from tftrain.config import ConfigError
from tftrain.core.keras import keras, keras3
from tftrain.data import InputSpec
from tftrain.models import files

DIGITS = InputSpec((8, 8, 1), "float32", 10)


def tf_keras_cnn(softmax=False):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(10, activation="softmax" if softmax else None)(x))


def keras3_cnn(softmax_layer=False):
    k3 = keras3()
    inputs = k3.Input((8, 8, 1))
    x = k3.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    x = k3.layers.Flatten()(x)
    x = k3.layers.Dense(10)(x)
    return k3.Model(inputs, k3.layers.Softmax()(x) if softmax_layer else x)


X = np.random.default_rng(0).uniform(0, 1, (32, 8, 8, 1)).astype("float32")


@pytest.mark.parametrize("form", ["model.h5", "model.keras", "saved_model"])
def test_a_tf_keras_file_is_restored_exactly(tmp_path, form):
    original = tf_keras_cnn()
    bn = original.layers[2]
    bn.set_weights([w + 0.3 for w in bn.get_weights()])          # statistics kept too
    path = tmp_path / form
    original.save(str(path))
    model = files.builder(str(path))(DIGITS)
    np.testing.assert_allclose(model(X).numpy(), original(X).numpy(), rtol=0, atol=1e-6)
    found = files.origin(f"file:{path}")
    assert (found.writer, found.form) == ("tf_keras", {"model.h5": ".h5", "model.keras": ".keras",
                                                       "saved_model": "SavedModel"}[form])


def test_a_file_is_read_once_a_process_and_each_build_is_a_model_of_its_own(
        tmp_path, monkeypatch):
    """The plan builds the model twice: the Keras 3 file is read and converted once, the
    second build is a copy with its own variables (training one leaves the other as the
    file is), and a file written again is read again."""
    original = keras3_cnn(softmax_layer=True)
    path = tmp_path / "model.keras"
    original.save(str(path))
    reads = []
    load = files.load
    monkeypatch.setattr(files, "load", lambda *a, **k: reads.append(a[0]) or load(*a, **k))
    first, second = (files.builder(str(path))(DIGITS) for _ in range(2))
    assert reads == [str(path)] and first is not second
    assert {id(v) for v in first.weights}.isdisjoint(id(v) for v in second.weights)
    np.testing.assert_array_equal(first(X).numpy(), second(X).numpy())
    first.layers[-1].kernel.assign_add(np.ones(first.layers[-1].kernel.shape, "float32"))
    np.testing.assert_allclose(keras.activations.softmax(second(X)).numpy(),
                               np.asarray(original(X)), rtol=0, atol=1e-5)
    assert files.origin(f"file:{path}").softmax_removed
    import os
    os.utime(path, ns=(1, 1))                    # written again (another time stamp)
    files.builder(str(path))(DIGITS)
    assert reads == [str(path)] * 2
    files.builder(str(path), trust_code=True)(DIGITS)     # trusted: checked as such again
    assert reads == [str(path)] * 3


def test_a_keras3_file_is_converted_and_its_softmax_taken_off(tmp_path):
    original = keras3_cnn(softmax_layer=True)
    path = tmp_path / "model.keras"
    original.save(str(path))
    model = files.builder(str(path))(DIGITS)
    assert isinstance(model, keras.Model) and type(model.layers[-1]).__name__ == "Dense"
    probabilities = np.asarray(original(X))
    np.testing.assert_allclose(keras.activations.softmax(model(X)).numpy(), probabilities,
                               atol=1e-6)
    found = files.origin(f"file:{path}")
    assert found.writer == "keras3" and found.softmax_removed and found.converted_diff < 1e-6
    assert "converted to tf_keras" in found.describe()


def test_a_dense_softmax_head_gives_logits():
    model, removed = files.to_logits(tf_keras_cnn(softmax=True))
    assert removed and model.layers[-1].activation.__name__ == "linear"
    again, removed = files.to_logits(model)
    assert again is model and not removed


def test_a_model_that_does_not_take_the_data_is_a_config_error(tmp_path):
    path = tmp_path / "model.keras"
    tf_keras_cnn().save(str(path))
    with pytest.raises(ConfigError, match=r"takes inputs of shape \(8, 8, 1\), but the data's "
                                          r"examples are \(32, 32, 3\)"):
        files.builder(str(path))(InputSpec((32, 32, 3), "float32", 10))
    with pytest.raises(ConfigError, match=r"gives 10 outputs, but the data has 4 classes"):
        files.builder(str(path))(InputSpec((8, 8, 1), "float32", 4))


def test_a_custom_keras3_layer_in_a_file_is_named_before_anything_is_loaded(tmp_path):
    """The layer's class is read from the file's config: the module that defined it is
    not needed (and not imported)."""
    path = tmp_path / "model.keras"
    keras3_cnn().save(str(path))
    with zipfile.ZipFile(path) as z:
        parts = {n: z.read(n) for n in z.namelist()}
    config = json.loads(parts["config.json"])
    config["config"]["layers"][1].update({"class_name": "MyConv", "module": "my_layers",
                                          "registered_name": "MyPackage>MyConv"})
    parts["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in parts.items():
            z.writestr(name, data)
    layer = config["config"]["layers"][1]["config"]["name"]
    with pytest.raises(ConfigError, match=rf"layer {layer} \(MyPackage>MyConv\) is not a Keras "
                                          r"built-in layer tftrain can convert; rewrite it with "
                                          r"tf_keras, or register a converter"):
        files.load(str(path))


def test_unreadable_paths_are_config_errors(tmp_path):
    import tensorflow as tf

    with pytest.raises(ConfigError, match="does not exist"):
        files.load(str(tmp_path / "nope.keras"))
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"expected a \.keras or \.h5 file or a SavedModel"):
        files.load(str(tmp_path / "x.txt"))
    module = tf.Module()
    module.v = tf.Variable(1.0)
    tf.saved_model.save(module, str(tmp_path / "plain"))
    with pytest.raises(ConfigError, match="a SavedModel without a Keras model in it"):
        files.load(str(tmp_path / "plain"))


def test_the_layers_follow_the_runs_precision_policy(tmp_path):
    path = tmp_path / "model.keras"
    tf_keras_cnn().save(str(path))
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = files.builder(str(path))(DIGITS)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert {layer.dtype_policy.name for layer in model.layers[1:]} == {"mixed_bfloat16"}
