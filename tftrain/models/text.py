"""Text models on token ids (the `text` source's tokenizer is put in front of them in the
exported SavedModel)."""
import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.models.registry import MODELS


@keras.utils.register_keras_serializable("tftrain")
class TokenMean(keras.layers.Layer):
    """The mean of token embeddings over the non-padding tokens (id 0 is padding),
    computed from the ids themselves rather than a Keras mask, so it holds when pruning
    or quantization wrappers (which drop masks) wrap the embedding. `pooling: sqrtn`
    divides their sum by the square root of their number instead (a bag of distinct
    tokens then has unit L2 norm, as TF-IDF's rows do)."""

    def __init__(self, pooling="mean", **kwargs):
        super().__init__(**kwargs)
        if pooling not in ("mean", "sqrtn"):
            raise ValueError(f"pooling must be 'mean' or 'sqrtn', received {pooling!r}")
        self.pooling = pooling

    def call(self, inputs):
        embedded, ids = inputs
        real = tf.cast(tf.not_equal(ids, 0), embedded.dtype)[..., None]
        total = tf.reduce_sum(embedded * real, axis=1)
        count = tf.maximum(tf.reduce_sum(real, axis=1), 1.0)
        return total / (count if self.pooling == "mean" else tf.sqrt(count))

    def get_config(self):
        return {**super().get_config(), "pooling": self.pooling}


@MODELS.register("embedding_bag")
def embedding_bag(spec, embed_dim=64, hidden=0, dropout=0.0, pooling="mean"):
    """fastText-style: the mean of the token (and n-gram) embeddings, padding (id 0)
    excluded (`pooling: sqrtn`: their sum over the square root of their number), then
    an optional hidden layer and logits."""
    if spec.vocab_size is None:
        raise ValueError("embedding_bag needs token inputs (a dataset with vocab_size, e.g. "
                         "data.name: text)")
    inputs = keras.Input(spec.shape, dtype="int32", name="inputs")
    x = keras.layers.Embedding(spec.vocab_size, embed_dim, name="tokens")(inputs)
    x = TokenMean(pooling, name="mean")([x, inputs])
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    if hidden:
        x = keras.layers.Dense(hidden, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="embedding_bag")


@keras.utils.register_keras_serializable("tftrain")
class TermWeights(keras.layers.Layer):
    """Token ids -> their TF-IDF vector, as scikit-learn's `TfidfVectorizer(sublinear_tf=
    True)` computes it: each id's count c in the text weighted 1 + ln c, times its
    inverse document frequency (fixed at plan time from the training split), each group
    of ids (words; character n-grams) scaled to unit L2 norm on its own, as stacked
    vectorizers are. Padding (id 0) counts for nothing."""

    def __init__(self, idf, groups=(0,), **kwargs):
        super().__init__(**kwargs)
        self.idf_values = [float(v) for v in np.asarray(idf, np.float32)]
        self.groups = tuple(int(g) for g in groups)

    def build(self, input_shape):
        self.idf = self.add_weight("idf", shape=(len(self.idf_values),), trainable=False,
                                   initializer=keras.initializers.Constant(self.idf_values))
        super().build(input_shape)

    def call(self, ids):
        ids = tf.cast(ids, tf.int32)
        # each id's count in its text: scatter_nd sums repeated indices (tftrain's ONNX
        # export keeps that sum: export/onnx_export.py)
        rows = tf.broadcast_to(tf.range(tf.shape(ids)[0])[:, None], tf.shape(ids))
        counts = tf.scatter_nd(tf.stack([rows, ids], -1), tf.cast(ids > 0, self.compute_dtype),
                               tf.stack([tf.shape(ids)[0], len(self.idf_values)]))
        ones = tf.ones_like(counts)
        weights = tf.where(counts > 0, ones + tf.math.log(tf.maximum(counts, ones)),
                           tf.zeros_like(counts))
        weights = weights * tf.cast(self.idf, self.compute_dtype)
        ends = [*self.groups[1:], len(self.idf_values)]
        parts = [weights[:, start:end] for start, end in zip(self.groups, ends)]
        # the squares summed in float32: a text's weights squared overflow float16's range
        norms = [tf.math.rsqrt(tf.maximum(tf.reduce_sum(tf.square(tf.cast(p, tf.float32)), -1,
                                                        keepdims=True), 1e-12)) for p in parts]
        return tf.concat([p * tf.cast(n, p.dtype) for p, n in zip(parts, norms)], axis=-1)

    def get_config(self):
        return {**super().get_config(), "idf": self.idf_values, "groups": list(self.groups)}


@MODELS.register("tfidf_linear")
def tfidf_linear(spec, dropout=0.0, idf=True):
    """A linear model on the TF-IDF vector of the token ids (`TermWeights`): logistic
    regression on TF-IDF, the strong linear baseline of text classification, computed
    in the graph from the ids; `idf: false` weighs every id alike."""
    if spec.vocab_size is None:
        raise ValueError("tfidf_linear needs token inputs (a dataset with vocab_size, e.g. "
                         "data.name: text)")
    statistics = spec.tokens
    weights = (statistics.idf() if statistics is not None and idf
               else np.ones(spec.vocab_size, np.float32))
    groups = statistics.groups if statistics is not None else (0,)
    inputs = keras.Input(spec.shape, dtype="int32", name="inputs")
    x = TermWeights(weights, groups, name="tfidf")(inputs)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="tfidf_linear")
