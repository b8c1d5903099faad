"""Keras 3 models converted to tf_keras layer by layer, weights included, and back."""
import numpy as np
import pytest

from tftrain.core.keras import keras, keras3
from tftrain.models import keras3 as convert


def image_model():
    """A Keras 3 CNN with the layers the conversion must map: rescaling, convolutions,
    batch norm (statistics set away from their defaults), depthwise and separable
    convolutions, a residual add, a leaky ReLU (negative_slope becomes alpha), pooling,
    dropout and dense layers."""
    k3 = keras3()
    inputs = k3.Input((8, 8, 1), name="inputs")
    x = k3.layers.Rescaling(1 / 16.0)(inputs)
    x = k3.layers.ZeroPadding2D(1)(x)
    x = k3.layers.Conv2D(8, 3, use_bias=False, name="conv")(x)
    x = k3.layers.BatchNormalization(name="bn")(x)
    x = k3.layers.ReLU()(x)
    y = k3.layers.DepthwiseConv2D(3, padding="same", activation="relu")(x)
    x = k3.layers.Add()([x, y])
    x = k3.layers.SeparableConv2D(8, 3, padding="same")(x)
    x = k3.layers.LeakyReLU(negative_slope=0.1, name="leaky_re_lu")(x)
    x = k3.layers.Conv2DTranspose(4, 2, strides=2)(x)
    x = k3.layers.AveragePooling2D(2)(x)
    x = k3.layers.MaxPooling2D(2)(x)
    x = k3.layers.Flatten()(x)
    x = k3.layers.Dropout(0.3)(x)
    model = k3.Model(inputs, k3.layers.Dense(10, name="logits")(x))
    rng = np.random.default_rng(0)
    bn = model.get_layer("bn")
    bn.set_weights([rng.uniform(0.5, 1.5, 8).astype("float32") for _ in bn.get_weights()])
    return model


def transformer_block():
    k3 = keras3()
    tokens = k3.Input((16,), dtype="int32", name="tokens")
    e = k3.layers.Embedding(200, 16, name="embed")(tokens)
    h = k3.layers.LayerNormalization()(e)
    h = k3.layers.MultiHeadAttention(2, 8, name="attention")(h, h)
    h = k3.layers.Add()([e, h])
    h = k3.layers.LayerNormalization()(h)
    h = k3.layers.Dense(32, activation="gelu")(h)
    h = k3.layers.Dense(16)(h)
    h = k3.layers.Concatenate()([h, e])
    h = k3.layers.GlobalAveragePooling1D()(h)
    return k3.Model(tokens, k3.layers.Dense(4, name="logits")(h))


def _agree(original, converted, x, atol=1e-5):
    a = np.asarray(original(x, training=False))
    b = converted(x, training=False).numpy()
    scale = max(1.0, float(np.abs(a).max()))
    np.testing.assert_allclose(b, a, rtol=0, atol=atol * scale)
    return float(np.abs(a - b).max())


def test_an_image_model_converts_with_its_weights_to_1e5():
    original = image_model()
    converted = convert.to_tf_keras(original)
    assert isinstance(converted, keras.Model)
    assert [type(l).__name__ for l in converted.layers] == [type(l).__name__ for l in original.layers]
    assert converted.get_layer("leaky_re_lu").alpha == pytest.approx(0.1)
    x = np.random.default_rng(1).uniform(0, 16, (32, 8, 8, 1)).astype("float32")
    _agree(original, converted, x)
    # weights copied, not initialized alike: the batch norm's statistics came along
    np.testing.assert_array_equal(converted.get_layer("bn").get_weights()[2],
                                  original.get_layer("bn").get_weights()[2])


def test_a_transformer_block_converts_to_1e5():
    original = transformer_block()
    converted = convert.to_tf_keras(original)
    x = np.random.default_rng(2).integers(0, 200, (8, 16)).astype("int32")
    _agree(original, converted, x)


def test_keras3_mobilenetv2_converts_to_1e5():
    k3 = keras3()
    original = k3.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                           classes=10, classifier_activation=None)
    converted = convert.to_tf_keras(original)
    assert len(converted.layers) == len(original.layers)
    x = np.random.default_rng(3).uniform(-1, 1, (4, 32, 32, 3)).astype("float32")
    _agree(original, converted, x)


