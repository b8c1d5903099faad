"""Keras 3 models converted to tf_keras, layer by layer, weights included (and back).

tfmot's pruning and QAT work on tf_keras models only, and `import keras` is Keras 3 since
TensorFlow 2.16. A Keras 3 functional or Sequential model made of built-in layers is
rebuilt here as the same tf_keras graph: each layer from its config (settings Keras 3
has and tf_keras lacks must be at their defaults; Keras 3's serialized initializers,
regularizers and constraints become tf_keras's), called on the converted inputs as the
Keras 3 layer was, then given the Keras 3 layer's weights. `refusal` names, before
anything is built, what cannot be converted (a custom layer, an op applied to tensors
outside a layer, a subclassed model), and `register_converter` adds a converter for a
layer class of your own. `to_keras3` rebuilds a tf_keras model as Keras 3 the same way,
to hand a trained model back in the format it came in.
"""
from __future__ import annotations

import inspect
from typing import Callable

import numpy as np

from tftrain.core.keras import keras, keras3
from tftrain.models.keras3_forms import (ACTIVATIONS, APPLICATION_LAYERS, application_layer,
                                         is_tensor as _is_tensor, op_layer)
from tftrain.core import internals
from tftrain.models.rounding import layer_noise
import tensorflow as tf
from tftrain.models import tensor_ops

# the built-in layers converted by their config (one class name in both Kerases)
LAYERS = frozenset("""
    InputLayer Dense EinsumDense Conv1D Conv2D Conv3D DepthwiseConv1D DepthwiseConv2D
    SeparableConv1D SeparableConv2D Conv1DTranspose Conv2DTranspose BatchNormalization
    LayerNormalization GroupNormalization UnitNormalization Embedding MultiHeadAttention
    MaxPooling1D MaxPooling2D AveragePooling1D AveragePooling2D GlobalMaxPooling1D
    GlobalMaxPooling2D GlobalAveragePooling1D GlobalAveragePooling2D Activation ReLU
    Softmax LeakyReLU ELU PReLU Dropout SpatialDropout1D SpatialDropout2D GaussianNoise
    Add Subtract Multiply Average Maximum Minimum Concatenate Dot Reshape Flatten
    Permute RepeatVector Cropping1D Cropping2D ZeroPadding1D ZeroPadding2D
    UpSampling1D UpSampling2D Rescaling Normalization Resizing CenterCrop Identity
""".split())
# settings named differently: {class: {Keras 3 name: tf_keras name}}
RENAMES = {"LeakyReLU": {"negative_slope": "alpha"}}
_BASE = {"name", "trainable", "dtype"}
_CONVERTERS: dict[str, Callable] = {}


def register_converter(class_name: str, converter: Callable) -> None:
    """Convert Keras 3 layers of class `class_name` with `converter(layer) -> tf_keras
    layer` (unbuilt: it is called on the converted inputs, then given `layer`'s weights
    with `set_weights`). For a layer class of your own, or one tftrain does not know."""
    _CONVERTERS[class_name] = converter


def is_keras3(model) -> bool:
    """Whether `model` is a Keras 3 object (not a tf_keras one)."""
    return type(model).__module__.split(".")[0] == "keras"


def refusal(model) -> list[str]:
    """Why `model` (Keras 3) cannot be converted, one line per layer ([] if it can)."""
    k3 = keras3()
    graph = internals.graph_of(model)
    if not isinstance(model, k3.Model) or not internals.has_graph(graph):
        return [f"{type(model).__name__} is a subclassed Keras 3 model: only functional and "
                "Sequential models have a graph of layers to convert; build it with the "
                "functional API, or with tf_keras directly (import tf_keras as keras)"]
    problems = []
    for node in _nodes(model):
        op = node.operation
        kind = type(op).__name__
        if _nested(op):               # inlined: its own layers are what is converted
            problems += refusal(op)
        elif not isinstance(op, k3.layers.Layer):
            if op_layer(node) is None:
                problems.append(f"{op.name} is a Keras op ({kind}) applied to tensors, not a "
                                "layer tftrain converts (it converts +, -, * and / with a "
                                "constant and +, -, * between tensors); use the layer form "
                                "(e.g. keras.layers.Add) or register a converter")
        elif kind not in LAYERS and kind not in _CONVERTERS and kind not in APPLICATION_LAYERS:
            problems.append(f"layer {op.name} ({kind}, from {type(op).__module__}) has no tf_keras "
                            "form tftrain knows; rewrite it with tf_keras, or register a converter "
                            "(tftrain.models.keras3.register_converter)")
        elif kind not in _CONVERTERS and kind not in APPLICATION_LAYERS and kind != "InputLayer":
            problems += [f"layer {op.name} ({kind}): {why}" for why in _unmapped(op)]
    return list(dict.fromkeys(problems))


