"""Text models on token ids (the `text` source's tokenizer is put in front of them in the
exported SavedModel)."""
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.models.registry import MODELS


@keras.utils.register_keras_serializable("tftrain")
class TokenMean(keras.layers.Layer):
    """The mean of token embeddings over the non-padding tokens (id 0 is padding),
    computed from the ids themselves rather than a Keras mask, so it holds when pruning
    or quantization wrappers (which drop masks) wrap the embedding."""

    def call(self, inputs):
        embedded, ids = inputs
        real = tf.cast(tf.not_equal(ids, 0), embedded.dtype)[..., None]
        total = tf.reduce_sum(embedded * real, axis=1)
        return total / tf.maximum(tf.reduce_sum(real, axis=1), 1.0)


@MODELS.register("embedding_bag")
def embedding_bag(spec, embed_dim=64, hidden=0, dropout=0.0):
    """fastText-style: the mean of the token (and n-gram) embeddings, padding (id 0)
    excluded, then an optional hidden layer and logits."""
    if spec.vocab_size is None:
        raise ValueError("embedding_bag needs token inputs (a dataset with vocab_size, e.g. "
                         "data.name: text)")
    inputs = keras.Input(spec.shape, dtype="int32", name="inputs")
    x = keras.layers.Embedding(spec.vocab_size, embed_dim, name="tokens")(inputs)
    x = TokenMean(name="mean")([x, inputs])
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    if hidden:
        x = keras.layers.Dense(hidden, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="embedding_bag")
