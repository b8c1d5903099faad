"""CIFAR-style ResNet (He et al. 2016): depth = 6n + 2, three stages of basic blocks;
`preact: true` the pre-activation form of "Identity Mappings in Deep Residual Networks"
(ResNetV2: batch norm and ReLU before each convolution, the residual sums left alone)."""
from tftrain.core.keras import keras
from tftrain.models.registry import MODELS


def _conv_bn(x, filters, stride, name, relu=True):
    x = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                            kernel_initializer="he_normal", name=f"{name}_conv")(x)
    x = keras.layers.BatchNormalization(name=f"{name}_bn")(x)
    return keras.layers.ReLU(name=f"{name}_relu")(x) if relu else x


def _block(x, filters, stride, name):
    y = _conv_bn(x, filters, stride, f"{name}_a")
    y = _conv_bn(y, filters, 1, f"{name}_b", relu=False)
    if stride != 1 or x.shape[-1] != filters:
        x = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(x)
        x = keras.layers.BatchNormalization(name=f"{name}_proj_bn")(x)
    x = keras.layers.Add(name=f"{name}_add")([x, y])
    return keras.layers.ReLU(name=f"{name}_out")(x)


def _preact_block(x, filters, stride, name):
    """Batch norm and ReLU, then the convolutions; the shortcut a projection of the
    normalized input where the shape changes, else the input itself."""
    p = keras.layers.BatchNormalization(name=f"{name}_pre_bn")(x)
    p = keras.layers.ReLU(name=f"{name}_pre_relu")(p)
    y = _conv_bn(p, filters, stride, f"{name}_a")
    y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                            kernel_initializer="he_normal", name=f"{name}_b_conv")(y)
    if stride != 1 or x.shape[-1] != filters:
        x = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False, name=f"{name}_proj")(p)
    return keras.layers.Add(name=f"{name}_add")([x, y])


@MODELS.register("resnet")
def resnet(spec, depth=20, width=16, preact=False):
    """ResNet-`depth` (20, 32, 44, 56, 110, or 8 for tests) with base width `width`;
    `preact`: its pre-activation form (ResNetV2)."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"depth must be 6n+2 (8, 14, 20, 32, ...), received depth={depth}")
    blocks = (depth - 2) // 6
    inputs = keras.Input(spec.shape, name="inputs")
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, kernel_initializer="he_normal",
                            name="stem_conv")(inputs) if preact else _conv_bn(inputs, width, 1, "stem")
    block = _preact_block if preact else _block
    for stage in range(3):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 and min(x.shape[1:3]) >= 2 else 1
            x = block(x, width * 2**stage, stride, f"s{stage}b{b}")
    if preact:
        x = keras.layers.ReLU(name="post_relu")(keras.layers.BatchNormalization(name="post_bn")(x))
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}{'v2' if preact else ''}")