def to_tf_keras(model):
    """The tf_keras form of a Keras 3 functional or Sequential model, weights included."""
    problems = refusal(model)
    if problems:
        raise ValueError("; ".join(problems))
    return _rebuild(model, _nodes(model), _to_tf_keras_layer, keras.Input, keras.Model,
                    lambda t: internals.history(t).operation, lambda t: internals.history(t).node_index)


def checked(model, what: str, tolerance: float = 1e-5):
    """(`to_tf_keras(model)`, the largest difference between the two forms' outputs on
    sample inputs); a difference above `tolerance` times the outputs' scale is a bug in
    the conversion (RuntimeError)."""
    converted = to_tf_keras(model)
    diff = conversion_diff(model, converted)
    if diff > tolerance * max(1.0, _scale(model)) and diff > NOISE_FACTOR * _noise(converted):
        raise RuntimeError(f"the tf_keras conversion of {what} computes outputs {diff:.2g} from "
                           f"Keras 3's (more than {tolerance:g} of their scale, and more than "
                           f"{NOISE_FACTOR:g}x the model's own float32 rounding at every layer); "
                           "a bug in tftrain's converter: please report it with the model's "
                           "config")
    CONVERTED[what] = diff
    return converted, diff


CONVERTED: dict[str, float] = {}      # what was converted in this process -> the difference


def _sample(model, n: int = 16, seed: int = 0) -> list[np.ndarray]:
    """Inputs to compare two forms of a model on: token ids below the smallest embedding
    table, else values in [-1, 1]."""
    rng = np.random.default_rng(seed)
    tables = [layer.input_dim for layer in model.layers if hasattr(layer, "input_dim")]
    samples = []
    for t in model.inputs:
        shape = [n, *[d if d is not None else 8 for d in t.shape[1:]]]
        if "int" in str(t.dtype):
            samples.append(rng.integers(0, min(tables) if tables else 2, shape).astype(str(t.dtype)))
        else:
            samples.append(rng.uniform(-1, 1, shape).astype("float32"))
    return samples


def conversion_diff(original, converted) -> float:
    """The largest difference between two forms of a model's outputs on sample inputs."""
    x = _sample(original)
    x = x[0] if len(x) == 1 else x
    a = np.asarray(original(x, training=False))
    b = np.asarray(converted(x, training=False))
    return float(np.max(np.abs(a - b)))


# Keras 3 and tf_keras compute a layer with other kernels and sums in other orders: a deep
# untrained network amplifies the rounding (an EfficientNetV2M at 32 x 32 ends 3.9e-4
# apart), so the two forms may be this many times the model's own rounding at every layer
# apart (`rounding.layer_noise`), as a float export may
NOISE_FACTOR = 10.0


def _noise(converted) -> float:

    x = _sample(converted)
    if len(x) != 1 or x[0].dtype.kind != "f":
        return 0.0
    return layer_noise(converted, x[0], np.asarray(converted(x[0], training=False)))


def _scale(model) -> float:
    x = _sample(model)
    return float(np.max(np.abs(np.asarray(model(x[0] if len(x) == 1 else x, training=False)))))


def to_keras3(model):
    """The Keras 3 form of a tf_keras functional model (tfmot wrappers stripped first)."""
    k3 = keras3()
    nodes = internals.nodes_in_order(model)
    return _rebuild(model, nodes, _to_keras3_layer, k3.Input, k3.Model,
                    lambda t: internals.history(t).layer, lambda t: internals.history(t).node_index)


def _nodes(model) -> list:
    """The nodes of a Keras 3 functional model (a Sequential's own graph), inputs first."""
    graph = internals.graph_of(model)
    return internals.nodes_in_order(graph)


