"""Text models on token ids (the `text` source's tokenizer is put in front of them in the
exported SavedModel)."""
from tftrain._keras import keras
from tftrain.models import MODELS


@MODELS.register("embedding_bag")
def embedding_bag(spec, embed_dim=64, hidden=0, dropout=0.0):
    """fastText-style: the mean of the token (and n-gram) embeddings, padding (id 0)
    excluded, then an optional hidden layer and logits."""
    if spec.vocab_size is None:
        raise ValueError("embedding_bag needs token inputs (a dataset with vocab_size, e.g. "
                         "data.name: text)")
    inputs = keras.Input(spec.shape, dtype="int32", name="inputs")
    x = keras.layers.Embedding(spec.vocab_size, embed_dim, mask_zero=True, name="tokens")(inputs)
    x = keras.layers.GlobalAveragePooling1D(name="mean")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    if hidden:
        x = keras.layers.Dense(hidden, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="embedding_bag")
