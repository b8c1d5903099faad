"""One test per private attribute tftrain reads (`tftrain.core.internals`): each fails
when a new TensorFlow, tf_keras, Keras 3 or LiteRT removes it or changes what it holds."""
import importlib.metadata

import numpy as np
import pytest
import tensorflow as tf

from tftrain.core import internals
from tftrain.core.keras import keras, keras3


def _model():
    inputs = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(3, name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="logits")(keras.layers.ReLU(name="relu")(hidden))
    return keras.Model(inputs, outputs), hidden


def test_the_installed_versions_are_those_checked_or_the_tests_below_say_what_changed():
    installed = {name: importlib.metadata.version(name) for name in internals.CHECKED}
    assert set(installed) == {"tensorflow", "tf_keras", "keras", "ai-edge-litert",
                              "tensorflow-model-optimization"}
    # a newer version is allowed; these tests then say whether the internals still hold
    assert all(tuple(map(int, installed[n].split(".")[:2])) >=
               tuple(map(int, v.split(".")[:2])) for n, v in internals.CHECKED.items()), installed


def test_history_names_the_layer_call_and_output_of_a_symbolic_tensor():
    model, hidden = _model()
    layer, node, index = internals.history(hidden)
    assert layer.name == "hidden" and (node, index) == (0, 0)
    assert internals.is_symbolic(hidden) and not internals.is_symbolic(np.zeros(3))
    assert internals.history(np.zeros(3)) is None
    k3 = keras3()
    x3 = k3.Input((4,))
    y3 = k3.layers.Dense(2, name="k3dense")(x3)
    assert internals.history(y3).operation.name == "k3dense" and internals.history(y3).node_index == 0


def test_nodes_come_inputs_first_and_say_their_layers():
    model, _ = _model()
    assert internals.has_graph(model) and not internals.has_graph(keras.layers.Dense(2))
    order = [node.layer.name for node in internals.nodes_in_order(model)]
    assert order == ["x", "hidden", "relu", "logits"]
    assert max(internals.nodes_by_depth(model)) == 3        # depth 0: the outputs
    k3 = keras3()
    x3 = k3.Input((4,), name="k3x")
    m3 = k3.Model(x3, k3.layers.Dense(2, name="k3d")(x3))
    assert [n.operation.name for n in internals.nodes_in_order(m3)] == ["k3x", "k3d"]


def test_a_layers_inbound_and_outbound_nodes_and_its_calls_in_a_model():
    model, hidden = _model()
    dense = model.get_layer("hidden")
    assert len(internals.inbound_nodes(dense)) == 1
    assert [node.layer.name for node in internals.outbound_nodes(dense)] == ["relu"]
    shared_call = dense(keras.Input((4,)))                  # a call outside the model
    assert len(internals.inbound_nodes(dense)) == 2 and internals.is_symbolic(shared_call)
    assert internals.in_network(model, dense, 0) and not internals.in_network(model, dense, 1)


def test_all_layers_reach_inside_nested_models():
    inner, _ = _model()
    inputs = keras.Input((4,))
    outer = keras.Model(inputs, keras.layers.Softmax(name="probs")(inner(inputs)))
    names = [layer.name for layer in internals.all_layers(outer)]
    assert {"hidden", "relu", "logits", "probs"} <= set(names) and outer.name not in names


def test_fit_starts_where_the_training_state_says():
    from tftrain.training.callbacks import ResumePoint
    model, _ = _model()
    model.compile("sgd", "mse", steps_per_execution=1)
    x, y = np.ones((20, 4), np.float32), np.zeros((20, 2), np.float32)
    internals.start_fit_at(model, ResumePoint(7))     # epoch 1, step 2 of 5 per epoch
    try:
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    finally:
        internals.start_fit_at(model, None)
    assert int(model.optimizer.iterations.numpy()) == 3


class _Seen(keras.callbacks.Callback):
    """Records the type of each training call's loss as the callbacks receive it."""

    def __init__(self, tensors: bool):
        super().__init__()
        self.types = []
        if tensors:
            internals.take_tensor_logs(self)

    def on_train_batch_end(self, batch, logs=None):
        self.types.append(type(logs["loss"]))


