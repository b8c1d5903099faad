"""The embedding bag's pooling over non-padding tokens: the mean, or the sum over the
square root of the count, checked against sums worked out by hand."""
import numpy as np
import pytest

from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.models.text import TokenMean


@pytest.mark.parametrize("pooling, divisor", [("mean", 3.0), ("sqrtn", np.sqrt(3.0))])
def test_pooling_skips_padding_and_divides_the_sum(pooling, divisor):
    ids = np.array([[5, 0, 7, 5, 0], [0, 0, 0, 0, 0]], np.int32)
    embedded = np.arange(2 * 5 * 2, dtype=np.float32).reshape(2, 5, 2)
    got = TokenMean(pooling)([embedded, ids]).numpy()
    np.testing.assert_allclose(got[0], (embedded[0, 0] + embedded[0, 2] + embedded[0, 3]) / divisor,
                               rtol=1e-6)
    np.testing.assert_array_equal(got[1], [0.0, 0.0])          # all padding: zeros, no NaN


def test_the_pooling_is_a_parameter_of_the_model_and_a_wrong_one_is_named():
    spec = InputSpec((6,), "int32", 3, vocab_size=20)
    model = MODELS.get("embedding_bag")(spec, embed_dim=4, pooling="sqrtn")
    assert model.get_layer("mean").get_config()["pooling"] == "sqrtn"
    with pytest.raises(ValueError, match="pooling must be 'mean' or 'sqrtn', received 'max'"):
        MODELS.get("embedding_bag")(spec, pooling="max")
