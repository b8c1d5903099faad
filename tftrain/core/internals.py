"""The one door to TensorFlow's, tf_keras', Keras 3's and LiteRT's private parts.

tftrain needs a few things their public APIs do not give: a functional model's graph
(its nodes by depth, each tensor's history), where `fit` starts (the hook tf_keras'
BackupAndRestore uses), the steps a compiled train function runs per call, a LiteRT
interpreter's per-op and per-tensor details, its calibrator, the converter's strict QDQ
switch, whether the runtime has started, and the multi-worker strategy's device setup.
Each goes through a function here, checked against the versions in `CHECKED`, and
`tests/core/test_internals.py` holds one test per function that fails when a new version
removes or changes what it reads. Nothing is imported at module import: the objects
come from the caller, and the modules are imported when a function is called.
"""
from __future__ import annotations

# the versions every function here was checked against (tests/core/test_internals.py)
CHECKED = {"tensorflow": "2.21.0", "tf_keras": "2.21.0", "keras": "3.15.1",
           "ai-edge-litert": "2.3.0", "tensorflow-model-optimization": "0.8.1"}


# -- a functional model's graph (tf_keras and Keras 3 alike) ----------------------------
def history(tensor):
    """A symbolic tensor's `(layer or operation, node_index, tensor_index)`; None for a
    value that is not a functional model's tensor."""
    return getattr(tensor, "_keras_history", None)


def is_symbolic(value) -> bool:
    """Whether `value` is a tensor of a functional model under construction."""
    return hasattr(value, "_keras_history")


def has_graph(model) -> bool:
    """Whether `model` is a graph of layers (functional or Sequential), not a subclass."""
    return hasattr(model, "_nodes_by_depth")


def nodes_by_depth(model) -> dict:
    """{depth: nodes} of a functional model (depth 0: the outputs)."""
    return model._nodes_by_depth


def nodes_in_order(model) -> list:
    """A functional model's nodes, inputs first (deepest depth first)."""
    graph = nodes_by_depth(model)
    return [node for depth in sorted(graph, reverse=True) for node in graph[depth]]


def inbound_nodes(layer) -> list:
    """The nodes where `layer` was called (one per call)."""
    return layer._inbound_nodes


def outbound_nodes(layer) -> list:
    """The nodes that take `layer`'s outputs."""
    return layer._outbound_nodes


def in_network(model, layer, index: int) -> bool:
    """Whether call `index` of `layer` is a node of `model`'s own graph (a shared layer's
    calls from elsewhere are not)."""
    return f"{layer.name}_ib-{index}" in model._network_nodes


def all_layers(model) -> list:
    """Every layer inside `model`, nested models' layers included, not `model` itself."""
    return list(model._flatten_layers(include_self=False))


def tensor_usage(model) -> dict:
    """{tensor id: how many layers of `model` read it} (tf_keras)."""
    return model._tensor_usage_count


def node_input_ids(node) -> list[str]:
    """The ids (as `tensor_usage` keys them) of the tensors a node's layer reads."""
    return [tensor_id for tensor_id, _ in node._keras_inputs_ids_and_indices]


def graph_of(model):
    """What holds a model's graph of layers: a Keras 3 Sequential's inner functional
    model, else the model itself."""
    return getattr(model, "_functional", None) or model


def is_graph_network(model) -> bool:
    """Whether a tf_keras model is functional or Sequential (not subclassed)."""
    return getattr(model, "_is_graph_network", False)


def takes_training(layer) -> bool:
    """Whether `layer.call` takes a `training` argument."""
    return layer._call_spec.expects_training_arg


def attention(layer) -> dict:
    """A Keras `MultiHeadAttention`'s configuration as the layer holds it (`query_shape`:
    None before it is built)."""
    return {"num_heads": layer._num_heads, "key_dim": layer._key_dim,
            "value_dim": layer._value_dim, "use_bias": layer._use_bias,
            "dropout": layer._dropout, "attention_axes": layer._attention_axes,
            "output_shape": layer._output_shape,
            "query_shape": getattr(layer, "_query_shape", None)}


def conform_input(model, value, reference):
    """`value` as a functional model conforms an input for `reference` (its Input)."""
    return model._conform_to_reference_input(value, ref_input=reference)


def nested_outputs(model):
    """A functional model's outputs in the structure it returns them."""
    return model._nested_outputs


def draws_random(layer) -> bool:
    """Whether a layer has a Keras random generator (dropout and the like)."""
    random = getattr(layer, "_random_generator", None)
    return random is not None and hasattr(random, "_maybe_init")