def test_a_sequential_model_converts_and_comes_back_as_keras3():
    k3 = keras3()
    original = k3.Sequential([k3.Input((6,)), k3.layers.Dense(5, activation="relu"),
                              k3.layers.Dense(3)])
    converted = convert.to_tf_keras(original)
    back = convert.to_keras3(converted)
    assert convert.is_keras3(back) and not convert.is_keras3(converted)
    x = np.random.default_rng(4).normal(size=(4, 6)).astype("float32")
    np.testing.assert_allclose(np.asarray(back(x)), np.asarray(original(x)), atol=1e-6)


def test_the_image_model_round_trips_through_tf_keras_and_saves_as_keras3(tmp_path):
    original = image_model()
    back = convert.to_keras3(convert.to_tf_keras(original))
    path = tmp_path / "model.keras"
    back.save(str(path))
    loaded = keras3().saving.load_model(str(path), compile=False)
    x = np.random.default_rng(5).uniform(0, 16, (8, 8, 8, 1)).astype("float32")
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(original(x)), atol=1e-5)


class Scale(keras3().layers.Layer):
    """A Keras 3 layer of the user's own: nothing says what tf_keras layer it is."""

    def call(self, x):
        return x * 2.0


def test_what_cannot_be_converted_is_named_with_what_to_do():
    k3 = keras3()
    inputs = k3.Input((4,))
    custom = k3.Model(inputs, k3.layers.Dense(2)(Scale(name="scale")(inputs)))
    assert convert.refusal(custom) == [
        "layer scale (Scale, from test_keras3) has no tf_keras form tftrain knows; rewrite it "
        "with tf_keras, or register a converter (tftrain.models.keras3.register_converter)"]
    with pytest.raises(ValueError, match="layer scale \\(Scale"):
        convert.to_tf_keras(custom)
    op = k3.Model(inputs, k3.ops.sin(k3.layers.Dense(2)(inputs)))
    assert convert.refusal(op) == [
        "sin is a Keras op (Sin) applied to tensors, not a layer tftrain converts (it converts "
        "+, -, * and / with a constant and +, -, * between tensors); use the layer form "
        "(e.g. keras.layers.Add) or register a converter"]

    class Subclassed(k3.Model):
        def call(self, x):
            return x
    assert "subclassed Keras 3 model" in convert.refusal(Subclassed())[0]
    setting = k3.Model(inputs, k3.layers.LayerNormalization(rms_scaling=True, name="norm")(inputs))
    assert convert.refusal(setting) == [
        "layer norm (LayerNormalization): rms_scaling=True has no tf_keras form"]


def test_a_registered_converter_converts_a_layer_of_your_own():
    k3 = keras3()
    inputs = k3.Input((4,))
    model = k3.Model(inputs, k3.layers.Dense(2, name="d")(Scale(name="scale")(inputs)))
    convert.register_converter("Scale", lambda layer: keras.layers.Rescaling(2.0, name=layer.name))
    try:
        assert convert.refusal(model) == []
        converted = convert.to_tf_keras(model)
        x = np.ones((2, 4), "float32")
        np.testing.assert_allclose(converted(x).numpy(), np.asarray(model(x)), atol=1e-6)
    finally:
        convert._CONVERTERS.pop("Scale")


def test_arithmetic_on_tensors_converts_as_keras_applications_write_it():
    """Keras 3 ops on tensors (MobileNetV3's `ReLU(6)(x + 3) * (1 / 6)`, a constant on
    either side, two tensors) become tf_keras layers that compute the same, to 1e-6."""
    import numpy as np
    from tftrain.models.hard_swish import HardSigmoid, HardSwish
    from tftrain.models.tensor_ops import as_layers
    k3 = keras3()
    inputs = k3.Input((6,))
    x = k3.layers.Dense(6, name="d")(inputs)
    gate = k3.layers.ReLU(6.0)(x + 3.0) * (1.0 / 6.0)
    y = (1.0 - x) / 4.0 + x * gate - (x - 2.0) * x
    model = k3.Model(inputs, k3.layers.Dense(3, name="head")(y))
    assert convert.refusal(model) == []
    converted, diff = convert.checked(model, "arithmetic")
    kinds = sorted(type(layer).__name__ for layer in converted.layers)
    assert kinds.count("Rescaling") == 5 and kinds.count("Multiply") == 2 and "Subtract" in kinds
    sample = np.random.default_rng(0).uniform(-4, 4, (32, 6)).astype("float32")
    expected = np.asarray(model(sample))
    assert np.abs(converted(sample).numpy() - expected).max() <= 1e-6 * np.abs(expected).max()
    fused = as_layers(converted)      # x * (ReLU(6)(x + 3) * 1/6): one layer, a hard-swish
    assert [type(layer) for layer in fused.layers].count(HardSwish) == 1
    assert not any(isinstance(layer, HardSigmoid) for layer in fused.layers)
    assert np.abs(fused(sample).numpy() - expected).max() <= 1e-6 * np.abs(expected).max()


