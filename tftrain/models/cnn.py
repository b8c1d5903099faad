"""Conv-relu-pool blocks followed by dense layers."""
from tftrain.core.keras import keras
from tftrain.models.registry import MODELS


@MODELS.register("cnn")
def cnn(spec, filters=(32, 64), kernel_size=3, dense=(128,), dropout=0.0,
        batch_norm=False, pool="max"):
    """One block per entry of `filters`: conv (same padding) [+BN] + relu + 2x2 pool
    (skipped once the feature map is 1 pixel wide), then `dense` layers and logits."""
    if pool not in ("max", "avg"):
        raise ValueError(f"pool must be 'max' or 'avg', received pool={pool!r}")
    inputs = keras.Input(spec.shape, name="inputs")
    x = inputs
    size = min(spec.shape[:2])
    for i, f in enumerate(filters):
        x = keras.layers.Conv2D(f, kernel_size, padding="same", use_bias=not batch_norm,
                                name=f"conv_{i}")(x)
        if batch_norm:
            x = keras.layers.BatchNormalization(name=f"bn_{i}")(x)
        x = keras.layers.ReLU(name=f"relu_{i}")(x)
        if size >= 2:
            layer = keras.layers.MaxPooling2D if pool == "max" else keras.layers.AveragePooling2D
            x = layer(2, name=f"pool_{i}")(x)
            size //= 2
    x = keras.layers.Flatten(name="flatten")(x)
    for i, units in enumerate(dense):
        x = keras.layers.Dense(units, activation="relu", name=f"dense_{i}")(x)
        if dropout:
            x = keras.layers.Dropout(dropout, name=f"dropout_{i}")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="cnn")
