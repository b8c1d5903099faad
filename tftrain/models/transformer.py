"""Transformer encoder for sequence classification (pre-norm blocks)."""
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.models.registry import MODELS


@keras.utils.register_keras_serializable("tftrain")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to its token embedding."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length, self.dim = length, dim

    def build(self, input_shape):
        self.positions = self.add_weight("positions", shape=(self.length, self.dim),
                                         initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + tf.cast(self.positions, x.dtype)[None, : tf.shape(x)[1]]

    def get_config(self):
        return {**super().get_config(), "length": self.length, "dim": self.dim}


@MODELS.register("transformer")
def transformer(spec, embed_dim=64, num_heads=4, num_layers=2, mlp_dim=128, dropout=0.0):
    """Token + position embeddings, `num_layers` blocks of multi-head self-attention and
    an MLP (each pre-norm with a residual), mean pooling, logits."""
    if spec.vocab_size is None:
        raise ValueError("transformer needs token inputs (a dataset with vocab_size, e.g. "
                         "data.name: synthetic with params.kind: tokens)")
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
    length = spec.shape[0]
    inputs = keras.Input(spec.shape, dtype="int32", name="inputs")
    x = keras.layers.Embedding(spec.vocab_size, embed_dim, name="tokens")(inputs)
    x = PositionEmbedding(length, embed_dim, name="positions")(x)
    for i in range(num_layers):
        y = keras.layers.LayerNormalization(name=f"b{i}_ln1")(x)
        y = keras.layers.MultiHeadAttention(num_heads, embed_dim // num_heads, dropout=dropout,
                                            name=f"b{i}_attn")(y, y)
        x = keras.layers.Add(name=f"b{i}_add1")([x, y])
        y = keras.layers.LayerNormalization(name=f"b{i}_ln2")(x)
        y = keras.layers.Dense(mlp_dim, activation="gelu", name=f"b{i}_mlp1")(y)
        y = keras.layers.Dense(embed_dim, name=f"b{i}_mlp2")(y)
        if dropout:
            y = keras.layers.Dropout(dropout, name=f"b{i}_drop")(y)
        x = keras.layers.Add(name=f"b{i}_add2")([x, y])
    x = keras.layers.LayerNormalization(name="final_ln")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="transformer")