@pytest.mark.parametrize("plain", [False, True])
def test_a_fit_hands_its_callbacks_tensor_logs_unless_one_needs_them_copied(plain):
    """Keras copies every call's logs to the host (a wait for the step) as soon as one
    callback with a batch hook has not taken tensors; `logs_copied_by` names it."""
    model, _ = _model()
    model.compile("sgd", "mse")
    seen, others = _Seen(tensors=True), [_Seen(tensors=False)] if plain else []
    assert internals.logs_copied_by([seen, *others]) == (["_Seen"] if plain else [])
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[seen, *others])
    assert len(seen.types) == 2
    assert all(issubclass(t, tf.Tensor) != plain for t in seen.types), seen.types


def test_steps_per_execution_is_the_variable_keras_runs_its_train_function_with():
    model, _ = _model()
    model.compile("sgd", "mse", steps_per_execution=4)
    variable = internals.steps_per_execution(model)
    assert isinstance(variable, tf.Variable) and int(variable.numpy()) == 4


@pytest.fixture(scope="module")
def int8_file():
    # seeded weights, and calibration inputs of both signs: inputs along one direction
    # (ones times 0..3) left every ReLU at zero for 1 initialization in 8, a range of
    # zero that XNNPACK refuses to prepare
    keras.utils.set_random_seed(0)
    model, _ = _model()
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    samples = np.random.default_rng(0).normal(size=(16, 1, 4)).astype(np.float32)
    converter.representative_dataset = lambda: ([x] for x in samples)
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    return converter.convert()


def test_litert_lists_each_op_and_each_tensors_details(int8_file):
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_content=int8_file)
    interp.allocate_tensors()
    ops = internals.ops_details(interp)
    assert [op["op_name"] for op in ops].count("FULLY_CONNECTED") == 2
    last = [op for op in ops if op["op_name"] == "FULLY_CONNECTED"][-1]
    detail = internals.tensor_details(interp, last["outputs"][0])
    assert detail["dtype"] == np.int8 and detail["quantization_parameters"]["scales"].size == 1
    assert {"name", "shape", "index"} <= set(detail)


def test_the_calibrator_records_ranges_through_calibrate():
    import inspect
    calibrator = internals.calibrator_class()
    assert list(inspect.signature(calibrator.calibrate).parameters) == ["self", "dataset_gen"]
    seen = []
    original = calibrator.calibrate

    def calibrate(self, dataset_gen):
        seen.append(True)
        return original(self, dataset_gen)
    calibrator.calibrate = calibrate
    try:
        model, _ = _model()
        converter = tf.lite.TFLiteConverter.from_keras_model(model)
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = lambda: ([np.ones((1, 4), np.float32)] for _ in range(2))
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.convert()
    finally:
        calibrator.calibrate = original
    assert seen == [True]


def test_strict_qdq_is_a_converter_switch_off_by_default():
    model, _ = _model()
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    assert converter._experimental_strict_qdq is False
    internals.strict_qdq(converter)
    assert converter._experimental_strict_qdq is True


def test_op_determinism_can_be_read_and_turned_off_again():
    before = internals.op_determinism()
    try:
        internals.set_op_determinism(True)
        assert internals.op_determinism()
        with pytest.raises(tf.errors.FailedPreconditionError, match="determinism"):
            tf.timestamp()                 # what tftrain relies on it for: no clocks then
        internals.set_op_determinism(False)
        assert not internals.op_determinism()
    finally:
        internals.set_op_determinism(before)


def test_the_runtime_has_started_once_an_op_ran():
    tf.constant(1.0) + 1.0
    assert internals.runtime_started() and internals.runtime_started(devices_listed=False)


