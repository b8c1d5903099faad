"""Loops over batches that run a model: eager for a few batches, traced for many."""
import tensorflow as tf

EAGER_BATCHES = 8   # batches run eagerly before a traced function pays for its tracing


def traced_after(function, eager: int = EAGER_BATCHES):
    """`function(*args)` for a loop over batches: called as it is for the first `eager`
    calls, then through one `tf.function`. Tracing a model costs a few of its eager calls,
    so a loop of a few batches (a `--smoke` run's) stays eager and a long one (64 batches
    at a stage's end) runs traced."""
    calls = [0]
    traced = tf.function(function, autograph=False, reduce_retracing=True)

    def call(*args):
        calls[0] += 1
        return (function if calls[0] <= eager else traced)(*args)
    return call
