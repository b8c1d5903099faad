"""Operations applied to tensors, made layers: the forms Keras Applications write.

MobileNetV3 writes its hard-sigmoid as `ReLU(6)(x + 3) * (1/6)` and its hard-swish as
`Multiply()([x, hard_sigmoid(x)])` (tf_keras: `TFOpLambda` layers for `+ 3` and `* 1/6`;
Keras 3: bare operations, converted by `keras3.py` to `Rescaling`), and EfficientNet and
MobileNetV3 put two or three elementwise affine layers at their input (tftrain's
`Preprocess`, `Rescaling`, `Normalization`). Layers are what pruning, quantization-aware
training and reports work on, so `as_layers` rewrites a tf_keras functional model:

- a `TFOpLambda` adding, subtracting, multiplying or dividing a tensor by a constant
  becomes a `Rescaling(scale, offset)`;
- `Rescaling(1, 3) -> ReLU(6) -> Rescaling(1/6)` becomes one `HardSigmoid`, and
  `Multiply([x, HardSigmoid(x)])` one `HardSwish`;
- consecutive elementwise affine layers, each read only by the next, become one
  `Rescaling` (per channel where one of them is), and none where they cancel out (the
  `x * 255` of `Preprocess` and the `1/255` of EfficientNet's `Rescaling`);
- a global average pooling reshaped to (1, 1, C) becomes the pooling with `keepdims`,
  and a convolution with a swish, sigmoid, tanh or gelu built in becomes the
  convolution and an `Activation` (what int8 files run as static, quantized ops);
- a convolution with a group per input channel (ConvNeXt's) becomes a
  `DepthwiseConv2D`.

The rewritten model computes what the original does (weights copied by layer); a model
with none of these forms is returned as it is.
"""
from __future__ import annotations


import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.core import internals
from tftrain.models.hard_swish import HardSigmoid, HardSwish

_SCALAR_OPS = {"__operators__.add": "add", "math.add": "add", "math.subtract": "subtract",
               "__operators__.subtract": "subtract", "math.multiply": "multiply",
               "__operators__.multiply": "multiply", "math.truediv": "divide",
               "math.divide": "divide", "__operators__.truediv": "divide"}


def as_layers(model):
    """`model` with the operations above as layers (the same model when it has none)."""
    nodes = internals.nodes_in_order(model)
    graph = _Graph(model, nodes)
    if not graph.rewrites():
        return model
    return graph.rebuild()


def affine_of(layer, node=None):
    """(scale, offset) of an elementwise affine layer (`x * scale + offset`, each a scalar
    or per channel), or None: `Rescaling`, `Normalization`, tftrain's `Preprocess` in
    its "tf" and "none" modes, and a `TFOpLambda` of +, -, * or / with a constant (its
    `node` says which argument is the tensor)."""
    kind = type(layer).__name__
    if kind == "Rescaling":
        return np.asarray(layer.scale, "float64"), np.asarray(layer.offset, "float64")
    if kind == "Preprocess" and layer.mode in ("tf", "none"):
        return (np.float64(2.0), np.float64(-1.0)) if layer.mode == "tf" else \
            (np.float64(255.0), np.float64(0.0))
    if kind == "Normalization" and not layer.invert and layer.built:
        # built, `mean` and `variance` are the adapted weights or the given constants
        mean, variance = (np.asarray(tf.convert_to_tensor(v), "float64").reshape(-1)
                          for v in (layer.mean, layer.variance))
        std = np.maximum(np.sqrt(variance), keras.backend.epsilon())
        return 1.0 / std, -mean / std
    if kind != "TFOpLambda" or node is None:
        return None
    op = _SCALAR_OPS.get(getattr(layer, "symbol", ""))
    args = list(node.call_args)
    if op is None or len(args) != 2 or any(v is not None for k, v in node.call_kwargs.items()
                                          if k != "name"):
        return None
    tensor_first = internals.is_symbolic(args[0])
    constant = args[1] if tensor_first else args[0]
    if internals.is_symbolic(constant) or np.ndim(constant) != 0:
        return None
    c = np.float64(constant)
    if op == "add":
        return np.float64(1.0), c
    if op == "multiply":
        return c, np.float64(0.0)
    if op == "subtract":
        return (np.float64(1.0), -c) if tensor_first else (np.float64(-1.0), c)
    return (1.0 / c, np.float64(0.0)) if tensor_first and c != 0 else None