def test_the_runtime_has_not_started_before_an_op_runs():
    """A new interpreter (this one has run ops): not started after importing TensorFlow,
    started once its devices are listed (but no op ran), then once an op ran."""
    import subprocess
    import sys
    code = ("import tftrain; import tensorflow as tf; from tftrain.core import internals as i; "
            "a = (i.runtime_started(), i.runtime_started(devices_listed=False)); "
            "tf.config.list_physical_devices(); b = (i.runtime_started(), "
            "i.runtime_started(devices_listed=False)); tf.constant(1.0) + 1.0; "
            "print(a, b, i.runtime_started(devices_listed=False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split("\n")[-2] == "(False, False) (True, False) True", out.stdout[-500:]


def test_local_devices_come_with_their_details():
    found = internals.local_devices()
    assert found and found[0].device_type == "CPU" and hasattr(found[0], "physical_device_desc")


def test_a_restore_names_the_programs_objects_the_checkpoint_did_not_hold(tmp_path):
    path = tf.train.Checkpoint(a=tf.Variable(1.0)).save(str(tmp_path / "ckpt"))
    extra = tf.Variable(0.0)
    status = tf.train.Checkpoint(a=tf.Variable(0.0), b=extra).restore(path)
    with pytest.raises(AssertionError):
        status.assert_existing_objects_matched()
    assert [o is extra for o in internals.unmatched(status)] == [True]
    assert internals.unmatched(tf.train.Checkpoint(a=tf.Variable(0.0)).restore(path)) == []


def test_the_multi_worker_extended_class_sets_up_local_devices():
    import inspect
    extended = internals.collective_extended()
    assert issubclass(extended, tf.distribute.StrategyExtended)
    assert list(inspect.signature(extended._initialize_local_devices).parameters) == [
        "self", "cluster_resolver", "worker_device"]


def test_a_models_tensor_usage_and_each_nodes_inputs():
    model, _ = _model()
    usage = internals.tensor_usage(model)
    assert usage[str(id(model.inputs[0]))] == 1
    dense_node = internals.inbound_nodes(model.get_layer("logits"))[0]
    assert internals.node_input_ids(dense_node) == [str(id(model.get_layer("relu").output))]


def test_a_layer_says_whether_it_takes_training():
    assert internals.takes_training(keras.layers.Dropout(0.5))
    assert not internals.takes_training(keras.layers.Dense(2))


def test_attention_configuration_as_the_layer_holds_it():
    mha = keras.layers.MultiHeadAttention(num_heads=3, key_dim=5, value_dim=7, dropout=0.1)
    x = keras.Input((6, 8))
    mha(x, x)
    config = internals.attention(mha)
    assert (config["num_heads"], config["key_dim"], config["value_dim"]) == (3, 5, 7)
    assert config["use_bias"] is True and config["dropout"] == 0.1
    assert config["attention_axes"] in (None, (1,), [1]) and config["output_shape"] is None
    assert tuple(config["query_shape"])[1:] == (6, 8)


def test_a_dropouts_generator_is_created_and_reproducible():
    keras.backend.experimental.enable_tf_random_generator()
    layer = keras.layers.Dropout(0.5, seed=3)
    layer.build((None, 4))
    generator = internals.random_generator(layer)
    assert isinstance(generator, tf.random.Generator)
    assert internals.random_generator(keras.layers.Dense(2)) is None


def test_a_dropouts_draws_replaced_and_given_back():
    keras.backend.experimental.enable_tf_random_generator()
    layer = keras.layers.Dropout(0.5, seed=3)
    x = tf.ones((2, 6))
    layer(x, training=True)                      # the generator made
    seen = []
    undo = internals.sampled_dropout(
        layer, lambda rate, uniform: lambda shape, dtype: seen.append((rate, uniform)) or
        tf.constant([[1.0, 0.0] * 3] * 2, dtype))
    assert undo is not None and internals.sampled_dropout(layer, None) is None   # once
    np.testing.assert_array_equal(layer(x, training=True).numpy(), [[2.0, 0.0] * 3] * 2)
    assert seen[0][0] == 0.5 and seen[0][1] == internals.random_generator(layer).uniform
    undo()
    assert internals.sampled_dropout(keras.layers.Dense(2), None) is None
    assert not (layer(x, training=True).numpy() == [[2.0, 0.0] * 3] * 2).all()


def test_the_learning_rate_as_given_and_the_loss_scale():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    assert internals.learning_rate(keras.optimizers.SGD(schedule)) is schedule
    scaled = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    scale = internals.loss_scale(scaled)
    assert float(scale.current_loss_scale.numpy()) == 2.0 ** 15 and int(scale.counter.numpy()) == 0
    assert internals.loss_scale(keras.optimizers.SGD(0.1)) is None


def test_a_keras3_sequentials_graph_and_a_tf_keras_graph_network():
    k3 = keras3()
    seq = k3.Sequential([k3.Input((4,)), k3.layers.Dense(2)])
    assert internals.has_graph(internals.graph_of(seq))
    model, _ = _model()
    assert internals.graph_of(model) is model and internals.is_graph_network(model)

    class Sub(keras.Model):
        def call(self, x):
            return x
    assert not internals.is_graph_network(Sub())


def test_qat_wrappers_expose_their_weight_and_activation_quantizers():
    import tensorflow_model_optimization as tfmot
    model, _ = _model()
    q = tfmot.quantization.keras.quantize_model(model)
    wrapper = next(layer for layer in q.layers if getattr(layer, "layer", None) is not None
                   and layer.layer.name == "logits")
    weights = internals.qat_weights(wrapper)
    assert len(weights) == 1 and weights[0][0].name.endswith("kernel:0")
    assert set(weights[0][2]) == {"min_var", "max_var"}
    stages = [stage for stage, _, variables in internals.qat_activations(wrapper) if variables]
    assert stages == ["post"]
    assert internals.qat_weights(keras.layers.Dense(2)) == []
    assert internals.prunable_weight_names(keras.layers.Dense(2)) == ["kernel"]


def test_the_tflite_schema_reads_a_files_ops(int8_file):
    fb = internals.tflite_schema()
    model = fb.ModelT.InitFromObj(fb.Model.GetRootAsModel(int8_file, 0))
    codes = {c.builtinCode if c.builtinCode else c.deprecatedBuiltinCode for c in model.operatorCodes}
    assert fb.BuiltinOperator.FULLY_CONNECTED in codes


def test_a_strategys_all_reduce_and_a_functions_graph():
    cross, options = internals.all_reduce(tf.distribute.MirroredStrategy(
        ["/cpu:0"], cross_device_ops=tf.distribute.ReductionToOneDevice()))
    assert isinstance(cross, tf.distribute.ReductionToOneDevice)
    assert isinstance(options.implementation, tf.distribute.experimental.CommunicationImplementation)

    @tf.function
    def f(x):
        return tf.cond(x > 0, lambda: x + 1, lambda: x - 1)
    f(tf.constant(1.0))
    concrete, = internals.concrete_functions(f)
    branch = next(op.get_attr("then_branch").name for op in concrete.graph.get_operations()
                  if op.type in ("If", "StatelessIf"))
    assert internals.graph_function(concrete.graph, branch) is not None
    assert internals.graph_function(concrete.graph, "no_such_function") is None


def test_a_tf_data_service_stops():
    """Stopped, a dispatcher's port refuses connections (it accepted them before)."""
    import socket
    dispatcher = tf.data.experimental.service.DispatchServer()
    worker = tf.data.experimental.service.WorkerServer(
        tf.data.experimental.service.WorkerConfig(dispatcher.target.split("://")[1]))
    port = int(dispatcher.target.rsplit(":", 1)[1])

    def accepts() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("localhost", port)) == 0
    assert accepts()
    internals.stop_server(worker)
    internals.stop_server(dispatcher)
    assert not accepts()


