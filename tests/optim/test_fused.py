"""The fused optimizers compute tf_keras' updates, in one op per variable."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.optim import fused

CASES = {
    "adam": (fused.Adam, keras.optimizers.Adam, {}),
    "adam_adaptive_epsilon": (fused.Adam, keras.optimizers.Adam,
                              {"adaptive_epsilon": True, "epsilon": 1e-3, "beta_1": 0.8}),
    "adam_amsgrad": (fused.Adam, keras.optimizers.Adam, {"amsgrad": True}),   # tf_keras' path
    "adamw": (fused.AdamW, keras.optimizers.AdamW, {"weight_decay": 0.05}),
    "sgd": (fused.SGD, keras.optimizers.SGD, {}),
    "sgd_momentum": (fused.SGD, keras.optimizers.SGD, {"momentum": 0.9}),
    "sgd_nesterov": (fused.SGD, keras.optimizers.SGD, {"momentum": 0.9, "nesterov": True}),
}


def _gradients(steps):
    rng = np.random.default_rng(0)
    return [[rng.normal(size=s).astype(np.float32) for s in ((3, 4), (4,))] for _ in range(steps)]


def _train(cls, params, steps=6, strategy=None, sparse=False):
    """Variables and slots after `steps` updates from random gradients (the same for
    every optimizer), under `strategy`."""
    strategy = strategy or tf.distribute.get_strategy()
    grads = _gradients(steps)
    with strategy.scope():
        variables = [tf.Variable(np.ones((3, 4), np.float32)), tf.Variable(np.zeros(4, np.float32))]
        optimizer = cls(learning_rate=0.01, **params)

    @tf.function
    def apply(g):
        def step(g):       # the gradient of sum(w * g) is g, on every replica (summed)
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(w * x) for w, x in zip(variables, g)])
            g = tape.gradient(loss, variables)
            if sparse:
                g = [tf.IndexedSlices(g[0][:2], tf.constant([0, 2])), g[1]]
            optimizer.apply_gradients(zip(g, variables))
        strategy.run(step, args=(g,))
    for g in grads:
        apply([tf.constant(x) for x in g])
    slots = [v for v in optimizer.variables if v.shape.rank]
    return [v.numpy() for v in variables], [s.numpy() for s in slots], optimizer


def _reference(case, params, grads, lr=0.01):
    """tf_keras' update rules in float64 numpy, from the same start."""
    w = [np.ones((3, 4)), np.zeros(4)]
    m, v, vhat = [np.zeros_like(x) for x in w], [np.zeros_like(x) for x in w], [np.zeros_like(x) for x in w]
    b1, b2, eps = params.get("beta_1", 0.9), 0.999, params.get("epsilon", 1e-7)
    momentum, nesterov = params.get("momentum", 0.0), params.get("nesterov", False)
    for t, g in enumerate(grads, start=1):
        for i, gi in enumerate(g):
            gi = gi.astype(np.float64)
            if "weight_decay" in params:
                w[i] = w[i] - w[i] * params["weight_decay"] * lr
            if case.startswith("adam"):
                alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                m[i] += (gi - m[i]) * (1 - b1)
                v[i] += (gi ** 2 - v[i]) * (1 - b2)
                vhat[i] = np.maximum(vhat[i], v[i])
                e = eps * np.sqrt(1 - b2 ** t) if params.get("adaptive_epsilon") else eps
                w[i] = w[i] - m[i] * alpha / (np.sqrt(vhat[i] if params.get("amsgrad") else v[i]) + e)
            else:
                m[i] = -gi * lr + m[i] * momentum
                w[i] = w[i] + (-gi * lr + m[i] * momentum if nesterov else m[i])
    return w


