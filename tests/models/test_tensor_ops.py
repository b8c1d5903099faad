"""Operations on tensors made layers (`tftrain.models.tensor_ops`): what Keras
Applications write as ops becomes layers that compute the same."""
from types import SimpleNamespace

import numpy as np
import pytest

from tftrain.core.keras import keras
from tftrain.models.applications import application
from tftrain.models.hard_swish import HardSigmoid, HardSwish
from tftrain.models.tensor_ops import affine_of, as_layers

SPEC = SimpleNamespace(shape=(32, 32, 3), num_classes=10)


def _same(a, b, x) -> float:
    """The largest difference of two models' outputs on `x`, relative to their scale."""
    ya, yb = a(x, training=False).numpy(), b(x, training=False).numpy()
    return float(np.abs(ya - yb).max() / max(np.abs(ya).max(), 1e-30))


def _kinds(model) -> list[str]:
    return [type(layer).__name__ for layer in model.layers]


@pytest.mark.parametrize("minimalistic", [False, True], ids=["full", "minimalistic"])
def test_mobilenet_v3_hard_swish_and_hard_sigmoid_become_layers(minimalistic):
    """tf_keras' MobileNetV3Small writes `ReLU(6)(x + 3) * (1/6)` with TFOpLambda layers
    (54 of them): none is left; 18 hard-swishes and 9 squeeze-excite gates (none in the
    minimalistic form, which has neither) compute what the ops did."""
    keras.utils.set_random_seed(0)
    model = application("MobileNetV3Small")(SPEC, minimalistic=minimalistic, alpha=0.75)
    rewritten = as_layers(model)
    kinds = _kinds(rewritten)
    assert "TFOpLambda" not in kinds and "Preprocess" not in kinds
    if minimalistic:
        assert (kinds.count("HardSwish"), kinds.count("HardSigmoid")) == (0, 0)
        assert _kinds(model).count("TFOpLambda") == 0
    else:
        assert _kinds(model).count("TFOpLambda") == 54
        assert (kinds.count("HardSwish"), kinds.count("HardSigmoid")) == (18, 9)
    x = np.random.default_rng(0).uniform(0, 1, (8, 32, 32, 3)).astype("float32")
    assert _same(model, rewritten, x) <= 1e-5


def test_input_affine_layers_merge_into_one_or_vanish():
    """EfficientNetB0's `Preprocess` (x 255), `Rescaling` (/ 255) and untrained
    `Normalization` cancel out and vanish; a normalization with statistics after a
    rescaling becomes one per-channel Rescaling computing the same."""
    model = application("EfficientNetB0")(SPEC)
    assert not {"Preprocess", "Rescaling", "Normalization"} & set(_kinds(as_layers(model)))
    inputs = keras.Input((4, 4, 3))
    x = keras.layers.Rescaling(1 / 127.5, -1.0, name="scale")(inputs)
    x = keras.layers.Normalization(mean=[0.1, -0.2, 0.3], variance=[4.0, 0.25, 1.0], name="norm")(x)
    net = keras.Model(inputs, keras.layers.Conv2D(2, 1, name="conv")(x))
    merged = as_layers(net)
    assert _kinds(merged) == ["InputLayer", "Rescaling", "Conv2D"]
    scale, offset = affine_of(merged.layers[1])
    assert np.allclose(scale, [1 / 255, 2 / 127.5, 1 / 127.5]) and np.allclose(offset, [-0.55, -1.6, -1.3])
    sample = np.random.default_rng(1).uniform(0, 255, (4, 4, 4, 3)).astype("float32")
    assert _same(net, merged, sample) <= 1e-6


def test_a_hard_sigmoid_read_elsewhere_too_stays_computed_and_a_model_without_forms_is_the_same():
    """A gate also read by another layer is one `HardSigmoid` read by both; a model with
    none of the forms is returned as it is (the same object)."""
    import tensorflow as tf
    inputs = keras.Input((6,))
    x = keras.layers.Dense(6, name="d")(inputs)
    gate = keras.layers.ReLU(6.0)(x + 3.0) * (1.0 / 6.0)
    out = keras.layers.Concatenate()([keras.layers.Multiply()([x, gate]), gate])
    net = keras.Model(inputs, keras.layers.Dense(2, name="head")(out))
    rewritten = as_layers(net)
    assert [type(layer) for layer in rewritten.layers].count(HardSwish) == 1
    assert [type(layer) for layer in rewritten.layers].count(HardSigmoid) == 1
    sample = np.random.default_rng(2).uniform(-5, 5, (16, 6)).astype("float32")
    assert _same(net, rewritten, sample) <= 1e-6
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3), keras.layers.Lambda(tf.math.sin)])
    assert as_layers(plain) is plain


