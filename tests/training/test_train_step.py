"""The train step: data-parallel and accumulated updates equal large-batch updates."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel

SPEC = InputSpec((8, 8, 1), "float32", 10)


def _data(n=640, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    # weight decay and clipping act on the accumulated, reduced gradient
    "sgd_wd_clip": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True,
                                                weight_decay=0.01, global_clipnorm=0.5),
    "adamw_clip": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, clipnorm=0.1),
    "rmsprop_wd": lambda: keras.optimizers.RMSprop(0.01, weight_decay=0.01),
}


def train_weights(strategy, global_batch, accumulation=1, steps=10, optimizer="sgd",
                  model="mlp", all_reduce_dtype="float32", policy="float32", learning_rate=None):
    """Weights after `steps` updates of `global_batch` examples from the same init (under
    `mixed_float16`, with the stage's dynamic loss scaling)."""
    from tftrain.config import load_config
    from tftrain.runtime import precision
    precision.apply_policy(policy)
    x, y = _data(global_batch * steps)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        numerics = precision.Precision(policy=policy, config=load_config().precision) \
            if policy == "mixed_float16" else None
        net = TrainModel.wrap(precision.float32_outputs(MODELS.get(model)(SPEC)), accumulation,
                              all_reduce_dtype, precision=numerics)
        opt = OPTIMIZERS[optimizer]()
        if learning_rate is not None:
            opt.learning_rate = learning_rate
        net.compile(numerics.wrap_optimizer(opt) if numerics else opt,
                    build_loss("sparse_categorical_crossentropy"), metrics=["accuracy"])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    history = net.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0)
    return [w.copy() for w in net.get_weights()], int(net.optimizer.iterations.numpy()), history


def one_device():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def assert_weights_close(a, b, rtol=1e-5, atol=1e-6):
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        np.testing.assert_allclose(wa, wb, rtol=rtol, atol=atol)


def assert_relative_close(a, b, rtol=1e-5):
    """Each weight tensor within `rtol` of the reference relative to its norm, and no
    element off by more than `rtol` (Adam's first step divides tiny gradients by
    their own magnitude, so a lone near-zero element can differ by a few ulps more)."""
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        assert np.linalg.norm(wa - wb) <= rtol * np.linalg.norm(wb)
        assert np.max(np.abs(wa - wb)) <= rtol


def test_mirrored_two_replicas_equals_one_device_double_batch():
    ref, ref_steps, _ = train_weights(one_device(), 64)
    got, steps, _ = train_weights(mirrored(), 64)      # 32 per replica x 2 replicas
    assert ref_steps == steps == 10
    assert_weights_close(got, ref)
    init, _, _ = train_weights(one_device(), 64, steps=1)
    assert max(np.max(np.abs(a - b)) for a, b in zip(init, ref)) > 1e-3  # training moved them


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_accumulation_equals_large_batch(optimizer, steps):
    """(8 per replica x 4 micro-batches x 2 replicas) == (64 on one device)."""
    ref, ref_steps, _ = train_weights(one_device(), 64, optimizer=optimizer, steps=steps)
    got, got_steps, _ = train_weights(mirrored(), 64, accumulation=4, optimizer=optimizer, steps=steps)
    assert ref_steps == got_steps == steps     # iterations count updates, not micro-batches
    assert_relative_close(got, ref)


@pytest.mark.parametrize("n", [1, 4, 16])
def test_one_all_reduce_per_update(n):
    from tftrain.runtime.strategy import CountingReduction
    counter = CountingReduction()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counter)
    weights, steps, _ = train_weights(strategy, 2 * 4 * n, accumulation=n, steps=5)
    assert steps == 5
    assert int(counter.calls.numpy()) == 5                     # one reduction per update
    assert int(counter.bytes.numpy()) == 5 * 4 * sum(w.size for w in weights)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reduced_precision_all_reduce(dtype):
    full = CountingReductionRun("float32")
    half = CountingReductionRun(dtype)
    assert half.bytes * 2 == full.bytes                        # half the bytes on the wire
    tolerance = 1e-2 if dtype == "bfloat16" else 1e-3
    assert_weights_close(half.weights, full.weights, rtol=tolerance, atol=tolerance)
    assert max(np.max(np.abs(a - b)) for a, b in zip(half.weights, full.weights)) > 0


