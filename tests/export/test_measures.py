"""What an artifact's logits are measured against."""
import numpy as np
import pytest

from tftrain.export.measures import ROUNDING_ULPS, against, rounding_noise


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


def test_an_artifacts_layer_rounding_noise_is_the_models_and_none_for_token_ids():
    """`layer_rounding_noise` is `models.rounding.layer_noise` for float inputs (its own
    test is in tests/models/test_rounding.py) and 0 for token ids, which have no rounding."""
    from tftrain.core.keras import keras
    from tftrain.export.measures import layer_rounding_noise
    from tftrain.models.rounding import layer_noise

    inputs = keras.Input((8,))
    net = keras.Model(inputs, keras.layers.Dense(4, name="logits")(inputs))
    x = np.random.default_rng(0).uniform(0.5, 1.0, (16, 8)).astype("float32")
    reference = net(x).numpy()
    assert layer_rounding_noise(net, x, reference) == layer_noise(net, x, reference) > 0
    ids = np.arange(16)[:, None]
    assert layer_rounding_noise(net, ids, reference) == 0.0


def test_logits_are_compared_as_a_softmax_reads_them():
    """A per-example shift of every logit changes no probability: the artifact's logits
    counted exact. Noise on top: the SQNR is the centred signal's power over the centred
    noise's, exactly."""
    reference = np.array([[1.0, -1.0, 0.0], [2.0, 0.0, -2.0]])
    shifted = against(reference + np.array([[5.0], [-3.0]]), reference)
    assert shifted["logit_sqnr_db"] == 200.0 and shifted["top1_agreement"] == 1.0
    assert shifted["max_abs_logit_diff"] == 5.0
    noise = np.array([[0.1, -0.1, 0.0], [0.0, 0.1, -0.1]])          # centred already
    found = against(reference + noise + 7.0, reference)
    signal = np.sum((reference - reference.mean(-1, keepdims=True)) ** 2)    # 2 + 8
    assert found["logit_sqnr_db"] == pytest.approx(10 * np.log10(signal / np.sum(noise ** 2)))
    assert found["logit_spread"] == pytest.approx(np.sqrt(signal / 6))


def test_a_qat_savedmodel_is_measured_against_the_model_traced_as_it_runs_it():
    """`against_traced`: the reference is the model as a traced function computes it
    (`traced_logits`), and the eager model's distance from that is kept beside it. A layer
    that computes otherwise when eager (as fused graph kernels round otherwise) shows only
    there."""
    import tensorflow as tf

    from tftrain.core.keras import keras
    from tftrain.export.measures import against_traced, traced_logits

    class EagerOffset(keras.layers.Layer):
        def call(self, x):
            return x + (tf.constant([0.5, 0.0, 0.0, 0.0]) if tf.executing_eagerly() else 0.0)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, EagerOffset()(inputs * tf.constant([1.0, 2.0, 3.0, 4.0])))
    x = np.random.default_rng(0).uniform(-1, 1, (32, 4)).astype("float32")
    eager = model(x, training=False).numpy()
    traced = x * np.float32([1, 2, 3, 4])
    assert np.abs(eager - traced).max() == pytest.approx(0.5)
    np.testing.assert_allclose(traced_logits(model, x), traced, rtol=1e-6)
    found = against_traced(traced, traced_logits(model, x), eager)
    assert found["max_abs_logit_diff"] == 0.0 and found["top1_agreement"] == 1.0
    assert found["eager_logit_sqnr_db"] == pytest.approx(against(traced, eager)["logit_sqnr_db"])
    assert 0 < found["eager_logit_sqnr_db"] < 30
    moved = against_traced(traced + np.float32(0.01) * (np.arange(4) == 0), traced, eager)
    assert moved["max_abs_logit_diff"] == pytest.approx(0.01, rel=1e-5)


def test_a_gzip_size_is_gzips_default_level_and_reads_back():
    """`gzip_bytes` is the file gzipped at gzip's own default level (6), what `gzip FILE`
    writes: smaller than the file for repetitive bytes, and it decompresses to them."""
    import gzip

    from tftrain.export.measures import GZIP_LEVEL, gzip_size, sizes
    blob = bytes(range(256)) * 64 + b"\0" * 8192
    assert GZIP_LEVEL == 6 and gzip_size(blob) == len(gzip.compress(blob, 6)) < len(blob)
    assert gzip.decompress(gzip.compress(blob, GZIP_LEVEL)) == blob
    assert sizes(blob) == {"size_bytes": len(blob), "gzip_bytes": gzip_size(blob)}
