"""Adam, AdamW and SGD that update each variable with one fused training op.

tf_keras' optimizers write each variable's update as a dozen element-wise ops (reads,
scaling, a square and a square root, a division, three assignments). On a model of a
few hundred variables that is thousands of graph nodes: for MobileNetV2 (158 variables)
about half of the nodes of the train step, and half of the seconds its first step spends
tracing and optimising the graph. TensorFlow's training kernels do the same arithmetic
in one op per variable, on CPU and GPU and under XLA (the optimizer's `jit_compile` on
GPUs): `ResourceApplyAdam` computes tf_keras' Adam update (alpha = lr * sqrt(1 - b2^t) /
(1 - b1^t); m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2); w -= alpha m / (sqrt(v) + eps)),
and `ResourceApplyKerasMomentum` tf_keras' SGD (m = m * momentum - lr g; w += m, or the
Nesterov form). The classes keep tf_keras' variables, names and config, so checkpoints
written by either restore into the other. What the kernels do not cover (sparse
gradients, AMSGrad) takes tf_keras' own path.
"""
from __future__ import annotations

import tensorflow as tf

from tftrain.core import internals
from tftrain.core.keras import keras


class _FusedAdamStep:
    """`update_step` of tf_keras' Adam and AdamW (their updates are the same; AdamW's
    decay is applied before it by the base optimizer) as one `ResourceApplyAdam`."""

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices) or self.amsgrad:
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        beta_2_power = tf.pow(beta_2, step)
        epsilon = tf.cast(self.epsilon, dtype)
        if getattr(self, "adaptive_epsilon", False):
            epsilon = epsilon * tf.sqrt(1 - beta_2_power)
        m, v = internals.optimizer_slots(self, variable, "_momentums", "_velocities")
        return tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=m.handle, v=v.handle, beta1_power=tf.pow(beta_1, step),
            beta2_power=beta_2_power, lr=tf.cast(self.learning_rate, dtype), beta1=beta_1,
            beta2=beta_2, epsilon=epsilon, grad=gradient)


@keras.utils.register_keras_serializable("tftrain")
class Adam(_FusedAdamStep, keras.optimizers.Adam):
    """tf_keras' Adam, each variable updated by one fused op."""


@keras.utils.register_keras_serializable("tftrain")
class AdamW(_FusedAdamStep, keras.optimizers.AdamW):
    """tf_keras' AdamW, each variable updated by one fused op."""


@keras.utils.register_keras_serializable("tftrain")
class SGD(keras.optimizers.SGD):
    """tf_keras' SGD (with or without momentum, Nesterov or not), each variable updated by
    one fused op (tf_keras keeps a momentum slot even at momentum 0)."""

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        momentum, = internals.optimizer_slots(self, variable, "momentums")
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle, accum=momentum.handle,
            lr=tf.cast(self.learning_rate, dtype), grad=gradient,
            momentum=tf.cast(self.momentum, dtype), use_nesterov=self.nesterov)