class _Graph:
    """A tf_keras functional graph read node by node: which nodes become other layers."""

    def __init__(self, model, nodes):
        self.model, self.nodes = model, nodes
        self.consumers: dict[tuple, int] = {}
        for node in nodes:
            for t in tf.nest.flatten(node.call_args):
                if internals.is_symbolic(t):
                    self.consumers[_key(t)] = self.consumers.get(_key(t), 0) + 1
        for t in model.outputs:
            self.consumers[_key(t)] = self.consumers.get(_key(t), 0) + 1
        self.plan: dict[int, tuple] = {}          # id(node) -> (kind, source tensor, value)
        for node in nodes:
            found = (self._hard_swish(node) or self._hard_sigmoid(node) or self._affine(node)
                     or self._kept_dims(node) or self._depthwise(node)
                     or self._split_activation(node)
                     or self._tensor_sum(node) or self._nested(node))
            if found is not None:
                self.plan[id(node)] = found

    def rewrites(self) -> bool:
        """Whether anything is rewritten (a single affine layer stays as it is)."""
        return any(self._rewritten(node, self.plan[id(node)]) for node in self.nodes
                   if id(node) in self.plan)

    # -- patterns, read on the original graph ------------------------------------------
    def _producer(self, tensor):
        layer, node_index, _ = internals.history(tensor)
        return layer, internals.inbound_nodes(layer)[node_index]

    def _single_input(self, node):
        inputs = [t for t in tf.nest.flatten(node.call_args) if internals.is_symbolic(t)]
        return inputs[0] if len(inputs) == 1 else None

    def _affine(self, node):
        """("affine", source tensor, (scale, offset, layers merged)) for an affine layer,
        merged with the affine layers before it that only it reads."""
        found = affine_of(node.layer, node)
        source = self._single_input(node)
        if found is None or source is None:
            return None
        scale, offset, merged = found[0], found[1], 1
        before = self.plan.get(id(self._producer(source)[1]))
        if before and before[0] == "affine" and self.consumers.get(_key(source)) == 1:
            # (x * s1 + o1) * s2 + o2
            s1, o1, n = before[2]
            scale, offset, merged = s1 * scale, o1 * found[0] + offset, n + 1
            source = before[1]
        return "affine", source, (scale, offset, merged)

    def _hard_sigmoid(self, node):
        """("hard_sigmoid", x, None) at the `* 1/6` of `ReLU(6)(x + 3) * (1/6)`."""
        tail = affine_of(node.layer, node)
        source = self._single_input(node)
        if tail is None or source is None or not _near(tail, 1 / 6, 0.0):
            return None
        relu, relu_node = self._producer(source)
        if not (isinstance(relu, keras.layers.ReLU) and _relu6(relu)):
            return None
        inner = self._single_input(relu_node)
        add, add_node = self._producer(inner)
        head = affine_of(add, add_node)
        if head is None or not _near(head, 1.0, 3.0):
            return None
        return "hard_sigmoid", self._single_input(add_node), None

    def _hard_swish(self, node):
        """("hard_swish", x, None) at `Multiply([x, hard_sigmoid(x)])` (either order)."""
        if not isinstance(node.layer, keras.layers.Multiply):
            return None
        inputs = [t for t in tf.nest.flatten(node.call_args) if internals.is_symbolic(t)]
        if len(inputs) != 2:
            return None
        for x, gate in (inputs, inputs[::-1]):
            found = self._hard_sigmoid(self._producer(gate)[1])
            if found is not None and _key(found[1]) == _key(x):
                return "hard_swish", x, None
        return None

    def _kept_dims(self, node):
        """("kept_dims", x, pooling config) at a `Reshape` to (1, 1, C) of a global
        average pooling only it reads (EfficientNet's squeeze): the pooling with
        `keepdims` computes the same as a static MEAN, where the Keras reshape takes its
        batch size from the tensor (SHAPE, STRIDED_SLICE, PACK: ops XNNPack leaves)."""
        if not isinstance(node.layer, keras.layers.Reshape):
            return None
        source = self._single_input(node)
        pool, pool_node = self._producer(source)
        if type(pool) is not keras.layers.GlobalAveragePooling2D or pool.keepdims or \
                self.consumers.get(_key(source)) != 1 or \
                tuple(node.layer.target_shape) != (1, 1, int(source.shape[-1])):
            return None
        return "kept_dims", self._single_input(pool_node), pool.get_config()

    def _depthwise(self, node):
        """("depthwise", x, None) at a `Conv2D` with as many groups as input channels and
        filters (ConvNeXt's 7x7 convolutions): a `DepthwiseConv2D` computes the same,
        which TensorFlow runs 15x faster on a CPU (ConvNeXtTiny's first, a batch of 32
        at 8 x 8 x 96: 144 ms -> 9.6 ms), tfmot quantizes per channel and TFLite runs as
        DEPTHWISE_CONV_2D (kernel (h, w, 1, C) read as (h, w, C, 1))."""
        layer = node.layer
        source = self._single_input(node)
        if type(layer) is not keras.layers.Conv2D or layer.groups == 1 or source is None \
                or layer.data_format != "channels_last" \
                or not int(source.shape[-1]) == layer.filters == layer.groups:
            return None
        return "depthwise", source, None

    def _split_activation(self, node):
        """("split", x, config) at a convolution whose built-in activation
        tfmot quantizes only after it (swish, sigmoid, tanh, gelu): EfficientNet's
        squeeze-excite `Conv2D(activation="swish")` left its convolution's output float in
        the int8 file (CONV_2D, LOGISTIC, MUL in float, 16 times). As the layer with a
        linear output and an `Activation`, the output is quantized between them."""
        layer = node.layer
        if type(layer) not in (keras.layers.Conv2D, keras.layers.DepthwiseConv2D):
            return None
        name = keras.activations.serialize(layer.activation)
        name = name if isinstance(name, str) else getattr(layer.activation, "__name__", "")
        if name not in ("swish", "silu", "sigmoid", "tanh", "gelu"):
            return None
        return "split", self._single_input(node), (layer, name)

    def _tensor_sum(self, node):
        """("sum", (x, y), None) at a `TFOpLambda` adding two tensors of one shape
        (ConvNeXt's residual `x + layer_scale(...)`): as an `Add`, which QAT quantizes."""
        if not _is_op(node.layer) or _SCALAR_OPS.get(getattr(node.layer, "symbol", "")) != "add":
            return None
        args = list(node.call_args)
        if len(args) != 2 or not all(internals.is_symbolic(a) for a in args) or \
                tuple(args[0].shape) != tuple(args[1].shape) or \
                any(v is not None for k, v in node.call_kwargs.items() if k != "name"):
            return None
        return "sum", tuple(args), None

    def _nested(self, node):
        """("inline", x, None) at a `Sequential` called inside the model (ConvNeXt's
        stem and downsampling blocks): its layers become the model's, in their order,
        so pruning and QAT reach them. Called more than once, its weights are shared, and
        it stays whole."""
        if not isinstance(node.layer, keras.Sequential) or \
                sum(other.layer is node.layer for other in self.nodes) != 1:
            return None
        source = self._single_input(node)
        return None if source is None else ("inline", source, None)

    # -- the new graph -----------------------------------------------------------------
    def rebuild(self, on=None):
        """The model with the planned rewrites, its other layers copied; with `on` (a
        tensor), its graph made on `on` instead of an input: its output tensor."""
        made, outputs, copies = {}, {}, []
        names = {layer.name for layer in self.model.layers}

        def mapped(t):
            return outputs[_key(t)]

        for node in self.nodes:
            layer = node.layer
            if isinstance(layer, keras.layers.InputLayer):
                t = layer.output
                outputs[(layer.name, 0, 0)] = on if on is not None else keras.Input(
                    shape=tuple(t.shape[1:]), dtype=t.dtype, name=layer.name)
                continue
            entry = self.plan.get(id(node))
            node_index = internals.inbound_nodes(layer).index(node)
            if entry is not None and self._rewritten(node, entry):
                kind, source, value = entry
                if kind == "split":
                    linear = layer.__class__.from_config({**layer.get_config(),
                                                          "activation": "linear"})
                    copies.append((layer, linear))
                    result = keras.layers.Activation(value[1], name=_fresh(
                        f"{layer.name}_activation", names))(linear(mapped(source)))
                elif kind == "affine" and _identity(value[0], value[1]):
                    result = mapped(source)
                elif kind == "sum":
                    result = keras.layers.Add(name=_fresh(f"{layer.name}_add", names))(
                        [mapped(t) for t in source])
                elif kind == "depthwise":
                    if layer.name not in made:          # (a layer called twice: shared)
                        made[layer.name] = _as_depthwise(layer)
                        copies.append((layer, made[layer.name]))
                    result = made[layer.name](mapped(source))
                elif kind == "inline":
                    result = mapped(source)
                    for inner in layer.layers:
                        made_inner = inner.__class__.from_config(
                            {**inner.get_config(), "name": _fresh(inner.name, names)})
                        copies.append((inner, made_inner))
                        result = made_inner(result)
                else:
                    result = self._replacement(kind, value, layer.name, names)(mapped(source))
            else:
                if layer.name not in made:
                    made[layer.name] = layer.__class__.from_config(layer.get_config())
                    copies.append((layer, made[layer.name]))
                args = tf.nest.map_structure(
                    lambda v: mapped(v) if internals.is_symbolic(v) else v, node.call_args)
                kwargs = {k: tf.nest.map_structure(
                    lambda v: mapped(v) if internals.is_symbolic(v) else v, v)
                    for k, v in node.call_kwargs.items() if v is not None}
                result = made[layer.name](*args, **kwargs)
            for i, t in enumerate(tf.nest.flatten(result)):
                outputs[(layer.name, node_index, i)] = t
        if on is not None:
            _copy_weights(copies)
            return mapped(self.model.outputs[0])
        new = keras.Model([mapped(t) for t in self.model.inputs] if len(self.model.inputs) > 1
                          else mapped(self.model.inputs[0]),
                          [mapped(t) for t in self.model.outputs] if len(self.model.outputs) > 1
                          else mapped(self.model.outputs[0]), name=self.model.name)
        _copy_weights(copies, {id(layer) for layer in new.layers})
        return new

    @staticmethod
    def _rewritten(node, entry) -> bool:
        if entry[0] != "affine":
            return True
        scale, offset, merged = entry[2]
        return merged > 1 or _is_op(node.layer) or _identity(scale, offset)

    @staticmethod
    def _replacement(kind, value, name, names):
        if kind == "hard_swish":
            return HardSwish(name=name)
        if kind == "hard_sigmoid":
            return HardSigmoid(name=_fresh(f"{name}_hard_sigmoid", names))
        if kind == "kept_dims":
            return keras.layers.GlobalAveragePooling2D(
                **{**value, "keepdims": True, "name": _fresh(f"{value['name']}_kept", names)})
        scale, offset, _ = value
        return keras.layers.Rescaling(_plain(scale), _plain(offset),
                                      name=_fresh(f"{name}_affine", names))


