"""Keras Applications backbones by name (`model.name: keras_applications:MobileNetV2`),
with a new classification head, the backbone's own input preprocessing inside the model,
and optional weights from a local file (`model.params.weights: PATH`; nothing is
downloaded).

The model is flat (the backbone's layers are the model's layers, not a nested model),
so pruning and quantization-aware training reach every convolution. Inputs are images
in [0, 1], as tftrain's image sources give them; `Preprocess` maps them to what the
backbone was trained on (its `preprocess_input` mode: "tf" to [-1, 1], "torch"
ImageNet mean/std, "caffe" BGR minus the mean, or "none" for backbones that include
their own rescaling, like EfficientNet).
"""
from __future__ import annotations

import os

import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.models import tensor_ops

# family module of keras.applications -> preprocess_input mode
MODES = {"mobilenet": "tf", "mobilenet_v2": "tf", "mobilenet_v3": "none", "resnet": "caffe",
         "resnet_v2": "tf", "resnet_rs": "none", "vgg16": "caffe", "vgg19": "caffe",
         "inception_v3": "tf", "inception_resnet_v2": "tf", "xception": "tf",
         "densenet": "torch", "nasnet": "tf", "efficientnet": "none",
         "efficientnet_v2": "none", "convnext": "none", "regnet": "none"}
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)
_CAFFE_MEAN_BGR = (103.939, 116.779, 123.68)


@keras.utils.register_keras_serializable("tftrain")
class Preprocess(keras.layers.Layer):
    """Images in [0, 1] -> the input a Keras Applications backbone expects (`mode`)."""

    def __init__(self, mode="tf", **kwargs):
        super().__init__(**kwargs)
        if mode not in ("tf", "torch", "caffe", "none"):
            raise ValueError(f"preprocessing mode must be tf, torch, caffe or none; got {mode!r}")
        self.mode = mode

    def call(self, x):
        if self.mode == "tf":
            return x * 2.0 - 1.0
        if self.mode == "torch":
            return (x - tf.constant(_MEAN, x.dtype)) / tf.constant(_STD, x.dtype)
        if self.mode == "caffe":
            return x[..., ::-1] * 255.0 - tf.constant(_CAFFE_MEAN_BGR, x.dtype)
        return x * 255.0              # backbones that rescale inside expect [0, 255]

    def get_config(self):
        return {**super().get_config(), "mode": self.mode}


def family(constructor) -> str:
    return constructor.__module__.rsplit(".", 1)[-1]


def constructor(name: str):
    """The Keras Applications function called `name` (ValueError listing them if none)."""
    fn = getattr(keras.applications, name, None)
    if not callable(fn) or name[:1].islower():
        known = sorted(n for n in dir(keras.applications) if n[:1].isupper())
        raise ValueError(f"keras.applications has no model {name!r}; known: {', '.join(known)}")
    return fn


def application(name: str):
    """A model builder for `keras_applications:<name>`."""
    fn = constructor(name)

    def build(spec, weights=None, dropout=0.2, preprocessing="auto", pooling="avg",
              until=None, **kwargs):
        if len(spec.shape) != 3:
            raise ValueError(f"{name} takes images [height, width, channels]; the data gives "
                             f"{list(spec.shape)}")
        if weights is not None:
            path = os.path.expanduser(str(weights))
            if not os.path.isfile(path):
                raise ValueError(f"weights file {weights} does not exist (pretrained weights "
                                 "are never downloaded: give a local .h5/.weights.h5 file)")
            weights = path
        mode = MODES.get(family(fn), "tf") if preprocessing == "auto" else preprocessing
        inputs = keras.Input(spec.shape, name="inputs")
        preprocess = Preprocess(mode, name="preprocess")
        x = preprocess(inputs)
        try:
            backbone = fn(include_top=False, weights=weights, input_tensor=x, pooling=pooling,
                          **kwargs)
        except (OSError, KeyError) as err:     # h5py: a file that is not this backbone's
            raise ValueError(f"could not load weights {weights} into {name} ({err})") from None
        except TypeError as err:               # a parameter the backbone does not take
            raise ValueError(str(err)) from None
        if not any(layer is preprocess for layer in backbone.layers):
            # tf_keras' ConvNeXt and RegNet start from the `Input` under `input_tensor`,
            # skipping `preprocess` (ConvNeXt then saw [0, 1] images as [0, 255] ones and
            # trained at chance): their graph made again on its output
            backbone = keras.Model(inputs, tensor_ops.called_on(backbone, x),
                                   name=backbone.name)
        y = backbone.output if until is None else _cut(backbone, str(until), pooling)
        if dropout:
            y = keras.layers.Dropout(dropout, name="head_dropout")(y)
        outputs = keras.layers.Dense(spec.num_classes, name="logits")(y)
        return keras.Model(inputs, outputs, name=name.lower())

    build.__doc__ = (f"keras.applications.{name} without its top, a dropout and a dense "
                     "head; `weights`: a local weights file for the backbone; `until`: the "
                     "backbone's layers up to this one only (its output pooled).")
    build.__name__ = name
    return build


def _cut(backbone, until: str, pooling):
    """The output of the backbone's layer `until`, pooled as the whole backbone's would be
    (`pooling`: avg or max): a backbone cut early, as for small inputs, whose last blocks
    see a 1x1 map, or as a detector's feature extractor. The model built on it holds only
    the layers up to it."""
    names = [layer.name for layer in backbone.layers]
    if until not in names:
        raise ValueError(f"until: the backbone has no layer {until!r}; its layers include "
                         f"{', '.join(names[-3:])} (`model.summary()` lists them all)")
    pools = {"avg": keras.layers.GlobalAveragePooling2D, "max": keras.layers.GlobalMaxPooling2D}
    if pooling not in pools:
        raise ValueError(f"until: pooling must be avg or max to pool the cut backbone; got "
                         f"{pooling!r}")
    y = backbone.get_layer(until).output
    return pools[pooling](name=f"{until}_pool")(y) if len(y.shape) == 4 else y
