"""Micro-batches of a replica's batch and their gradient sums (`TrainModel`'s accumulation)."""
from __future__ import annotations

import tensorflow as tf


def slice_of(x, y, sample_weight, index, size, after=()):
    """Micro-batch `index` of the replica's batch (contiguous slices of `size`), sliced
    only once the tensors `after` (the previous micro-batches' gradient sums) exist.
    Nothing else orders micro-batches: TensorFlow's executor would run the next one's
    forward pass beside the previous one's and hold both sets of activations (a
    pipeline wants exactly that: `Parallelism.overlap_micro_batches`)."""
    with tf.name_scope("micro_batch"), tf.control_dependencies(list(after)):
        take = lambda t: t[index * size:(index + 1) * size]  # noqa: E731
        return (tf.nest.map_structure(take, x), tf.nest.map_structure(take, y),
                None if sample_weight is None else take(sample_weight))


def size(x, n: int):
    """Micro-batch size: the replica's batch split into n equal parts."""
    return tf.shape(tf.nest.flatten(x)[0])[0] // n


def add(total, grads, variables, parallel):
    """Gradient sums (IndexedSlices made dense), each where `parallel` puts its variable's ops."""
    sums = []
    for i, (a, g, v) in enumerate(zip(total, grads, variables)):
        with parallel.beside(v):
            sums.append(tf.add(a, tf.convert_to_tensor(g), name=f"gradient_sum_{i}"))
    return sums
