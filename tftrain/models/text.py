"""Text models on token ids (the `text` source's tokenizer is put in front of them in the
exported SavedModel)."""
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
