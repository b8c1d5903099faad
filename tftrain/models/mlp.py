"""Multi-layer perceptron."""
from tftrain.core.keras import keras
from tftrain.models.registry import MODELS


@MODELS.register("mlp")
def mlp(spec, hidden=(128, 64), activation="relu", dropout=0.0):
    """Flatten -> Dense(hidden[i], activation) ... -> Dense(num_classes) logits."""
    inputs = keras.Input(spec.shape, name="inputs")
    x = keras.layers.Flatten(name="flatten")(inputs)
    for i, units in enumerate(hidden):
        x = keras.layers.Dense(units, activation=activation, name=f"dense_{i}")(x)
        if dropout:
            x = keras.layers.Dropout(dropout, name=f"dropout_{i}")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="mlp")