def _rebuild(model, nodes, convert, make_input, make_model, owner, node_index):
    """`model`'s graph rebuilt layer by layer with `convert(layer)`, weights copied; a
    model nested in it (ConvNeXt's Sequential stem and downsampling blocks) is inlined,
    its layers becoming the new model's."""
    made: dict[int, tuple] = {}          # id(layer) -> (layer, new layer)
    outs = _walk(nodes, convert, make_input, owner, node_index, made, None)
    ins = [outs[(owner(t).name, node_index(t))][_tensor_index(t)] for t in model.inputs]
    ends = [outs[(owner(t).name, node_index(t))][_tensor_index(t)] for t in model.outputs]
    new = make_model(ins if len(ins) > 1 else ins[0], ends if len(ends) > 1 else ends[0],
                     name=model.name)
    for source, layer in made.values():
        _copy_weights(source, layer)
    return new


def _walk(nodes, convert, make_input, owner, node_index, made, given):
    """Each node's output tensors in the new graph, by (layer name, node index); `given`:
    the tensors a nested model's inputs take, by input name (None: new inputs)."""

    outputs: dict = {}
    for node in nodes:
        layer = getattr(node, "operation", None) or node.layer
        if type(layer).__name__ == "InputLayer":
            spec = layer.output if hasattr(layer, "output") else layer.output_tensor
            outputs[(layer.name, 0)] = [given[layer.name] if given is not None else make_input(
                shape=tuple(spec.shape[1:]), dtype=spec.dtype, name=layer.name)]
            continue
        lookup = lambda t: outputs[(owner(t).name, node_index(t))][_tensor_index(t)]  # noqa: E731
        op = op_layer(node) if hasattr(node, "operation") else None
        args, kwargs = _arguments(node)
        if op is not None:             # a Keras 3 op on tensors: a layer without weights
            made_op, tensors = op
            result = made_op([lookup(t) for t in tensors] if len(tensors) > 1
                             else lookup(tensors[0]))
        elif _nested(layer):
            tensors = [lookup(t) for t in tf.nest.flatten(args) if _is_tensor(t)]
            inner = _walk(_nodes(layer), convert, make_input, owner, node_index, made,
                          {owner(t).name: v for t, v in zip(layer.inputs, tensors)})
            result = [inner[(owner(t).name, node_index(t))][_tensor_index(t)]
                      for t in layer.outputs]
        else:
            if id(layer) not in made:
                made[id(layer)] = (layer, convert(layer))
            args = tf.nest.map_structure(lambda v: lookup(v) if _is_tensor(v) else v, args)
            kwargs = {k: tf.nest.map_structure(lambda v: lookup(v) if _is_tensor(v) else v, v)
                      for k, v in kwargs.items() if v is not None}
            result = made[id(layer)][1](*args, **kwargs)
        outputs[(layer.name, _index_of(layer, node))] = tf.nest.flatten(result)
    return outputs


def _nested(layer) -> bool:
    """A Keras 3 functional or Sequential model used as a layer of another."""
    return type(layer).__module__.split(".")[0] == "keras" and \
        internals.has_graph(internals.graph_of(layer))


def _arguments(node):
    if hasattr(node, "arguments"):                       # Keras 3
        return list(node.arguments.args), dict(node.arguments.kwargs)
    return list(node.call_args), dict(node.call_kwargs)  # tf_keras


def _index_of(layer, node) -> int:
    return next(i for i, n in enumerate(internals.inbound_nodes(layer)) if n is node)


def _tensor_index(tensor) -> int:
    return internals.history(tensor).tensor_index


def _copy_weights(source, target) -> None:
    weights = source.get_weights()
    shapes = [tuple(w.shape) for w in weights]
    wanted = [tuple(w.shape) for w in target.get_weights()]
    if shapes != wanted:
        raise ValueError(f"layer {source.name} ({type(source).__name__}): its weights "
                         f"{shapes} do not fit the converted layer's {wanted}")
    target.set_weights(weights)


# -- one layer ----------------------------------------------------------------------------
def _to_tf_keras_layer(layer):

    kind = type(layer).__name__
    if kind in _CONVERTERS:
        return _CONVERTERS[kind](layer)
    if kind in APPLICATION_LAYERS:
        return application_layer("tf_keras", layer)
    if kind == "Activation" and layer.get_config().get("activation") in ACTIVATIONS:
        form = getattr(tensor_ops, ACTIVATIONS[layer.get_config()["activation"]])
        return form(name=layer.name, dtype=layer.dtype_policy.name)
    cls = getattr(keras.layers, kind)
    config = _mapped(layer)
    config["dtype"] = layer.dtype_policy.name
    return cls(**{k: _to_tf_keras_value(k, v) for k, v in config.items()})


