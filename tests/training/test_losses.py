"""Training losses by name: the default cross-entropy takes class indices and soft labels."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.training.losses import LOSSES, build_loss, hard_labels

LOGITS = tf.constant([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])


def _cross_entropy(probabilities, logits):
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(np.mean(-(probabilities * log_softmax).sum(-1)))


def test_class_indices_and_soft_labels_are_one_cross_entropy_on_logits():
    loss = build_loss("sparse_categorical_crossentropy")
    indices = tf.constant([0, 2])
    onehot = np.eye(3, dtype=np.float32)[[0, 2]]
    assert float(loss(indices, LOGITS)) == pytest.approx(_cross_entropy(onehot, LOGITS.numpy()), rel=1e-6)
    soft = np.array([[0.7, 0.3, 0.0], [0.0, 0.4, 0.6]], np.float32)    # mixup's labels
    assert float(loss(tf.constant(soft), LOGITS)) == pytest.approx(
        _cross_entropy(soft, LOGITS.numpy()), rel=1e-6)


def test_metrics_read_the_largest_share_of_a_soft_label():
    soft = tf.constant([[0.7, 0.3, 0.0], [0.0, 0.4, 0.6]])
    assert hard_labels(soft, LOGITS).numpy().tolist() == [0, 2]
    indices = tf.constant([1, 0])
    assert hard_labels(indices, LOGITS) is indices


def test_an_unknown_loss_is_a_config_error_with_the_closest_name():
    assert set(LOSSES.names()) == {"sparse_categorical_crossentropy", "categorical_crossentropy",
                                   "binary_crossentropy", "mse"}
    with pytest.raises(ConfigError, match=r"train\.loss: unknown loss 'categorical_crossentropie'.*"
                                          r"did you mean 'categorical_crossentropy'"):
        build_loss("categorical_crossentropie")
