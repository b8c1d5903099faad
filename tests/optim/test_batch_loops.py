"""Loops over batches: eager for the first few calls, then one traced function."""
import tensorflow as tf

from tftrain.optim.batch_loops import EAGER_BATCHES, traced_after


def test_the_first_calls_run_eagerly_and_the_rest_through_one_trace():
    python_runs = []

    def double(x):
        python_runs.append(tf.executing_eagerly())
        return 2 * x

    step = traced_after(double)
    results = [float(step(tf.constant(float(i)))) for i in range(EAGER_BATCHES + 5)]
    assert results == [2.0 * i for i in range(EAGER_BATCHES + 5)]
    # the eager calls run the Python each time; the traced ones once, while tracing
    assert python_runs == [True] * EAGER_BATCHES + [False]


def test_batches_of_another_size_past_the_eager_ones_trace_at_most_twice():
    traces = []

    def total(x):
        traces.append(x.shape.as_list())
        return tf.reduce_sum(x)

    step = traced_after(total, eager=0)
    sums = [float(step(tf.ones([n, 3]))) for n in (4, 4, 4, 2, 4, 2)]
    assert sums == [12.0, 12.0, 12.0, 6.0, 12.0, 6.0]
    assert traces == [[4, 3], [None, 3]]