def test_efficientnet_squeeze_excite_pools_with_kept_dims_and_its_convolutions_split_their_activations():
    """EfficientNetB0's 16 squeeze-excite blocks: `GlobalAveragePooling2D -> Reshape((1, 1,
    C))` becomes the pooling with `keepdims` (no reshape left), and each
    `Conv2D(activation="swish"/"sigmoid")` a linear convolution and an `Activation`, the
    model computing the same."""
    keras.utils.set_random_seed(0)
    model = application("EfficientNetB0")(SPEC)
    rewritten = as_layers(model)
    kinds = _kinds(rewritten)
    assert "Reshape" not in kinds and _kinds(model).count("Reshape") == 16
    kept = [layer for layer in rewritten.layers
            if isinstance(layer, keras.layers.GlobalAveragePooling2D) and layer.keepdims]
    assert len(kept) == 16
    reduce = rewritten.get_layer("block1a_se_reduce")
    assert keras.activations.serialize(reduce.activation) == "linear"
    assert rewritten.get_layer("block1a_se_reduce_activation").get_config()["activation"] == "swish"
    assert all(keras.activations.serialize(layer.activation) in ("linear", "relu")
               for layer in rewritten.layers if isinstance(layer, keras.layers.Conv2D))
    x = np.random.default_rng(0).uniform(0, 1, (8, 32, 32, 3)).astype("float32")
    assert _same(model, rewritten, x) <= 1e-5


def test_a_nested_sequential_is_inlined_and_a_sum_of_two_tensors_becomes_an_add():
    """ConvNeXt's form in tf_keras: a `Sequential` stem called inside the model and a
    residual written `x + y` (a `TFOpLambda`): the stem's layers become the model's, the
    sum an `Add`, with the same weights and outputs (tfmot refused both, 22 layers of
    tf_keras' ConvNeXtTiny)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    stem = keras.Sequential([keras.layers.Conv2D(8, 3, padding="same", name="stem_conv"),
                             keras.layers.LayerNormalization(name="stem_norm")], name="stem")
    x = stem(inputs)
    y = keras.layers.Conv2D(8, 1, name="branch")(x)
    x = keras.layers.GlobalAveragePooling2D()(x + y)
    model = keras.Model(inputs, keras.layers.Dense(4)(x))
    assert _kinds(model).count("TFOpLambda") == 1 and "Sequential" in _kinds(model)
    rewritten = as_layers(model)
    assert _kinds(rewritten) == ["InputLayer", "Conv2D", "LayerNormalization", "Conv2D", "Add",
                                 "GlobalAveragePooling2D", "Dense"]
    assert rewritten.get_layer("stem_conv").get_weights()[0].tolist() == \
        stem.get_layer("stem_conv").get_weights()[0].tolist()
    x = np.random.default_rng(0).normal(size=(3, 8, 8, 3)).astype("float32")
    assert _same(model, rewritten, x) == 0.0


def test_a_sequential_called_twice_keeps_its_shared_weights_whole():
    keras.utils.set_random_seed(0)
    shared = keras.Sequential([keras.layers.Dense(4, name="shared_dense")], name="shared")
    a, b = keras.Input((3,)), keras.Input((3,))
    model = keras.Model([a, b], keras.layers.Add()([shared(a), shared(b)]))
    rewritten = as_layers(model)
    assert rewritten is model and "Sequential" in _kinds(rewritten)


def test_a_convolution_grouped_by_channel_becomes_a_depthwise_one_and_others_stay():
    """ConvNeXt's 7x7 convolution with a group per channel (strided, biased, with an
    activation here) becomes a `DepthwiseConv2D` of the same name, kernel (7, 7, 1, 16)
    read as (7, 7, 16, 1), same outputs; a convolution grouped in fewer groups, or one
    whose groups are not its filters, stays a `Conv2D`."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((9, 9, 16))
    x = keras.layers.Conv2D(16, 7, strides=2, padding="same", groups=16, activation="relu",
                            name="dw")(inputs)
    x = keras.layers.Conv2D(16, 3, padding="same", groups=4, name="grouped")(x)
    x = keras.layers.Conv2D(32, 3, padding="same", groups=16, name="wider")(x)
    model = keras.Model(inputs, x)
    rewritten = as_layers(model)
    assert _kinds(rewritten) == ["InputLayer", "DepthwiseConv2D", "Conv2D", "Conv2D"]
    dw = rewritten.get_layer("dw")
    assert dw.depth_multiplier == 1 and dw.strides == (2, 2) and dw.activation.__name__ == "relu"
    assert dw.depthwise_kernel.shape == (7, 7, 16, 1)
    np.testing.assert_array_equal(dw.depthwise_kernel.numpy()[:, :, 5, 0],
                                  model.get_layer("dw").kernel.numpy()[:, :, 0, 5])
    x = np.random.default_rng(0).normal(size=(4, 9, 9, 16)).astype("float32")
    assert _same(model, rewritten, x) <= 1e-5