def random_generator(layer):
    """The `tf.random.Generator` behind a layer's randomness (dropout's masks), created
    if it is not yet; None for a layer without one."""
    random = getattr(layer, "_random_generator", None)
    if random is None or not hasattr(random, "_maybe_init"):
        return None
    random._maybe_init()
    return getattr(random, "_generator", None)


def sampled_dropout(layer, sampler_for):
    """Replaces, until the returned undo is called, the uniform draws of a layer's
    dropout (tf_keras' `RandomGenerator.dropout` on a `tf.random.Generator`) by
    `sampler_for(rate, uniform)`, a `uniform_sampler` for
    `tf.nn.experimental.general_dropout` (with which the generator's own dropout calls
    its generator's `uniform`, given as `uniform`); None (nothing replaced) for a layer
    whose dropout draws otherwise."""
    import tensorflow as tf
    random = getattr(layer, "_random_generator", None)
    if random is None or not hasattr(random, "_maybe_init") or "dropout" in vars(random):
        return None
    random._maybe_init()
    if random._rng_type != random.RNG_STATEFUL:
        return None

    def dropout(inputs, rate, noise_shape=None):
        return tf.nn.experimental.general_dropout(
            inputs, rate=rate, noise_shape=noise_shape,
            uniform_sampler=sampler_for(rate, random._generator.uniform))
    random.dropout = dropout
    return lambda: vars(random).pop("dropout", None)


def loss_scale(optimizer):
    """A `LossScaleOptimizer`'s dynamic loss scale (`current_loss_scale`, `counter`), or
    None for any other optimizer."""
    scale = getattr(optimizer, "_loss_scale", None)
    return scale if hasattr(scale, "counter") else None


def learning_rate(optimizer):
    """The optimizer's learning rate as given: a schedule itself, or a variable
    (`optimizer.learning_rate` gives a schedule's last value)."""
    return optimizer._learning_rate


# -- fit and the train function (tf_keras) ----------------------------------------------
def optimizer_slots(optimizer, variable, *lists: str) -> list:
    """A tf_keras optimizer's slot variables of `variable` from its slot lists (Adam's
    `_momentums` and `_velocities`, SGD's `momentums`), by the variable's index."""
    index = optimizer._index_dict[optimizer._var_key(variable)]
    return [getattr(optimizer, name)[index] for name in lists]


def step_counters(model) -> tuple:
    """A tf_keras model's train and test step counters (the variables `fit` and
    `evaluate` count their steps in)."""
    return model._train_counter, model._test_counter


def cluster_coordinator(model):
    """The parameter-server coordinator a tf_keras model trains through (None: none)."""
    return model._cluster_coordinator


def write_train_graph_once(board) -> None:
    """Have a tf_keras TensorBoard callback write the training graph now, once (it
    writes it at the first batch's end otherwise)."""
    if board._should_write_train_graph:
        board._write_keras_model_train_graph()
        board._should_write_train_graph = False


def start_fit_at(model, resume) -> None:
    """Make `model.fit` start at the (epoch, step) `resume` gives
    (`maybe_load_initial_counters_from_ckpt`), or from the beginning (None)."""
    model._training_state = resume


def steps_per_execution(model):
    """The variable holding the steps `model`'s train function runs per call."""
    return model._steps_per_execution


# -- tfmot's QAT wrappers ------------------------------------------------------------------
def qat_weights(wrapper) -> list:
    """A `QuantizeWrapper`'s `(weight, quantizer, quantizer variables)` per quantized
    weight ([] for any other layer)."""
    return getattr(wrapper, "_weight_vars", [])


def qat_activations(wrapper) -> list[tuple[str, object, dict | None]]:
    """A QAT wrapper's activation quantizers: `(stage, quantizer, range variables)` for
    the activation's input (`pre`) and output (`post`) and the layer's `output`; an
    activation inside the layer's computation, not its `activation` (a speech feature
    layer's spectrum), as `inner-pre` and `inner-post`, in the config's order."""
    found = []
    own = getattr(getattr(wrapper, "layer", None), "activation", None)
    for activation in getattr(wrapper, "_quantize_activations", []):
        inner = "" if activation is own else "inner-"
        found += [(inner + "pre", activation.quantizer,
                   getattr(activation, "_pre_activation_vars", None)),
                  (inner + "post", activation.quantizer,
                   getattr(activation, "_post_activation_vars", None))]
    if getattr(wrapper, "_output_quantizers", None):
        found.append(("output", wrapper._output_quantizers[0], wrapper._output_quantizer_vars))
    return found