def test_an_optimizers_slots_are_found_by_variable():
    from tftrain.optim import fused
    v = tf.Variable([1.0, 2.0], name="w")
    adam, sgd = fused.Adam(0.1), fused.SGD(0.1, momentum=0.9)
    for opt in (adam, sgd):
        opt.build([tf.Variable(0.0, name="other"), v])
    m, velocity = internals.optimizer_slots(adam, v, "_momentums", "_velocities")
    assert m.name == "m/w:0" and velocity.name == "v/w:0" and m.shape == v.shape
    momentum, = internals.optimizer_slots(sgd, v, "momentums")
    assert momentum.name == "m/w:0" and momentum.shape == v.shape
    adam.apply_gradients([(tf.constant([1.0, 1.0]), v)])
    assert float(tf.reduce_sum(m)) > 0             # the slot the update wrote


def test_a_models_step_counters_count_fits_and_evaluations_steps():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = tf.zeros([8, 2])
    model.fit(x, tf.zeros([8, 1]), batch_size=2, verbose=0)
    model.evaluate(x, tf.zeros([8, 1]), batch_size=4, verbose=0)
    train, test = internals.step_counters(model)
    assert int(train.numpy()) == 4 and int(test.numpy()) == 2
    assert internals.cluster_coordinator(model) is None