class CountingReductionRun:
    def __init__(self, dtype):
        from tftrain.runtime.strategy import CountingReduction
        counter = CountingReduction()
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counter)
        self.weights, _, _ = train_weights(strategy, 64, accumulation=4, all_reduce_dtype=dtype)
        self.bytes = int(counter.bytes.numpy())


def test_bfloat16_accumulation_within_bfloat16_noise():
    """Accumulating under mixed_bfloat16 strays from the float32 run no more than
    bfloat16 itself does between two equivalent large-batch runs."""
    exact, _, _ = train_weights(one_device(), 64)
    large, _, _ = train_weights(one_device(), 64, policy="mixed_bfloat16")
    split, _, _ = train_weights(mirrored(), 64, policy="mixed_bfloat16")         # 32 x 2
    accumulated, _, _ = train_weights(mirrored(), 64, accumulation=4, policy="mixed_bfloat16")

    def distance(a, b):
        return max(np.max(np.abs(u - v)) for u, v in zip(a, b))
    noise = max(distance(large, split), distance(large, exact), distance(split, exact))
    assert noise > 0
    assert distance(accumulated, exact) <= 1.5 * noise
    assert distance(accumulated, large) <= 1.5 * noise


@pytest.mark.slow
def test_mirrored_float16_with_loss_scaling_equals_one_device_within_float16_rounding():
    """Under mixed_float16 with dynamic loss scaling (SGD: its update follows the
    gradient's scale, which Adam would normalize away), 2 replicas x 32 and 2 replicas
    accumulating 2 x 16 each end as near one device's 64 as float16 rounding puts one
    device from float32; a gradient twice too large (a sum over replicas not divided,
    a loss scale not removed by one factor of 2) moves the weights far further."""
    from tftrain.runtime import precision
    try:
        exact, _, _ = train_weights(one_device(), 64)
        one, _, _ = train_weights(one_device(), 64, policy="mixed_float16")
        two, steps, _ = train_weights(mirrored(), 64, policy="mixed_float16")
        accumulated, _, _ = train_weights(mirrored(), 64, accumulation=2, policy="mixed_float16")
        doubled, _, _ = train_weights(one_device(), 64, policy="mixed_float16", learning_rate=0.2)
    finally:
        precision.apply_policy("float32")

    def distance(a, b):
        return max(np.max(np.abs(u - v)) for u, v in zip(a, b))
    noise = distance(one, exact)
    assert steps == 10 and noise > 0
    assert distance(two, one) <= 1.5 * noise and distance(accumulated, one) <= 1.5 * noise
    assert distance(doubled, one) > 10 * noise