def _mapped(layer) -> dict:
    """`layer`'s config as the tf_keras class takes it (renamed, unknown keys dropped)."""
    kind = type(layer).__name__
    renames = RENAMES.get(kind, {})
    accepted = _parameters(getattr(keras.layers, kind)) | _BASE
    config = {renames.get(k, k): v for k, v in layer.get_config().items()}
    return {k: v for k, v in config.items() if k in accepted}


def _unmapped(layer) -> list[str]:
    """Settings of a Keras 3 layer that tf_keras's class does not take, set to other than
    their default (the converted layer would compute something else)."""
    kind = type(layer).__name__
    renames = RENAMES.get(kind, {})
    accepted = _parameters(getattr(keras.layers, kind)) | _BASE
    defaults = {k: p.default for k, p in inspect.signature(type(layer).__init__).parameters.items()}
    found = []
    for key, value in layer.get_config().items():
        if renames.get(key, key) in accepted or key in ("seed", "flash_attention"):
            continue
        if key in defaults and defaults[key] == value or value in (None, False):
            continue
        found.append(f"{key}={value!r} has no tf_keras form")
    return found


def _parameters(cls) -> set[str]:
    names = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            names |= set(inspect.signature(klass.__init__).parameters) - {"self", "kwargs", "args"}
        if klass.__name__ == "Layer":
            break
    return names


_OBJECTS = {"initializer": "initializers", "regularizer": "regularizers",
            "constraint": "constraints"}


def _to_tf_keras_value(key: str, value):
    """Keras 3's serialized initializer/regularizer/constraint as tf_keras's (its config
    reduced to what the tf_keras class takes); anything else as it is."""
    if not (isinstance(value, dict) and "class_name" in value and "module" in value):
        return value
    kind = next((v for k, v in _OBJECTS.items() if key.endswith(k)), None)
    if kind is None:
        return value
    cls = getattr(getattr(keras, kind), value["class_name"], None)
    if cls is None:
        return None                        # the tf_keras default
    accepted = _parameters(cls) if "__init__" in vars(cls) else set(value["config"])
    return {"class_name": value["class_name"],
            "config": {k: v for k, v in value["config"].items() if k in accepted}}


def _plain(value):
    """tf_keras's tracked lists and dicts (ListWrapper, _DictWrapper) as plain ones."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        return type(value)(_plain(v) for v in value) if isinstance(value, tuple) else \
            [_plain(v) for v in value]
    return value


def _to_keras3_layer(layer):
    k3 = keras3()
    kind = type(layer).__name__
    if kind in APPLICATION_LAYERS:
        return application_layer("keras", layer)
    if kind in ("HardSwish", "HardSigmoid"):       # tftrain's layers of Keras 3 activations
        return k3.layers.Activation("hard_silu" if kind == "HardSwish" else "hard_sigmoid",
                                    name=layer.name)
    cls = getattr(k3.layers, kind, None)
    if cls is None:
        raise ValueError(f"layer {layer.name} ({kind}) has no Keras 3 form")
    back = {v: k for k, v in RENAMES.get(kind, {}).items()}
    config = {back.get(k, k): v for k, v in layer.get_config().items()}
    accepted = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            accepted |= set(inspect.signature(klass.__init__).parameters) - {"self", "kwargs"}
        if klass.__name__ == "Layer":
            break
    config = {k: _plain(v) for k, v in config.items() if k in accepted | _BASE}
    if kind == "BatchNormalization" and isinstance(config.get("axis"), list):
        config["axis"] = config["axis"][0]      # tf_keras keeps a list, Keras 3 an int
    for key, value in list(config.items()):
        if isinstance(value, dict) and "class_name" in value and "module" not in value:
            config[key] = k3.saving.deserialize_keras_object(
                {"module": f"keras.{next((v for k2, v in _OBJECTS.items() if key.endswith(k2)), 'layers')}",
                 "class_name": value["class_name"], "config": value.get("config", {}),
                 "registered_name": None})
    return cls(**config)
