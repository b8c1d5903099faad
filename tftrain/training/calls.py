"""The train and test functions' loop: `steps_per_execution` steps per call, the step
traced once, its input from the iterator `fit` passes or from a device feed, and its clocks
(`TrainModel` makes its functions with `multi_step`)."""
from __future__ import annotations

import tensorflow as tf

from tftrain.core import internals
from tftrain.core.keras import reduce_per_replica


def multi_step(model, step, counter, results, waits=None, feed=None, clock=None, loop=True):
    """`model`'s Keras multi-step function (`steps_per_execution` steps per call) with the
    step traced once. Keras' own loop carries the step's outputs, undefined before
    its first iteration, so autograph traces the step twice to learn their structure.
    The outputs are metric results, read from the metric variables: here once, after
    the loop (`results`, in replica context). `waits`: a variable the seconds spent
    waiting on the iterator are added to (a clock read before asking for the next
    batch, once the previous step is done, and one once it has arrived). `feed`: a
    device feed the batches come from instead of the iterator (nothing is waited on:
    the gather is inside the step). `clock`: a variable the seconds inside the call
    are added to (with a feed, one clock per call instead of two per step: they cost
    the MLP on digits 10-15% of its steps). `loop=False`: calls of one step, without the
    loop around it."""
    strategy = model.distribute_strategy

    def run_step(data):
        outputs = step(data)
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            return counter.assign_add(1)

    def run_fed(e, u, local):
        return run_step(feed.batch(e, u, local))

    def next_batch(iterator):
        return next(iterator) if feed is None else feed.indices()

    def function(iterator):
        def body(i, done):
            if waits is None:
                data = next_batch(iterator)
            else:
                with tf.control_dependencies([done]):
                    asked = tf.timestamp()
                with tf.control_dependencies([asked]):
                    data = next_batch(iterator)
                with tf.control_dependencies(tf.nest.flatten(data, expand_composites=True)):
                    waits.assign_add(tf.timestamp() - asked)
            ran = (strategy.run(run_step, args=(data,)) if feed is None else
                   strategy.run(run_fed, args=(*data, feed.data)))
            with tf.control_dependencies(strategy.experimental_local_results(ran)):
                return i + 1, tf.identity(i + 1)
        steps = internals.steps_per_execution(model)
        zero = tf.constant(0, steps.dtype)
        began = tf.timestamp() if clock is not None else None
        ran = (tf.while_loop(lambda i, _: i < steps, body, [zero, zero]) if loop
               else body(zero, zero))
        if clock is not None:
            with tf.control_dependencies(ran):
                clock.assign_add(tf.timestamp() - began)
        return reduce_per_replica(strategy.run(results), strategy,
                                  reduction=model.distribute_reduction_method)
    return function
