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


def test_steps_per_execution_is_the_variable_keras_runs_its_train_function_with():
    model, _ = _model()
    model.compile("sgd", "mse", steps_per_execution=4)
    variable = internals.steps_per_execution(model)
    assert isinstance(variable, tf.Variable) and int(variable.numpy()) == 4


@pytest.fixture(scope="module")
def int8_file():
    model, _ = _model()
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: ([np.ones((1, 4), np.float32) * i] for i in range(4))
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
        assert internals.op_determinism() and tf.config.experimental.enable_op_determinism
        internals.set_op_determinism(False)
        assert not internals.op_determinism()
    finally:
        internals.set_op_determinism(before)


def test_the_runtime_has_started_once_an_op_ran():
    tf.constant(1.0) + 1.0
    assert internals.runtime_started() and internals.runtime_started(devices_listed=False)


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
