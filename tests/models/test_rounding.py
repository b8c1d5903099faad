"""A functional model's own float32 rounding, replayed layer by layer."""
import numpy as np

from tftrain.core.keras import keras
from tftrain.models.rounding import ULPS, layer_noise, replay


def test_a_replay_gives_the_models_outputs_and_rounding_inside_is_amplified_by_the_gain():
    """Identity at every layer: the model's own outputs. Each layer moved by ULPS units of
    roundoff: a network whose inner layer holds ~1000 and whose last layer multiplies by
    1e4 moves its outputs by about ULPS x 2^-24 x 1000 x 1e4, far above input rounding."""
    inputs = keras.Input((4,))
    shifted = keras.layers.Rescaling(1.0, offset=1000.0, name="shift")(inputs)
    back = keras.layers.Rescaling(1.0, offset=-1000.0, name="back")(shifted)
    net = keras.Model(inputs, keras.layers.Rescaling(1e4, name="gain")(back))
    x = np.random.default_rng(0).uniform(0.5, 1.0, (32, 4)).astype("float32")
    reference = net(x).numpy()
    seen = []
    out = replay(net, x, lambda name, value: seen.append(name) or value)
    np.testing.assert_allclose(out[0], reference, rtol=1e-6)
    assert seen == ["shift", "back", "gain"]
    noise = layer_noise(net, x, reference)
    assert ULPS * 2.0 ** -24 * 1000 * 1e4 * 0.5 <= noise <= ULPS * 2.0 ** -24 * 1001 * 1e4 * 4
    assert layer_noise(lambda v: v, x, x) == 0.0          # not a functional graph


def test_a_replayed_layer_can_be_called_again_on_its_inputs_moved():
    """`again` calls the layer once more on each input passed through `perturb`, which is
    told which layer made it (None: the model's input): a layer reading one tensor twice
    gets it moved alike in both places."""
    inputs = keras.Input((3,))
    doubled = keras.layers.Rescaling(2.0, name="double")(inputs)
    squared = keras.layers.Multiply(name="square")([doubled, doubled])
    net = keras.Model(inputs, keras.layers.Add(name="sum")([squared, inputs]))
    x = np.array([[1.0, 2.0, 3.0]], "float32")
    makers, again_of = [], {}

    def each(name, value, again):
        again_of[name] = again(lambda maker, v: makers.append((name, maker)) or v + 1.0)
        return value
    out = replay(net, x, each, again=True)
    np.testing.assert_allclose(out[0], [[5.0, 18.0, 39.0]])
    np.testing.assert_allclose(again_of["double"], [[4.0, 6.0, 8.0]])       # 2 (x + 1)
    np.testing.assert_allclose(again_of["square"], [[9.0, 25.0, 49.0]])     # (2x + 1)^2
    np.testing.assert_allclose(again_of["sum"], [[7.0, 20.0, 41.0]])   # (4x^2 + 1) + (x + 1)
    assert makers == [("double", None), ("square", "double"), ("sum", "square"), ("sum", None)]
