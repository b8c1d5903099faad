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
