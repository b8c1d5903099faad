"""`train.jit_compile`: XLA for the replica gradients, decided per stage."""
import numpy as np
import pytest
import tensorflow as tf

from helpers import quick_config
from tftrain.training import xla
from tftrain.core.keras import keras
from tftrain.config import ConfigError
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel


def mirrored():
    # no collectives: a process's collective instances are keyed by number, and another
    # test's strategy with other shapes under the same keys makes TensorFlow abort
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


def _net(strategy, accumulation=1, layer=None, seed=3, dropout=0.3):
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
        h = keras.layers.BatchNormalization(name="bn")(h)
        h = keras.layers.Dropout(dropout, name="drop")(keras.layers.Flatten()(h))
        if layer is not None:
            h = layer(h)
        net = TrainModel.wrap(keras.Model(inputs, keras.layers.Dense(10)(h)), accumulation)
        net.compile(keras.optimizers.SGD(0.1), build_loss("sparse_categorical_crossentropy"),
                    metrics=["accuracy"])
    return net


def _batch(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(n, 8, 8, 1)).astype(np.float32)),
            tf.constant(rng.integers(0, 10, n).astype(np.int32)))


def _fit(net, steps=6):
    x, y = _batch(32 * steps, seed=1)
    net.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0)
    return net.get_weights()


@pytest.mark.parametrize("accumulation", [1, 4])
def test_compiled_gradients_train_like_the_plain_step(accumulation):
    strategy = mirrored()
    # no dropout: XLA draws its random numbers differently (another stream, same law)
    plain, compiled = (_net(strategy, accumulation, dropout=0.0),
                       _net(strategy, accumulation, dropout=0.0))
    compiled.jit_compile_gradients = True
    a, b = _fit(plain), _fit(compiled)
    assert any(np.abs(w).sum() for w in a)
    # the same updates, up to XLA's float arithmetic (its batch-norm variance differs from
    # TensorFlow's kernel by about 5e-4 relative after a few updates)
    for wa, wb in zip(a, b):
        np.testing.assert_allclose(wa, wb, rtol=1e-3, atol=1e-4)
    # one trace per replica device: each replica's trace holds its own variables
    assert len(compiled.__dict__["_xla_gradients"]) == 2


def test_auto_measures_and_puts_back_what_the_probe_changed():
    strategy = mirrored()
    net = _net(strategy)
    from tftrain.training.callbacks import random_generators
    generators = random_generators(net)
    before = [v.numpy().copy() for v in net.non_trainable_variables]
    states = [g.state.numpy().copy() for g in generators]
    weights = [w.copy() for w in net.get_weights()]
    decision = xla.decide("auto", net, strategy, _batch())
    assert decision.speedup is not None and decision.speedup > 0
    assert decision.compiled == (decision.speedup >= 1.05)
    assert decision.reason.startswith("on:" if decision.compiled else "off:")
    for v, b in zip(net.non_trainable_variables, before):     # batch-norm statistics
        np.testing.assert_array_equal(v.numpy(), b)
    for g, s in zip(generators, states):                       # dropout's generator
        np.testing.assert_array_equal(g.state.numpy(), s)
    for w, b in zip(net.get_weights(), weights):
        np.testing.assert_array_equal(w, b)
    assert all(float(m.result()) == 0.0 for m in net.metrics)


def test_auto_keeps_the_faster_side_by_its_margin():
    strategy = mirrored()
    assert xla.decide("auto", _net(strategy), strategy, _batch(), probe=xla.Probe(margin=0.0)).compiled
    off = xla.decide("auto", _net(strategy), strategy, _batch(), probe=xla.Probe(margin=1e9))
    assert not off.compiled and "needs" in off.reason


def test_a_side_stops_being_called_once_it_took_its_limit(monkeypatch):
    # the module's clock, advanced 50 ms by each call (a sleeping probe read 2 calls
    # for 3 on a machine busy with other work)
    clock = [0.0]
    monkeypatch.setattr(xla.time, "perf_counter", lambda: clock[0])
    made = []

    def probe(x, y, weight):                    # a 50-ms step
        clock[0] += 0.05
        made.append(1)
        return tf.constant(1.0)
    per_call = xla._run(probe, None, None, None, calls=10, limit=0.12)
    assert len(made) == 3 and abs(per_call - 0.05) < 1e-9    # 0.05, 0.10, then 0.15 > 0.12
    made.clear()
    xla._run(probe, None, None, None, calls=4)
    assert len(made) == 4