def test_metrics_cover_every_micro_batch():
    _, _, ref = train_weights(one_device(), 64)
    _, _, got = train_weights(one_device(), 64, accumulation=4)
    np.testing.assert_allclose(got.history["loss"], ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(got.history["accuracy"], ref.history["accuracy"], rtol=1e-6)


def _graphs(graph):
    """A traced graph and the function graphs of its loops and conditionals."""
    yield graph
    for op in graph.get_operations():
        for attr in ("body", "cond", "then_branch", "else_branch"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError):
                continue
            yield from _graphs(graph._get_function(name).graph)


def _ancestors(op):
    """Every op `op` waits for: through inputs and control dependencies."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _accumulating(**kwargs):
    """A compiled MLP accumulating 4 micro-batches."""
    net = TrainModel.wrap(MODELS.get("mlp")(SPEC), 4, time_steps=False, **kwargs)
    net.compile(keras.optimizers.SGD(0.1), build_loss("sparse_categorical_crossentropy"))
    return net


def _traced_step(net):
    """The graph of the net's train step on a batch of 32."""
    return tf.function(net.train_step).get_concrete_function(
        (tf.TensorSpec([32, 8, 8, 1]), tf.TensorSpec([32], tf.int32))).graph


def _later_slices_wait_for_a_forward_pass(net):
    """For the unrolled step: whether every micro-batch after the first is sliced only
    after a forward pass (MatMul) of the ones before it; and how many slices there are."""
    traced = _traced_step(net)
    later = [op for op in traced.get_operations() if op.type == "StridedSlice"
             and "micro_batch" in op.name and not op.name.startswith("micro_batch/")]
    return all(any(a.type == "MatMul" for a in _ancestors(op)) for op in later), len(later)


def test_unrolled_micro_batches_run_one_after_another():
    # Nothing but the gradient sum orders micro-batches: each is sliced only once the
    # previous ones' gradients exist, or the executor runs two forward passes side by
    # side and holds both sets of activations (peak memory of accumulation).
    assert _later_slices_wait_for_a_forward_pass(_accumulating(unroll=True)) == (True, 6)   # x, y of micro-batches 1-3


def test_looped_micro_batches_run_one_after_another():
    # In the while loop: each micro-batch is sliced after the running gradient sum (the
    # loop variables shaped as the model's kernels), so the loop's first micro-batch
    # does not run beside the one before the loop.
    net = _accumulating()
    traced = _traced_step(net)
    kernel = [v.shape for v in net.trainable_variables if len(v.shape) == 2][0]
    bodies = [g for g in _graphs(traced) if "while_body" in g.name]
    slices = [op for g in bodies for op in g.get_operations()
              if "micro_batch" in op.name and op.type == "StridedSlice"]
    assert len(bodies) == 1 and len(slices) == 2                          # x and y
    for op in slices:
        assert any(a.type == "Placeholder" and a.outputs[0].shape == kernel
                   for a in _ancestors(op)), op.name


def test_looped_accumulation_traces_the_forward_pass_once_when_metrics_exist():
    # With the loss and metric variables made before tracing (`build_metrics`, as the
    # runner does), every micro-batch runs in the loop from zero sums: one copy of the
    # forward and backward pass in the graph, not one before the loop and one in it.
    net = _accumulating()
    net.build_metrics(tf.TensorSpec([32], tf.int32))
    traced = _traced_step(net)
    body, = [g for g in _graphs(traced) if "while_body" in g.name]
    assert sum(op.type == "MatMul" for op in body.get_operations()) > 0
    assert sum(op.type == "MatMul" for op in traced.get_operations()) == 0
    # the same update as the first micro-batch before the loop (a model whose metric
    # variables are made on first use, eagerly), to float32 rounding
    x = np.random.default_rng(0).random((32, 8, 8, 1), np.float32)
    y = np.arange(32, dtype=np.int32) % 10
    reference = _accumulating()
    reference.set_weights(net.get_weights())
    want = reference.train_step((tf.constant(x), tf.constant(y)))
    got = net.train_step((tf.constant(x), tf.constant(y)))
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-6)
    for a, b in zip(net.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)


def test_a_pipeline_keeps_its_micro_batches_side_by_side():
    # A placed pipeline's stage k works on micro-batch i while stage k+1 works on i-1.
    from tftrain.runtime.parallelism import Parallelism

    class Pipelined(Parallelism):
        unroll = overlap_micro_batches = True

    waits, count = _later_slices_wait_for_a_forward_pass(_accumulating(parallel=Pipelined()))
    assert count == 6 and not waits                 # x and y of micro-batches 1-3, free


def test_non_finite_micro_batch_skips_update_under_float16():
    from tftrain.runtime import precision
    from tftrain.config import load_config
    precision.apply_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    with one_device().scope():
        mixed = precision.Precision(policy="mixed_float16", config=load_config().precision)
        net = TrainModel.wrap(precision.float32_outputs(MODELS.get("mlp")(SPEC)), accumulation_steps=4,
                              precision=mixed)
        opt = mixed.wrap_optimizer(keras.optimizers.SGD(0.1))
        net.compile(opt, build_loss("sparse_categorical_crossentropy"))
    x, y = _data(64)
    net.fit(x, y, batch_size=64, epochs=1, verbose=0)         # one good update
    before = [w.copy() for w in net.get_weights()]
    scale, iterations = float(opt.loss_scale), int(opt.iterations.numpy())
    x[40] = np.inf                                            # micro-batch 2 of 4 goes non-finite
    net.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert_weights_close(net.get_weights(), before, rtol=0, atol=0)
    assert float(opt.loss_scale) == scale / 2
    assert int(opt.iterations.numpy()) == iterations == 1      # a skipped update is not counted


