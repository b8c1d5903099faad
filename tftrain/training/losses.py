"""Training losses by name (`train.loss`): classification losses take logits, and the
default cross-entropy takes class indices or soft labels (mixup, cutmix) alike."""
from __future__ import annotations

import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.core.registry import Registry

LOSSES = Registry("loss", "train.loss")


class ClassCrossentropy(keras.losses.Loss):
    """Cross-entropy on logits for class indices, or for class probabilities (soft labels
    from mixup/cutmix) when the labels have the logits' rank: one loss for training on
    mixed examples and validating on plain ones."""

    def __init__(self, name="sparse_categorical_crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)

    def call(self, y_true, y_pred):
        if y_true.shape.rank == y_pred.shape.rank and y_true.shape[-1] == y_pred.shape[-1] != 1:
            return keras.losses.categorical_crossentropy(y_true, y_pred, from_logits=True)
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def hard_labels(y, y_pred):
    """Class indices for metrics: the largest share of a soft label, else `y`."""
    if y.shape.rank == y_pred.shape.rank and y.shape[-1] == y_pred.shape[-1] != 1:
        return tf.argmax(y, axis=-1)
    return y


LOSSES.register("sparse_categorical_crossentropy")(ClassCrossentropy)
LOSSES.register("categorical_crossentropy")(
    lambda: keras.losses.CategoricalCrossentropy(from_logits=True))
LOSSES.register("binary_crossentropy")(lambda: keras.losses.BinaryCrossentropy(from_logits=True))
LOSSES.register("mse")(lambda: keras.losses.MeanSquaredError())


def build_loss(name: str):
    """A Keras loss object; classification losses take logits."""
    return LOSSES.get(name)()