def test_the_training_graph_is_written_once_when_asked(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    board = keras.callbacks.TensorBoard(str(tmp_path), write_graph=True)
    board.set_model(model)
    model.fit(tf.zeros([4, 2]), tf.zeros([4, 1]), verbose=0, epochs=1)   # traces the function
    board.set_model(model)
    internals.write_train_graph_once(board)
    internals.write_train_graph_once(board)
    events = list((tmp_path / "train").glob("events.*"))
    assert events and not board._should_write_train_graph


def test_no_private_framework_attribute_is_read_through_self_outside_the_door():
    """A tftrain class that subclasses a framework class (tf_keras, TensorFlow, tfmot)
    reads no private attribute its framework bases use (in their source), through `self`
    or `cls`, in its own body or a tftrain mixin's: those go through the door too."""
    import ast
    import importlib
    import inspect
    import re
    from helpers import ROOT
    bodies = {}
    for path in sorted((ROOT / "tftrain").rglob("*.py")):
        if path.name in ("internals.py", "__main__.py"):
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bodies[(module, node.name)] = (path, node)
    sources, found = {}, set()
    for (module, name), _ in bodies.items():
        cls = getattr(importlib.import_module(module), name, None)
        if not isinstance(cls, type):
            continue
        framework = [b for b in cls.__mro__
                     if not b.__module__.startswith("tftrain") and b is not object]
        for base in framework:
            if base not in sources:
                try:
                    sources[base] = inspect.getsource(base)
                except (OSError, TypeError):
                    sources[base] = ""
        for ours in (b for b in cls.__mro__ if b.__module__.startswith("tftrain")):
            path, node = bodies.get((ours.__module__, ours.__name__), (None, None))
            for attr in (n for n in ast.walk(node or ast.Module(body=[]))
                         if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                         and n.value.id in ("self", "cls") and n.attr.startswith("_")
                         and not n.attr.startswith("__")):
                if any(re.search(rf"\.{attr.attr}\b", sources[b]) for b in framework):
                    found.add(f"{path.relative_to(ROOT)}:{attr.lineno} {attr.attr}")
    assert found == set(), sorted(found)


PRIVATE_OF_OUR_OWN = {"_kernel_attrs", "_replica_gradients", "_compiled_gradients",
                      "_tftrain_device", "_tftrain_pinned",
                      "_initialize_local_devices",      # the door's class, overridden
                      "_replace", "_exit", "_clear", "_run_exitfuncs"}   # the standard library


def test_no_private_framework_attribute_is_read_outside_the_door():
    import ast
    from helpers import ROOT
    found = []
    for path in sorted((ROOT / "tftrain").rglob("*.py")):
        if path.name == "internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name)
                                                       and node.value.id in ("self", "cls")):
                name = node.attr
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                    "getattr", "hasattr") and len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                name = node.args[1].value
            if name and name.startswith("_") and not name.startswith("__") \
                    and name not in PRIVATE_OF_OUR_OWN:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert found == []
