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


# -- fit and the train function (tf_keras) ----------------------------------------------
def start_fit_at(model, resume) -> None:
    """Make `model.fit` start at the (epoch, step) `resume` gives
    (`maybe_load_initial_counters_from_ckpt`), or from the beginning (None)."""
    model._training_state = resume


def steps_per_execution(model):
    """The variable holding the steps `model`'s train function runs per call."""
    return model._steps_per_execution


# -- LiteRT -----------------------------------------------------------------------------
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


def collective_extended():
    """MultiWorkerMirroredStrategy's extended class, whose
    `_initialize_local_devices(cluster_resolver, worker_device) -> (devices, kind)` a
    subclass overrides to replicate over a task's virtual CPUs."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    return cars.CollectiveAllReduceExtended
