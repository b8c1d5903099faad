"""The one place tftrain imports Keras.

tftrain is built on tf_keras (the Keras 2 API) because tensorflow-model-optimization
only supports it. `tftrain/__init__.py` sets TF_USE_LEGACY_KERAS=1 before TensorFlow is
imported so that `tf.keras` is tf_keras too.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tf_keras as keras  # noqa: E402
# how Keras' train and test functions reduce a step's per-replica outputs
from tf_keras.src.engine.training import reduce_per_replica  # noqa: E402
# what a tf_keras SavedModel's keras_metadata.pb holds (its layers' configs)
from tf_keras.protobuf import saved_metadata_pb2  # noqa: E402

__all__ = ["keras", "keras3", "ensure_tf_keras_model", "reduce_per_replica", "saved_metadata_pb2"]


def keras3():
    """Keras 3 (`import keras`, installed with TensorFlow), for models that come in as
    Keras 3 (`tftrain.models.keras3` converts them); imported only when one does."""
    import keras as k3
    return k3


def ensure_tf_keras_model(model, what: str = "model"):
    """Return `model` if it is a tf_keras model, else raise a TypeError saying why."""
    if isinstance(model, keras.Model):
        return model
    module = type(model).__module__
    if module.startswith("keras"):
        raise TypeError(
            f"{what} is a Keras 3 model ({type(model).__name__} from {module}); tftrain "
            "needs a tf_keras (Keras 2) model because tensorflow-model-optimization only "
            "supports tf_keras. Build it with `import tf_keras as keras` (or set "
            "TF_USE_LEGACY_KERAS=1 before importing TensorFlow and use tf.keras)."
        )
    raise TypeError(f"{what} must be a tf_keras Model; received {type(model).__name__}.")
