"""Activation recomputation (`train.recompute`): the forward pass run in segments, each
keeping only its inputs for the backward pass and running again inside it (Chen et al.
2016, "Training Deep Nets with Sublinear Memory Cost").

The segments are `tftrain.runtime.segments`'. What a segment computes is kept nowhere:
its backward pass runs it again from its inputs, after the gradient of its outputs has
arrived (a data dependency, which XLA keeps too), and differentiates that. The last
segment runs once: the backward pass starts from its activations at once, so keeping
them costs no more memory than recomputing them would.

The second run is the same computation as the first:
- batch normalization's moving statistics update once per step: the recomputation runs
  with a momentum of 1 (the moving mean and variance assigned their own value);
- dropout drops the same elements: the first run keeps each dropout's keep-mask and
  the recomputation uses it in place of a draw (drawing again was a third of a
  transformer's recomputation). A 32-bit tensor's mask is kept as bytes (a quarter of
  it); a 16-bit tensor's, where a byte would be half, packed to bits (packing costs about
  a third of a draw). Other layers with randomness draw the same numbers again: their
  `tf.random.Generator`s are set back to the state they had before the segment's first
  run, and forward again after it (`keras.backend.experimental.enable_tf_random_generator()`
  before the model is built, as `tftrain.plan` does).
"""
from __future__ import annotations

import contextlib

import tensorflow as tf

from tftrain.core import internals
from tftrain.core.keras import keras
from tftrain.config import ConfigError
from tftrain.optim.averaging import momentum_held
from tftrain.runtime.segments import layer_calls, segments