def test_schedule_position_counts_updates_not_micro_batches():
    from tftrain.optim.rates import Warmup, Constant, current_lr
    rates = []
    for accumulation in (1, 4):
        keras.utils.set_random_seed(1)
        net = TrainModel.wrap(MODELS.get("mlp")(SPEC), accumulation)
        net.compile(keras.optimizers.SGD(Warmup(Constant(0.1), 20, 0.1)),
                    build_loss("sparse_categorical_crossentropy"))
        x, y = _data(64 * 7)
        net.fit(x, y, batch_size=64, epochs=1, verbose=0)
        rates.append((int(net.optimizer.iterations.numpy()), current_lr(net.optimizer)))
    assert rates[0] == rates[1] == (7, pytest.approx(0.1 * 8 / 20))


def padded_weights(strategy, per_replica, replicas, accumulation, n=150):
    """Weights after one epoch of `n` examples with `data.remainder: pad` (SGD momentum)."""
    from tftrain.config import load_config
    from tftrain.data import BatchPlan, distribute, epoch_layout, from_arrays
    x, y = _data(n, seed=3)
    source = from_arrays(x, y, 0.0, 0, num_classes=10, validation=(x[:4], y[:4]))
    cfg = load_config(None, ["data.remainder=pad", "data.shuffle=false"]).data
    plan = BatchPlan(per_replica, replicas, accumulation)
    steps = epoch_layout(source, plan, cfg).steps()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        net = TrainModel.wrap(MODELS.get("mlp")(SPEC), accumulation)
        net.compile(OPTIMIZERS["sgd"](), build_loss("sparse_categorical_crossentropy"))
    net.fit(distribute(strategy, source, plan, cfg, 0), epochs=1, steps_per_epoch=steps, verbose=0)
    return [w.copy() for w in net.get_weights()], steps


def test_padded_last_batch_is_the_mean_over_its_real_examples():
    ref_x, ref_y = _data(150, seed=3)
    keras.utils.set_random_seed(1)
    with one_device().scope():
        plain = TrainModel.wrap(MODELS.get("mlp")(SPEC))
        plain.compile(OPTIMIZERS["sgd"](), build_loss("sparse_categorical_crossentropy"))
    # every example once: batches of 64, 64 and the 22 left over, nothing padded
    plain.fit(tf.data.Dataset.from_tensor_slices((ref_x, ref_y)).batch(64), epochs=1, verbose=0)
    accumulated, steps = padded_weights(mirrored(), 8, 2, 4)
    large, _ = padded_weights(one_device(), 64, 1, 1)
    assert steps == 3
    assert_weights_close(accumulated, large)
    assert_weights_close(large, plain.get_weights())


def test_training_metrics_leave_out_the_padding_slots():
    """`data.remainder: pad` weighs padding slots 0: the training metrics must not count
    them (Keras applies sample weights only to weighted metrics)."""
    inputs = keras.Input((2,))
    net = keras.Model(inputs, keras.layers.Dense(2, use_bias=False, kernel_initializer="zeros")(inputs))
    model = TrainModel.wrap(net)
    model.compile_step(keras.optimizers.SGD(0.0), build_loss("sparse_categorical_crossentropy"),
                       ["accuracy"])
    x, y = np.ones((4, 2), np.float32), np.array([0, 0, 1, 1])
    weights = np.array([2.0, 2.0, 0.0, 0.0], np.float32)   # the last two: padding
    # equal logits: every example predicted as class 0, right on the two real examples
    history = model.fit(tf.data.Dataset.from_tensors((x, y, weights)), epochs=1, verbose=0)
    assert history.history["accuracy"] == [1.0]
    assert [m.name for m in model.metrics] == ["loss", "accuracy"]