def called_on(model, x):
    """`model`'s graph (one input, one output) made again on the tensor `x`, its layers
    copied with their weights: its output tensor. For a Keras Applications backbone that
    built itself on the `Input` under its `input_tensor`, skipping what came between
    (tf_keras' ConvNeXt and RegNet)."""
    graph = _Graph(model, internals.nodes_in_order(model))
    graph.plan = {}
    return graph.rebuild(on=x)


def _copy_weights(copies, kept: set | None = None) -> None:
    """Each (original, copy) pair's weights into the copy, where the copy is in `kept`
    (ids; None: every copy); a kernel read in another shape (a depthwise one) reshaped."""
    for old, layer in copies:
        if kept is None or id(layer) in kept:
            layer.set_weights([np.reshape(w, tuple(v.shape)) for w, v in
                               zip(old.get_weights(), layer.weights)])


def _as_depthwise(layer):
    """The `DepthwiseConv2D` (depth multiplier 1) a fully grouped `Conv2D` is, same name."""
    config = layer.get_config()
    return keras.layers.DepthwiseConv2D(
        depthwise_initializer=config["kernel_initializer"],
        depthwise_regularizer=config["kernel_regularizer"],
        depthwise_constraint=config["kernel_constraint"],
        **{k: config[k] for k in ("kernel_size", "strides", "padding", "data_format",
                                  "dilation_rate", "activation", "use_bias", "bias_initializer",
                                  "bias_regularizer", "activity_regularizer", "bias_constraint",
                                  "name", "trainable", "dtype")})


def _key(tensor) -> tuple:
    layer, node_index, tensor_index = internals.history(tensor)
    return layer.name, node_index, tensor_index


def _is_op(layer) -> bool:
    return type(layer).__name__ == "TFOpLambda"


def _relu6(layer) -> bool:
    config = layer.get_config()
    return (config.get("max_value") is not None and float(config["max_value"]) == 6.0
            and not config.get("negative_slope") and not config.get("threshold"))


def _near(affine, scale: float, offset: float) -> bool:
    s, o = affine
    return bool(np.ndim(s) == 0 and np.ndim(o) == 0 and abs(s - scale) <= 1e-6 * abs(scale)
                and abs(o - offset) <= 1e-6)


def _identity(scale, offset) -> bool:
    return bool(np.all(np.abs(np.asarray(scale) - 1.0) <= 1e-7)
                and np.all(np.abs(np.asarray(offset)) <= 1e-7))


def _plain(value):
    value = np.asarray(value, "float64")
    return float(value) if value.ndim == 0 else [float(v) for v in value.reshape(-1)]


def _fresh(name: str, names: set) -> str:
    found, i = name, 1
    while found in names:
        i += 1
        found = f"{name}_{i}"
    names.add(found)
    return found