class Recompute:
    """The forward pass of `model` in segments that recompute in the backward pass."""

    def __init__(self, model, mode: str, every: int | None = None, held=None):
        self.model = model
        self.held = held or contextlib.nullcontext
        self.nodes = layer_calls(model)
        self.segments = segments(model, mode, every)
        self.mode, self.every = mode, every
        for segment in self.segments:
            for layer in self._layers(segment):
                _check_randomness(layer)

    def __call__(self, x):
        model = self.model
        flat = tf.nest.flatten(x)
        values = {}
        for ref, value in zip(model.inputs, flat):
            values[str(id(ref))] = internals.conform_input(model, value, ref)
        for segment in self.segments:
            inputs = [values[t] for t in segment.inputs]
            # the last segment's activations are what its backward pass starts from at
            # once: kept, they cost no more memory than recomputed, and no second pass
            last = segment is self.segments[-1]
            outputs = self._compute(segment, inputs) if last else self._run(segment, inputs)
            values.update(zip(segment.outputs, outputs))
        result = [values[str(id(o))] for o in model.outputs]
        return tf.nest.pack_sequence_as(internals.nested_outputs(model), result)

    def _layers(self, segment):
        """The segment's layers and every layer inside them (an attention layer's dropout)."""
        return [inner for node in self.nodes[segment.start:segment.stop]
                for inner in [node.layer, *internals.all_layers(node.layer)]]

    def _compute(self, segment, inputs):
        values = dict(zip(segment.inputs, inputs))
        for node in self.nodes[segment.start:segment.stop]:
            ids = node.flat_input_ids           # (a tensor read twice is popped twice)
            args, kwargs = node.map_arguments({t: [values[t]] * ids.count(t) for t in ids})
            if internals.takes_training(node.layer):
                kwargs = {**kwargs, "training": True}
            outputs = node.layer(*args, **kwargs)
            values.update(zip(node.flat_output_ids, tf.nest.flatten(outputs)))
        return [values[t] for t in segment.outputs]

    def _run(self, segment, inputs):
        layers = self._layers(segment)
        generators = [g for g in map(internals.random_generator, layers) if g is not None]
        differentiable = [i for i, v in enumerate(inputs) if v.dtype.is_floating]
        fixed = {i: v for i, v in enumerate(inputs) if i not in differentiable}

        @tf.custom_gradient
        def run(*floats):
            before = [g.state.read_value() for g in generators]
            masks = {}
            with tf.control_dependencies(before), _dropouts(layers, _recording(masks)), \
                    _statistics_read(layers) as reads:
                args = _merge(floats, fixed, differentiable)
                outputs = self._compute(segment, args)
            outputs = reads(outputs)
            after = [g.state.read_value() for g in generators]

            def grad(*d_outputs, variables=None):
                # the recomputation waits for its outputs' gradient (data, not control: XLA
                # drops control dependencies), so it runs where the backward pass needs it
                gate = _zero_reading(d_outputs[0])
                restore = [g.state.assign(s) for g, s in zip(generators, before)]
                with tf.control_dependencies(restore):
                    again = [tf.identity(f) + tf.cast(gate, f.dtype) for f in floats]
                with tf.GradientTape() as tape:
                    tape.watch(again)
                    if variables:
                        tape.watch(variables)
                    # moving statistics assigned their own value: updated once a step
                    with momentum_held(_batch_norms(layers), 1.0), self.held(), \
                            _dropouts(layers, _replaying(masks)):
                        recomputed = self._compute(segment, _merge(again, fixed, differentiable))
                grads = tape.gradient(recomputed, [*again, *(variables or [])],
                                      output_gradients=list(d_outputs),
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                forward = [g.state.assign(s) for g, s in zip(generators, after)]
                with tf.control_dependencies(forward):
                    grads = [tf.identity(g) if g is not None and not isinstance(
                        g, tf.IndexedSlices) else g for g in grads]
                return grads[:len(again)], grads[len(again):]
            return outputs, grad

        outputs = run(*[inputs[i] for i in differentiable])
        return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


@contextlib.contextmanager
def _statistics_read(layers):
    """Yields `reads(outputs)`: the outputs with every layer normalization of `layers`
    traced in the block reading its batch statistics, as a plain step's backward pass
    reads them, at the cost of one reduction each and one add. oneDNN's graph rewrite
    fuses a Keras LayerNormalization (a FusedBatchNormV3 between reshapes, then a
    multiply and an add) into one `_MklLayerNorm` kernel wherever nothing else reads
    the batch norm's outputs, and that kernel rounds otherwise: a segment's first run
    would compute other values than the step without recomputation (2.7e-8 of a
    transformer's weights after 20 updates in float32, 8.7e-4 in bfloat16). The reads
    are `_zero_reading`s, added to the first output."""
    scopes = tuple(f"{layer.name}/" for layer in layers
                   if isinstance(layer, keras.layers.LayerNormalization))
    graph = None if tf.executing_eagerly() or not scopes else tf.compat.v1.get_default_graph()
    known = len(graph.get_operations()) if graph is not None else 0

    def reads(outputs):
        if graph is None:
            return outputs
        means = [op.outputs[1] for op in graph.get_operations()[known:]
                 if op.type == "FusedBatchNormV3" and any(
                     f"/{scope}" in f"/{op.name}" for scope in scopes)]
        if not means:
            return outputs
        zero = tf.add_n([_zero_reading(m) for m in means])
        return [outputs[0] + tf.cast(zero, outputs[0].dtype), *outputs[1:]]
    yield reads


def _zero_reading(t):
    """A float32 zero computed from `t`'s first element, which the graph cannot fold to a
    constant (`x * 0` it would, and the data dependency on `t` with it): min(NaN count, 0)."""
    first = tf.reshape(t, [-1])[:1]
    return tf.minimum(tf.reduce_sum(tf.cast(tf.math.is_nan(first), tf.float32)), 0.0)


def _merge(floats, fixed: dict, differentiable: list[int]) -> list:
    args = dict(fixed)
    args.update(zip(differentiable, floats))
    return [args[i] for i in range(len(args))]


@contextlib.contextmanager
def _dropouts(layers, sampler_for):
    """Each dropout layer of `layers` drawing through `sampler_for(layer)(rate,
    uniform)` (`internals.sampled_dropout`) inside the block."""
    undo = [internals.sampled_dropout(layer, sampler_for(layer)) for layer in layers]
    try:
        yield
    finally:
        for step in reversed(undo):
            if step is not None:
                step()


def _recording(masks: dict):
    """Samplers that draw from the layer's generator and keep each draw's keep-mask in
    `masks`, by layer, in the order drawn: a byte an element, or a bit (`_packed`) for a
    16-bit tensor's."""
    def sampler_for(layer):
        def with_rate(rate, uniform):
            def sample(shape, dtype):
                drawn = uniform(shape=shape, dtype=dtype)
                keep = drawn >= rate
                masks.setdefault(id(layer), []).append(_packed(keep) if _packs(dtype) else keep)
                return drawn
            return sample
        return with_rate
    return sampler_for


def _replaying(masks: dict):
    """Samplers that give the recorded keep-masks back, in their order, as draws that
    keep and drop the same elements (1 >= rate, 0 < rate): the recomputation draws
    nothing and drops what the first run dropped."""
    def sampler_for(layer):
        queue = iter(masks.get(id(layer), []))

        def with_rate(rate, uniform):
            def sample(shape, dtype):
                keep = next(queue)
                return tf.cast(_unpacked(keep, shape) if _packs(dtype) else keep, dtype)
            return sample
        return with_rate
    return sampler_for


def _packs(dtype) -> bool:
    """Whether a dropped tensor of `dtype` keeps its mask packed to bits (16-bit: a byte
    would be half of it)."""
    return dtype.size < 4


def _packed(mask):
    """A bool tensor as its bits, 8 to a byte (uint8, flat, padded to a multiple of 8).
    Eight 0/1 bytes read as one little-endian uint64 hold byte k's flag at bit 8k: shifted
    right by 7k and or-ed, bit k of the low byte. Bit operations, casts and reshapes only
    (a GPU has no uint8 or int32 sum kernel on the device)."""
    flat = tf.cast(tf.reshape(mask, [-1]), tf.uint8)
    flat = tf.pad(flat, [[0, tf.math.floormod(-tf.size(flat), 8)]])
    words = tf.bitcast(tf.reshape(flat, [-1, 8]), tf.uint64)
    gathered = words
    for k in range(1, 8):
        gathered = tf.bitwise.bitwise_or(
            gathered, tf.bitwise.right_shift(words, tf.constant(7 * k, tf.uint64)))
    return tf.cast(tf.bitwise.bitwise_and(gathered, tf.constant(0xFF, tf.uint64)), tf.uint8)


def _unpacked(packed, shape):
    """The bool tensor of `shape` whose bits `_packed` gave."""
    bits = tf.constant([1 << i for i in range(8)], tf.uint8)
    flat = tf.reshape(tf.cast(tf.bitwise.bitwise_and(packed[:, None], bits), tf.bool), [-1])
    return tf.reshape(flat[:tf.reduce_prod(shape)], shape)


def _batch_norms(layers) -> list:
    return [layer for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]


def _check_randomness(layer) -> None:
    if internals.draws_random(layer) and internals.random_generator(layer) is None:
        raise ConfigError(
            f"train.recompute: layer '{layer.name}' draws random numbers without a "
            "tf.random.Generator, so its recomputation would draw other ones; call "
            "keras.backend.experimental.enable_tf_random_generator() before building the "
            "model (tftrain.plan does)")
