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


def test_term_weights_are_scikit_learns_stacked_sublinear_tfidf():
    """Token ids of two tokenizers (words 1-5, n-grams 6-9) against scikit-learn's
    `TfidfVectorizer(sublinear_tf=True)` per group, stacked: the same vectors."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    from tftrain.data.source import TokenStatistics
    from tftrain.data.text import document_frequency
    from tftrain.models.text import TermWeights

    train = np.array([[2, 2, 3, 6, 6, 6, 7, 0], [3, 4, 0, 7, 8, 0, 0, 0],
                      [2, 5, 5, 5, 9, 9, 6, 0]], np.int32)
    stats = TokenStatistics((0, 6), len(train), document_frequency(train, 10))
    np.testing.assert_array_equal(stats.frequency, [0, 0, 2, 2, 1, 1, 2, 2, 1, 1])
    got = TermWeights(stats.idf(), stats.groups)(train).numpy()

    def docs(lo, hi):
        return [" ".join(f"t{i}" for i in row if lo <= i < hi) for row in train]
    want = []
    for start, hi in ((0, 6), (6, 10)):                   # id 0 (padding) in no text
        vectorizer = TfidfVectorizer(sublinear_tf=True, token_pattern=r"\S+")
        matrix = vectorizer.fit_transform(docs(max(start, 1), hi)).toarray()
        dense = np.zeros((len(train), hi - start))
        for column, token in enumerate(vectorizer.get_feature_names_out()):
            dense[:, int(token[1:]) - start] = matrix[:, column]
        want.append(dense)
    np.testing.assert_allclose(got, np.concatenate(want, axis=1), rtol=1e-5, atol=1e-7)
    assert got[:, :1].max() == 0.0                                 # padding weighs nothing


def test_tfidf_linear_reads_the_specs_statistics_and_survives_a_clone():
    from tftrain.core.keras import keras
    from tftrain.data.source import TokenStatistics

    stats = TokenStatistics((0, 4), 10, np.array([0, 0, 9, 1, 5, 5, 0, 2], np.float32))
    spec = InputSpec((5,), "int32", 3, vocab_size=8, tokens=stats)
    model = MODELS.get("tfidf_linear")(spec)
    np.testing.assert_allclose(model.get_layer("tfidf").idf.numpy(), stats.idf())
    ids = np.array([[2, 3, 4, 4, 7]], np.int32)
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(clone(ids).numpy(), model(ids).numpy(), rtol=1e-6)
    plain = MODELS.get("tfidf_linear")(spec, idf=False)
    np.testing.assert_array_equal(plain.get_layer("tfidf").idf.numpy(), np.ones(8))
    with pytest.raises(ValueError, match="tfidf_linear needs token inputs"):
        MODELS.get("tfidf_linear")(InputSpec((5,), "float32", 3))


def test_term_weights_count_repeated_ids_alike_in_tflite_and_onnx():
    """A repeated id counts c times in each runtime (tf2onnx alone turns `scatter_nd` into
    an ONNX ScatterND that keeps one of repeated indices: counts of 1 there)."""
    import tensorflow as tf
    import onnxruntime as ort
    from ai_edge_litert.interpreter import Interpreter

    from tftrain.core.keras import keras
    from tftrain.models.text import TermWeights

    inputs = keras.Input((6,), dtype="int32")
    model = keras.Model(inputs, TermWeights(np.arange(1, 9, dtype=np.float32), (0, 4))(inputs))
    ids = np.array([[2, 2, 2, 3, 5, 0], [1, 1, 0, 0, 7, 7]], np.int32)
    want = model(ids).numpy()
    np.testing.assert_allclose(want[0, 2:4] / want[0, 3], [3 * (1 + np.log(3)) / 4, 1.0], rtol=1e-6)
    from tftrain.export.onnx_export import float_onnx

    onnx_out = ort.InferenceSession(float_onnx(model)).run(None, {"inputs": ids})[0]
    np.testing.assert_allclose(onnx_out, want, rtol=1e-6)
    interpreter = Interpreter(model_content=tf.lite.TFLiteConverter.from_keras_model(model).convert())
    interpreter.resize_tensor_input(0, list(ids.shape))
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], ids)
    interpreter.invoke()
    np.testing.assert_allclose(interpreter.get_tensor(interpreter.get_output_details()[0]["index"]),
                               want, rtol=1e-6)