def test_an_update_skipped_at_the_loss_scale_floor_is_not_counted():
    """A non-finite gradient skips the update and halves the dynamic loss scale, but never
    below 1: at the floor the scale does not move, and the skip must still not count as an
    update (schedules, checkpoints and the weight average follow updates made)."""
    from tftrain.runtime import precision
    from tftrain.optim.averaging import WeightAverage
    from tftrain.config import load_config
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        mixed = precision.Precision(policy="mixed_float16", config=load_config(
            None, ["precision.initial_scale=1"]).precision)
        net = precision.float32_outputs(MODELS.get("mlp")(SPEC, hidden=[8]))
        average = WeightAverage(net, 0.5)
        model = TrainModel.wrap(net, 1, update_hooks=[average], precision=mixed)
        model.compile(mixed.wrap_optimizer(keras.optimizers.SGD(0.1)),
                      build_loss("sparse_categorical_crossentropy"))
        x, y = np.ones((8, 8, 8, 1), np.float32), np.zeros(8, np.int64)
        model.fit(x, y, batch_size=8, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 1
        x[3] = np.inf                                  # skipped, the scale stays at 1
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        assert float(model.optimizer.loss_scale.numpy()) == 1.0
        assert int(model.optimizer.iterations.numpy()) == 1 == int(average.count.numpy())
        x[3] = 1.0                                     # made again
        model.fit(x, y, batch_size=8, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 2 == int(average.count.numpy())
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
@pytest.mark.parametrize("resizable", [False, True])
def test_several_steps_per_call_trace_the_step_once_and_equal_one_step_per_call(resizable):
    """With several steps per call (`train.steps_per_execution`, or calls that `auto` may
    resize) the train and test steps are each traced once (Keras' own multi-step loop
    traces them twice), and 7 updates in calls of 3, 3 and 1 end with the weights, logs
    and evaluation of Keras' one-step function."""
    def run(steps_per_call, count):
        from tftrain.runtime import precision
        precision.apply_policy("float32")
        x, y = _data(7 * 32)
        keras.utils.set_random_seed(1)
        with mirrored().scope():
            net = TrainModel.wrap(MODELS.get("mlp")(SPEC))
            net.resizable_calls = resizable and steps_per_call > 1
            net.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                        build_loss("sparse_categorical_crossentropy"), metrics=["accuracy"],
                        steps_per_execution=steps_per_call)
            net.optimizer.build(net.trainable_variables)     # as the stages do: no
            net.build_metrics(tf.constant(y))                # variable is created in a trace
        traces = {"train": 0, "test": 0}
        for name, method in (("train", net.train_step), ("test", net.test_step)):
            def counted(data, name=name, method=method):
                traces[name] += 1                   # runs only while tracing, per replica
                return method(data)
            net.__dict__[f"{name}_step"] = counted
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        history = net.fit(ds, epochs=2, steps_per_epoch=7, validation_data=ds.take(5),
                          verbose=0)
        if count:
            assert traces == {"train": 2, "test": 2}, traces       # 2 replicas
        return net.get_weights(), history.history, net.evaluate(ds, verbose=0)

    ours, keras_own = run(3, count=True), run(1, count=False)
    assert_weights_close(ours[0], keras_own[0])
    assert ours[1].keys() == keras_own[1].keys()
    for key in ours[1]:
        np.testing.assert_allclose(ours[1][key], keras_own[1][key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours[2], keras_own[2], rtol=1e-5, atol=1e-6)


def test_calls_resized_after_the_first_validation_still_evaluate_every_batch():
    """`steps_per_execution: auto` may resize the calls after a first validation ran at
    one step per call (a stage resumed near an epoch's end measures in the next epoch):
    later validations, evaluations and predictions still cover every batch (Keras'
    one-step test function, made first, ran one batch per call of five)."""
    x, y = _data(7 * 32)
    keras.utils.set_random_seed(1)
    with mirrored().scope():
        net = TrainModel.wrap(MODELS.get("mlp")(SPEC))
        net.resizable_calls = True
        net.compile(keras.optimizers.SGD(0.1), build_loss("sparse_categorical_crossentropy"),
                    metrics=["accuracy"], steps_per_execution=1)
    val = tf.data.Dataset.from_tensor_slices((x[:160], y[:160])).batch(32)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()

    class Resize(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.steps_per_execution.assign(5)       # after the first validation

    net.fit(train, epochs=2, steps_per_epoch=7, validation_data=val, callbacks=[Resize()],
            verbose=0)
    assert int(net.steps_per_execution.numpy()) == 5
    logits = net(x[:160], training=False).numpy()
    expected = float(np.mean(np.argmax(logits, -1) == y[:160]))
    assert net.evaluate(val, return_dict=True, verbose=0)["accuracy"] == pytest.approx(expected)
    assert net.predict(val, verbose=0).shape == (160, 10)


@pytest.mark.parametrize("pack_bytes", [None, 4096])     # one buffer; several
def test_packed_all_reduce_trains_the_same_weights_in_one_reduction_per_update(
        monkeypatch, pack_bytes):
    """ReductionToOneDevice sums a tensor at a time; packed into flat buffers, the sum of
    each element is the same, exactly, with one reduction per update."""
    from tftrain.runtime import precision
    from tftrain.runtime.strategy import CountingReduction
    if pack_bytes:
        monkeypatch.setattr(precision, "PACK_BYTES", pack_bytes)
    runs = {}
    for packed in (False, True):
        counter = CountingReduction()
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counter)
        wire = precision.AllReduce("float32", False, False, packed=packed)
        x, y = _data(64 * 6)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            net = TrainModel.wrap(MODELS.get("mlp")(SPEC), 2, precision=precision.Precision(
                policy="float32", config=None, wire=wire))
            net.compile(keras.optimizers.Adam(0.01), build_loss("sparse_categorical_crossentropy"))
        net.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64), epochs=1, verbose=0)
        runs[packed] = ([w.copy() for w in net.get_weights()], int(counter.calls.numpy()),
                        int(counter.bytes.numpy()))
    (plain, plain_calls, plain_bytes), (packed, packed_calls, packed_bytes) = runs[False], runs[True]
    for a, b in zip(plain, packed):
        np.testing.assert_array_equal(a, b)
    assert plain_calls == packed_calls == 6 and plain_bytes == packed_bytes