@pytest.mark.parametrize("compiled_seconds,rounds", [(20.0, 1), (0.3, 1), (0.9, 3)])
def test_a_decisive_round_ends_the_measurement(monkeypatch, compiled_seconds, rounds):
    """XLA's CPU convolution gradients ran over 15x slower than the plain step on a ResNet-14:
    one round then decides, and the slow side stops after a call once it has taken twice
    the other side's time; a close race is measured over every round."""
    strategy = mirrored()
    net = _net(strategy)
    calls = []
    seconds = {"plain": 1.0, "compiled": compiled_seconds}
    monkeypatch.setattr(xla, "_probe", lambda strategy, gradients: (
        "compiled" if gradients == net._compiled_gradients else "plain"))

    def run(probe, x, y, weight, n, limit=float("inf")):
        made = n if limit == float("inf") else \
            min(n, max(1, int(np.ceil(limit / seconds[probe] - 1e-9))))
        calls.append((probe, made))
        return seconds[probe]
    monkeypatch.setattr(xla, "_run", run)
    speedup = xla._measure(net, strategy, _batch(), rounds=3, calls=3)[0]
    assert speedup == pytest.approx(1.0 / compiled_seconds)
    measured = calls[2:]                             # after the trace and the compile
    assert calls[:2] == [("plain", 1), ("compiled", 1)] and len(measured) == 2 * rounds
    if compiled_seconds == 20.0:                     # limit 3 calls x 1 s x 2: one call
        assert measured == [("plain", 3), ("compiled", 1)]


def test_auto_falls_back_when_xla_cannot_compile_the_step():
    strategy = mirrored()
    def tanh_on_the_host(t):        # a NumPy function: no XLA kernel for it
        out = tf.numpy_function(np.tanh, [t], tf.float32)
        out.set_shape(t.shape)
        return out
    opaque = keras.layers.Lambda(tanh_on_the_host, name="opaque")
    net = _net(strategy, layer=opaque)
    decision = xla.decide("auto", net, strategy, _batch())
    assert not decision.compiled and "XLA could not compile the step" in decision.reason


def test_settings_and_refusals():
    strategy = mirrored()
    net = _net(strategy)
    assert not xla.decide(False, net, strategy, _batch()).compiled
    assert xla.decide(True, net, strategy, _batch()).compiled
    refused = xla.decide(True, net, strategy, _batch(), refused="model placement")
    assert not refused.compiled and refused.reason == "off: model placement"
    votes = []
    agreed = xla.decide("auto", net, strategy, _batch(), probe=xla.Probe(margin=0.0),
                        vote=lambda v: votes.append(v) or [0.0])   # the other worker: off
    assert votes == [[1.0]] and not agreed.compiled and "vote" in agreed.reason


def test_a_model_whose_trace_alone_would_pass_the_budget_is_not_traced():
    """`longest`: the stage's steps at most (from its FLOPs): a model of N layers whose
    trace is estimated past 10% of it is decided off without tracing (no batch built)."""
    strategy = mirrored()
    net = _net(strategy)
    layers = len(net.submodules)

    def no_batch():
        raise AssertionError("the batch is built only to measure")
    tight = layers * xla.TRACE_PER_LAYER / xla.BUDGET * 0.9
    skipped = xla.decide("auto", net, strategy, no_batch,
                         probe=xla.Probe(steps=100, longest=tight))
    assert not skipped.compiled and skipped.reason.startswith(
        "off, not probed: tracing the step alone would take about")
    assert f"({layers} layers)" in skipped.reason
    roomy = xla.decide("auto", net, strategy, _batch(),
                       probe=xla.Probe(steps=100, longest=tight * 1000, margin=0.0))
    assert "tracing the step alone" not in roomy.reason


@pytest.mark.parametrize("sets,what", [
    (["distribute.strategy=auto", "model.placement={devices: ['/cpu:0', '/cpu:1'], stages: auto}"],
     "model placement"),
    (["compression.quantization.enabled=true", "export.tflite=int8"], "stage qat"),
])
def test_jit_compile_true_where_xla_cannot_work_is_a_config_error(tmp_path, sets, what):
    from tftrain.run import run
    cfg = quick_config(tmp_path, "train.jit_compile=true", "train.epochs=1", *sets)
    with pytest.raises(ConfigError, match=f"train.jit_compile: true cannot be used: .*{what}"):
        run(cfg, dry_run=True)
    assert not (tmp_path / "quickstart").exists()