def test_layers_keras_applications_define_and_nested_models_convert():
    """ConvNeXt's LayerScale and StochasticDepth (Keras Applications' own layers) become
    tf_keras' classes of the same name, its Sequential stem and downsampling blocks are
    inlined, and the model comes back to Keras 3 computing the same."""
    import numpy as np
    k3 = keras3()
    inputs = k3.Input((32, 32, 3))
    from keras.src.applications.convnext import ConvNeXt      # ConvNeXtTiny, made small
    backbone = ConvNeXt(depths=[1, 2, 1, 1], projection_dims=[8, 16, 24, 32], drop_path_rate=0.1,
                        include_top=False, weights=None, input_tensor=inputs, pooling="avg",
                        layer_scale_init_value=0.5, name="convnext_small_test")
    model = k3.Model(inputs, k3.layers.Dense(10, name="head")(backbone.output))
    kinds = [type(layer).__name__ for layer in model.layers]
    assert "Sequential" in kinds and "LayerScale" in kinds and convert.refusal(model) == []
    converted, _ = convert.checked(model, "convnext")
    flat = [type(layer).__name__ for layer in converted.layers]
    assert "Sequential" not in flat and flat.count("LayerScale") == 5 and "StochasticDepth" in flat
    assert type(converted.get_layer(next(l.name for l in model.layers if type(l).__name__ == "LayerScale"))
                ).__module__.startswith("tf_keras")
    x = np.random.default_rng(0).uniform(0, 1, (4, 32, 32, 3)).astype("float32")
    expected = np.asarray(model(x))
    assert np.abs(converted(x).numpy() - expected).max() <= 1e-5 * np.abs(expected).max()
    back = convert.to_keras3(converted)
    assert np.abs(np.asarray(back(x)) - expected).max() <= 1e-5 * np.abs(expected).max()


def test_a_nested_model_of_two_inputs_takes_each_where_it_is_called():
    """A functional model of two inputs used inside another, called with its inputs in
    the other order than they were made: inlined, each input is the tensor passed for it."""
    import numpy as np
    k3 = keras3()
    a, b = k3.Input((4,), name="a"), k3.Input((4,), name="b")
    inner = k3.Model([a, b], k3.layers.Subtract(name="minus")([k3.layers.Dense(3, name="da")(a),
                                                              k3.layers.Dense(3, name="db")(b)]))
    x = k3.Input((4,), name="x")
    y = k3.layers.Dense(4, name="dy")(x)
    model = k3.Model(x, inner([y, x]))
    converted, _ = convert.checked(model, "nested")
    assert {"da", "db", "minus", "dy"} <= {layer.name for layer in converted.layers}
    sample = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    assert np.abs(converted(sample).numpy() - np.asarray(model(sample))).max() <= 1e-5


def test_a_model_of_many_layers_without_a_form_is_one_problem_of_a_few_short_lines():
    """40 custom layers: one problem, printed with its prefix once, the first three layers
    named and the rest counted, every line within 120 columns, the continuation indented."""
    from tftrain.config import ConfigError
    from tftrain.core import console
    from tftrain.models.registry import tf_keras_model
    k3 = keras3()
    inputs = k3.Input((4,))
    h = inputs
    for i in range(40):
        h = Scale(name=f"scale_{i}")(h)
    with pytest.raises(ConfigError) as refused:
        tf_keras_model(k3.Model(inputs, h), "many:scales")
    problem, = refused.value.problems
    printed = console.problem("tftrain: config error: ", problem).splitlines()
    assert printed[0] == "tftrain: config error: model.name: many:scales is a Keras 3 model:"
    assert len(printed) <= 10 and max(map(len, printed)) <= 120, printed
    assert all(line.startswith("    ") for line in printed[1:]) and printed[-1] == "    and 37 more"
    assert [line for line in printed if "layer scale_" in line] == [
        f"    layer scale_{i} (Scale, from test_keras3) has no tf_keras form tftrain knows; rewrite "
        "it with tf_keras, or register a" for i in range(3)]