def test_pack_and_unpack_round_trip_in_buffers_of_at_most_pack_bytes(monkeypatch):
    from tftrain.runtime import precision
    monkeypatch.setattr(precision, "PACK_BYTES", 100)
    tensors = [tf.reshape(tf.range(n, dtype=tf.float32) + 1000 * i, shape)
               for i, (n, shape) in enumerate([(6, [2, 3]), (20, [20]), (30, [5, 6]), (1, [])])]
    packs = precision.pack(tensors, tensors)
    # 24 + 80 bytes > 100: the second starts a buffer; 120 bytes alone; then 4 bytes
    assert [int(p.shape[0]) for p in packs] == [6, 20, 30, 1]
    for a, b in zip(precision.unpack(packs, tensors), tensors):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(precision, "PACK_BYTES", 2**20)
    assert [int(p.shape[0]) for p in precision.pack(tensors, tensors)] == [57]


def test_calls_settled_at_one_step_lose_their_loop_and_train_alike():
    """`steps_per_execution: auto` settling at one step a call makes the train function
    again without its loop: the same weights as the looping function, and no While op."""
    def run(settle):
        x, y = _data(6 * 32)
        keras.utils.set_random_seed(1)
        with mirrored().scope():
            net = TrainModel.wrap(MODELS.get("mlp")(SPEC))
            net.resizable_calls = True
            net.compile(keras.optimizers.SGD(0.1, momentum=0.9),
                        build_loss("sparse_categorical_crossentropy"), steps_per_execution=1)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
        net.fit(ds, epochs=1, steps_per_epoch=3, verbose=0)
        looped = net.train_function
        if settle:
            net.settle_calls(1)
            assert net.train_function is not looped and not net.resizable_calls
        net.fit(ds, epochs=2, initial_epoch=1, steps_per_epoch=3, verbose=0)
        graph = net.train_tf_function.get_concrete_function(iter(
            net.distribute_strategy.experimental_distribute_dataset(ds))).graph
        whiles = [op.type for op in graph.get_operations() if "While" in op.type]
        return net.get_weights(), whiles
    looped, loops = run(False)
    settled, none = run(True)
    assert loops and not none
    for a, b in zip(looped, settled):
        np.testing.assert_array_equal(a, b)