@pytest.mark.parametrize("case", list(CASES))
def test_the_fused_update_is_tf_keras_update(case):
    """Fused and tf_keras' own both follow tf_keras' update rule (numpy, float64) to
    float32 rounding (they round in a different order), and keep the same slots."""
    ours, theirs, params = CASES[case]
    (w, slots, opt), (w_ref, slots_ref, _) = _train(ours, params), _train(theirs, params)
    exact = _reference(case, params, _gradients(6))
    for a, b, x in zip(w, w_ref, exact):
        np.testing.assert_allclose(a, x, rtol=0, atol=2e-6)
        np.testing.assert_allclose(b, x, rtol=0, atol=2e-6)
    assert len(slots) == len(slots_ref) > 0
    for a, b in zip(slots, slots_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert int(opt.iterations.numpy()) == 6


@pytest.mark.parametrize("case", ["adam", "sgd_momentum"])
def test_the_fused_update_equals_tf_keras_under_mirrored_strategy(case):
    ours, theirs, params = CASES[case]
    # (reduced to one device: collectives of a strategy made here would share their keys
    # with other tests' strategies in this process; each replica's update is the same)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    (w, slots, _), (w_ref, slots_ref, _) = (_train(ours, params, strategy=strategy),
                                            _train(theirs, params, strategy=strategy))
    # two replicas: each update applies the sum of both replicas' gradients, 2g
    doubled = [[2 * x for x in g] for g in _gradients(6)]
    for a, x in zip(w, _reference(case, params, doubled)):
        np.testing.assert_allclose(a, x, rtol=0, atol=2e-6)
    for a, b in zip(w + slots, w_ref + slots_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)


@pytest.mark.parametrize("case", ["adam", "sgd_momentum"])
def test_sparse_gradients_take_tf_keras_path(case):
    ours, theirs, params = CASES[case]
    (w, _, _), (w_ref, _, _) = _train(ours, params, sparse=True), _train(theirs, params, sparse=True)
    for a, b in zip(w, w_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6)
    assert np.array_equal(w[0][1], np.ones(4, np.float32))         # row 1 never had a gradient


def _update_ops(cls, n=20):
    """Op types of one update of `n` variables, and the node count."""
    variables = [tf.Variable(tf.ones([5, 5])) for _ in range(n)]
    optimizer = cls(learning_rate=0.01)
    optimizer.build(variables)
    graph = tf.function(lambda g: optimizer.apply_gradients(zip(g, variables))) \
        .get_concrete_function([tf.TensorSpec([5, 5])] * n).graph
    return [op.type for op in graph.get_operations()]


@pytest.mark.parametrize("ours,theirs,kernel", [
    (fused.Adam, keras.optimizers.Adam, "ResourceApplyAdam"),
    (fused.SGD, keras.optimizers.SGD, "ResourceApplyKerasMomentum")])
def test_one_fused_op_per_variable_and_a_smaller_graph(ours, theirs, kernel):
    fused_ops, plain_ops = _update_ops(ours), _update_ops(theirs)
    assert fused_ops.count(kernel) == 20 and kernel not in plain_ops
    assert "Sqrt" not in fused_ops and "AssignSubVariableOp" not in fused_ops
    assert len(fused_ops) < 0.6 * len(plain_ops), (len(fused_ops), len(plain_ops))


def test_a_checkpoint_of_tf_keras_adam_restores_into_the_fused_one(tmp_path):
    _, slots_ref, plain = _train(keras.optimizers.Adam, {})
    path = tf.train.Checkpoint(optimizer=plain).write(str(tmp_path / "ckpt"))
    variables = [tf.Variable(np.ones((3, 4), np.float32)), tf.Variable(np.zeros(4, np.float32))]
    ours = fused.Adam(learning_rate=0.01)
    ours.build(variables)
    tf.train.Checkpoint(optimizer=ours).read(path).assert_existing_objects_matched()
    assert int(ours.iterations.numpy()) == 6
    for a, b in zip([v.numpy() for v in ours.variables if v.shape.rank], slots_ref):
        np.testing.assert_array_equal(a, b)