def prunable_weight_names(layer) -> list[str]:
    """The weights tfmot's registry prunes of a built-in layer."""
    from tensorflow_model_optimization.python.core.sparsity.keras import prune_registry
    return prune_registry.PruneRegistry._weight_names(layer)


# -- LiteRT -----------------------------------------------------------------------------
def tflite_schema():
    """The TFLite flatbuffer schema (object API), to read and rewrite a file's ops."""
    from tensorflow.lite.python import schema_py_generated
    return schema_py_generated

def ops_details(interp) -> list[dict]:
    """Every op of a LiteRT interpreter's model, in execution order: `op_name`, `inputs`,
    `outputs` (tensor indices)."""
    return interp._get_ops_details()


def tensor_details(interp, index: int) -> dict:
    """A tensor's details (name, shape, dtype, quantization), intermediate tensors too
    (the public `get_tensor_details` lists only some)."""
    return interp._get_tensor_details(index, 0)


def calibrator_class():
    """LiteRT's calibrator, whose `calibrate(self, dataset_gen)` records each tensor's
    range for post-training quantization (`export.calibration` measures them again)."""
    from tensorflow.lite.python.optimize import calibrator
    return calibrator.Calibrator


def strict_qdq(converter) -> None:
    """A QAT conversion where an op whose kernel has no fake-quant stays float, not
    requantized."""
    converter._experimental_strict_qdq = True


# -- the runtime and distribution ---------------------------------------------------------
def op_determinism() -> bool:
    """Whether op determinism is on in this process (no public getter)."""
    from tensorflow.python.framework import config as tf_config
    return tf_config.is_op_determinism_enabled()


def set_op_determinism(on: bool) -> None:
    """Turn op determinism on or off (no public way to turn it off)."""
    from tensorflow.python.framework import config as tf_config
    (tf_config.enable_op_determinism if on else tf_config.disable_op_determinism)()


def runtime_started(devices_listed: bool = True) -> bool:
    """Whether TensorFlow's runtime has started in this process: an op ran (its context
    exists), or (`devices_listed`) its devices were listed."""
    from tensorflow.python.eager import context
    ctx = context.context()
    return ctx._context_handle is not None or (devices_listed and
                                               ctx._physical_devices is not None)


def local_devices() -> list:
    """The local devices with their details (a GPU's `physical_device_desc`: name and
    compute capability), which `tf.config` does not give."""
    from tensorflow.python.client import device_lib
    return device_lib.list_local_devices()


def unmatched(status) -> list:
    """The program's objects a restore found no value for in the checkpoint (what
    `status.assert_existing_objects_matched()` complains of)."""
    from tensorflow.python.checkpoint.checkpoint import _objects_with_attributes
    from tensorflow.python.util.object_identity import ObjectIdentitySet
    loaded = status._checkpoint
    return list(ObjectIdentitySet(_objects_with_attributes(loaded.all_python_objects))
                - ObjectIdentitySet(loaded.object_by_proto_id.values()))


def all_reduce(strategy) -> tuple:
    """(the cross-device ops of a MirroredStrategy, the communication options of a
    multi-worker one); None where the strategy has none."""
    ext = strategy.extended
    return (getattr(ext, "_cross_device_ops", None),
            getattr(ext, "_communication_options", None))


def stop_server(server) -> None:
    """Stop a tf.data service dispatcher or worker (their `join` blocks signals)."""
    server._stop()


def graph_function(graph, name: str):
    """The function `name` a FuncGraph (or an outer one) defines; None if it does not."""
    try:
        return graph._get_function(name)
    except (AttributeError, KeyError):
        return None


def concrete_functions(function) -> list:
    """Every concrete function a `tf.function` traced."""
    return function._list_all_concrete_functions()


def collective_extended():
    """MultiWorkerMirroredStrategy's extended class, whose
    `_initialize_local_devices(cluster_resolver, worker_device) -> (devices, kind)` a
    subclass overrides to replicate over a task's virtual CPUs."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    return cars.CollectiveAllReduceExtended


def take_tensor_logs(callback) -> None:
    """Keras hands `callback` its logs as tensors (`_supports_tf_logs`), so it need not
    copy every call's logs to the host for it. Set on the instance: `Callback.__init__`
    sets it False there, which hides a class attribute of that name."""
    callback._supports_tf_logs = True


def logs_copied_by(callbacks) -> list[str]:
    """The classes of `callbacks` for which Keras copies every training call's logs to
    the host (a batch hook and no `take_tensor_logs`): one such callback makes every
    call wait for its step to finish before the next is dispatched."""
    return sorted({type(c).__name__ for c in callbacks
                   if c._implements_train_batch_hooks()
                   and not getattr(c, "_supports_tf_logs", False)})
