"""What an artifact's logits are measured against."""
import numpy as np

from tftrain.export.measures import ROUNDING_ULPS, rounding_noise


def test_rounding_noise_is_float_rounding_for_a_tame_model_and_large_for_an_amplifying_one():
    """A linear map moves its logits by about its inputs' rounding; a map with a large
    gain by far more; token ids have no rounding."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (64, 8)).astype("float32")
    w = rng.normal(size=(8, 4)).astype("float32")
    tame = x @ w
    assert 0 < rounding_noise(lambda v: v @ w, x, tame) <= 4 * ROUNDING_ULPS * 2.0 ** -24 * np.abs(x).sum(1).max() * np.abs(w).max()

    def amplifying(v):          # a gain of 1e7, as a deep untrained network can have
        return v[:, :4] * np.float32(1e7)
    loud = amplifying(x)
    assert rounding_noise(amplifying, x, loud) > 1.0
    assert rounding_noise(lambda v: v, np.arange(8)[None], np.arange(8)[None]) == 0.0


def test_layer_rounding_noise_rounds_inside_the_network_not_only_at_its_input():
    """A network that subtracts two nearly equal paths (x + 1 and 1) and amplifies the
    difference by 1e4: its input's rounding stays small relative to the output, but
    rounding at its inner layer (about 1 relative to 2^-24 x 1e4 x ...) moves its logits
    far more; an identity replay gives the model's own outputs."""
    from tftrain.core.keras import keras
    from tftrain.models.rounding import replay
    from tftrain.export.measures import layer_rounding_noise

    inputs = keras.Input((4,))
    shifted = keras.layers.Rescaling(1.0, offset=1000.0, name="shift")(inputs)
    back = keras.layers.Rescaling(1.0, offset=-1000.0, name="back")(shifted)
    net = keras.Model(inputs, keras.layers.Rescaling(1e4, name="gain")(back))
    x = np.random.default_rng(0).uniform(0.5, 1.0, (32, 4)).astype("float32")
    reference = net(x).numpy()
    np.testing.assert_allclose(replay(net, x, lambda name, v: v)[0], reference, rtol=1e-6)
    inner = layer_rounding_noise(net, x, reference)
    outer = rounding_noise(lambda v: net(v).numpy(), x, reference)
    # the inner layer holds ~1000: ROUNDING_ULPS units of its roundoff, times the gain
    assert inner >= ROUNDING_ULPS * 2.0 ** -24 * 1000 * 1e4 * 0.5 and inner > 100 * outer
    assert layer_rounding_noise(lambda v: v, x, x) == 0.0      # not a functional graph
