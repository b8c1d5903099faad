"""The input probe: each stage of the pipeline timed alone, and which one is slow."""
import numpy as np
import tensorflow as tf

from tftrain.config import load_config
from tftrain.data import IndexedSource, InputSpec, from_arrays, plan_batches
from tftrain.data import probe


def cfg(*sets):
    return load_config(None, ["data.per_replica_batch_size=8", *sets]).data


def slow_decoding_source(n=64):
    """An elementwise source whose decode does 80 matrix products of 96 x 96 an example."""
    x = np.random.default_rng(0).normal(size=(n, 96, 96)).astype(np.float32)

    def load(i):
        m = tf.gather(tf.constant(x), i)
        for _ in range(80):
            m = tf.matmul(m, m) / 96.0
        return tf.reduce_mean(m, axis=1), tf.cast(i % 3, tf.int32)
    val = tf.data.Dataset.from_tensor_slices((np.zeros((4, 96), np.float32), np.zeros(4, np.int32)))
    return IndexedSource(InputSpec((96,), "float32", 3), n, 4, load, val, elementwise=True)


def test_a_slow_decode_is_named_and_the_stages_are_timed_in_order():
    source = slow_decoding_source()
    plan = plan_batches(load_config(None, ["data.per_replica_batch_size=8"]), 1)
    rates = probe.stage_rates(source, plan, cfg(), 0, seconds=0.3, most=6)
    assert list(rates) == ["read", "decode", "pipeline"]
    assert rates["read"] > 10 * rates["decode"], rates
    line = probe.slowest(rates, step_rate=2 * rates["decode"])
    assert line.endswith(": decode is the slow stage"), line


def test_per_example_augmentation_is_a_stage_of_its_own():
    x, y = np.zeros((64, 8, 8, 1), np.float32), np.arange(64) % 3
    source = from_arrays(x, y, 0.0, 0, num_classes=3, validation=(x[:4], y[:4]))
    plan = plan_batches(load_config(None, ["data.per_replica_batch_size=8"]), 1)
    rates = probe.stage_rates(source, plan, cfg("data.augment=[random_flip]"), 0, seconds=0.1)
    assert list(rates) == ["read", "decode", "augment", "pipeline"]


def test_slowest_names_the_first_stage_below_the_steps_and_the_stage_before_it():
    rates = {"read": 5000.0, "decode": 900.0, "augment": 40.0, "pipeline": 38.0}
    assert probe.slowest(rates, 100.0) == (
        "timed alone, the input stages give read 5,000, decode 900, augment 40, pipeline 38 "
        "batches/s against the steps' 100: augment is the slow stage")
    assert probe.slowest(rates, 30.0).endswith(
        ": no stage is slower than the steps alone (they share the cores)")
    # a stage below the steps but not much below the one before it is not the culprit
    assert probe.slowest({"read": 90.0, "decode": 80.0}, 100.0).endswith(": read is the slow stage")
