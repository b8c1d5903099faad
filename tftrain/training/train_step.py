"""The training step: micro-batch accumulation, loss scaling, one optimizer update.

`TrainModel` is a functional tf_keras model whose `train_step` is the one place a
step is defined. Each replica receives `accumulation_steps` micro-batches per update
(see `BatchPlan`), runs them one after another in a loop inside the replica step, sums
their gradients locally in float32, and calls `apply_gradients` once, outside any
conditional. Calling `apply_gradients` inside `tf.cond` under MirroredStrategy fails
with a `merge_call` error; looping inside the step avoids it. The summed gradients are
all-reduced once per update however many micro-batches there are: by the optimizer's
own aggregation in float32, or here when `all_reduce_dtype` casts them to
float16/bfloat16 for the reduction only.

Update hooks (pruning's mask updates) run once per update, before the first micro-batch
and after `apply_gradients`, in cross-replica context through one `merge_call` each, so
they see optimizer updates rather than forward passes. Models whose forward pass itself
synchronises replicas (QAT's moving-average ranges) cannot run inside the while loop
(`merge_call` is not allowed in control flow): `unroll=True` loops in Python instead.

The step has no Python control flow on tensors: it is traced without autograph (2-3 s less
per process), while Keras still converts layers' `call`.
"""
from __future__ import annotations

import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.training.calls import multi_step
from tftrain.training.losses import hard_labels
from tftrain.training.micro_batches import add as _add, size as _size, slice_of as _micro_batch
from tftrain.core import internals
from tftrain.runtime.parallelism import Parallelism
from tftrain.runtime.precision import AllReduce, Precision, pack, unpack
from tftrain.training.recompute import Recompute


def op_determinism() -> bool:
    """Whether op determinism is on in this process (TensorFlow then refuses clocks)."""
    return internals.op_determinism()


class TrainModel(keras.Model):
    """A functional model with tftrain's train step (gradient accumulation built in)."""

    def __init__(self, *args, accumulation_steps: int = 1, all_reduce_dtype: str | None = None,
                 update_hooks=(), unroll: bool = False, parallel=None, precision=None,
                 recompute=None, recomputing=None, **kwargs):

        super().__init__(*args, **kwargs)
        self.time_steps = True     # (`wrap`) not under op determinism: TensorFlow refuses clocks
        # Kept out of Keras' tracking: they are how the step runs, not model state.
        self.__dict__["parallel"] = parallel or Parallelism()
        self.__dict__["precision"] = precision or Precision(    # no loss scaling of its own
            policy=keras.mixed_precision.global_policy().name, config=None,
            wire=AllReduce(all_reduce_dtype or "float32", False, False))
        self.accumulation_steps = int(accumulation_steps)
        self.all_reduce_dtype = tf.as_dtype(all_reduce_dtype or self.precision.all_reduce_dtype)
        self.update_hooks = tuple(update_hooks)
        self.unroll = unroll or self.parallel.unroll
        # Seconds spent inside train steps (from the batch's arrival to the update), per
        # replica; `input_wait.InputWait` compares it with the wall time of the calls. Kept
        # out of Keras' tracking: it is not model state.
        # Read as the first replica's (the replicas step together, held by the all-reduce):
        # a read averaging them costs a reduction, 0.4 ms against 0.07 ms here, twice a call.
        self.__dict__["step_seconds"] = tf.Variable(
            0.0, dtype=tf.float64, trainable=False, name="step_seconds",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Seconds the train function waited on the input iterator (from asking for the
        # next batch, once the previous step was done, to having it), summed over steps;
        # measured where several steps run per call (`calls.multi_step`), else not (None).
        self.__dict__["input_seconds"] = tf.Variable(
            0.0, dtype=tf.float64, trainable=False, name="input_seconds")
        self.__dict__["input_measured"] = False
        # `train.recompute`: the forward pass in segments recomputed in the backward pass
        # (`recompute.Recompute`), or None
        self.__dict__["recompute"] = None if recompute is None else Recompute(
            self, *recompute, held=recomputing)

    @classmethod
    def wrap(cls, model, accumulation_steps: int = 1, all_reduce_dtype: str | None = None,
             update_hooks=(), unroll: bool = False, parallel=None, precision=None,
             time_steps: bool = True, recompute=None, recomputing=None) -> "TrainModel":
        """The same layers and weights as `model`, trained by this step.

        `update_hooks`: objects with `before_update(iterations)` and
        `after_update(iterations)`, run once per optimizer update in cross-replica context. `unroll`: accumulate in a
        Python loop (for models that synchronise replicas in their forward pass; a
        placed model always does). `parallel` (`tftrain.runtime.parallelism`): where each op of
        the step runs and how gradients are taken (default: data parallel under the
        current strategy). `precision` (`tftrain.runtime.precision.Precision`): loss scaling and
        the all-reduce dtype (default: the global policy, no loss scaling).
        `time_steps`: measure the time inside steps for the input-wait figure (not under
        op determinism, where TensorFlow refuses clocks). `recompute`: None, ("blocks",
        None) or ("every", K): activations recomputed in the backward pass over segments
        of the model (`tftrain.training.recompute`); `recomputing`: a context factory
        the recomputation is traced in (QAT's: activation ranges held)."""
        net = cls(inputs=model.inputs, outputs=model.outputs, name=model.name,
                  accumulation_steps=accumulation_steps, all_reduce_dtype=all_reduce_dtype,
                  update_hooks=update_hooks, unroll=unroll, parallel=parallel,
                  precision=precision, recompute=recompute, recomputing=recomputing)
        net.time_steps = time_steps
        return net

    def compile_step(self, optimizer, loss, metrics, steps_per_execution: int = 1) -> None:
        """`compile` for tftrain's step. The metrics are weighted: Keras applies sample
        weights only to `weighted_metrics`, and the weights of `data.remainder: pad` are 0
        on the padding slots, which plain `metrics` would count as examples."""
        self.compile(optimizer=optimizer, loss=loss, weighted_metrics=list(metrics),
                     steps_per_execution=steps_per_execution)

    @property
    def clocked(self) -> bool:
        """Whether steps add their time to `step_seconds` (asked for, and op determinism
        off: TensorFlow then refuses clocks)."""
        return self.time_steps and not op_determinism()

    # `train.jit_compile`: `_replica_gradients` (forward, backward, the accumulation loop,
    # loss and metric updates) compiled by XLA; the all-reduce, loss-scale bookkeeping,
    # update hooks and the optimizer update stay outside it (collectives and `merge_call`
    # inside XLA fail under distribution strategies).
    jit_compile_gradients = False

    def _compiled_gradients(self, x, y, sample_weight):
        """`_replica_gradients` compiled by XLA: one function per replica device, since
        each replica's trace captures that replica's variables (a trace shared between
        replicas makes XLA read one replica's weights from another's device)."""
        key = tf.constant(0, name="replica_device").device    # the replica's device scope
        compiled = self.__dict__.setdefault("_xla_gradients", {})
        if key not in compiled:
            compiled[key] = tf.function(self._replica_gradients, jit_compile=True,
                                        reduce_retracing=True, autograph=False)
        return compiled[key](x, y, sample_weight)

    # `train.steps_per_execution: auto` changes the steps per call during training
    # (`callbacks.ExecutionSizer`), which needs a multi-step train function from the
    # start: Keras builds a one-step function when it is created at one step per call.
    resizable_calls = False

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        if not self._traced_once(self.resizable_calls):
            return super().make_train_function(force)
        one = not self.resizable_calls and internals.steps_per_execution(self).numpy().item() == 1
        calls = multi_step(self, self.train_step, internals.step_counters(self)[0], lambda: (
            self.local_metrics() if self.local_step_logs else self.get_metrics_result()),
            waits=self.input_seconds if self.clocked and self.feed is None else None,
            feed=self.feed, clock=self.step_seconds if self.clocked and self.feed else None,
            loop=not one)
        self.__dict__["input_measured"] = self.clocked

        def train_function(iterator):   # code of its own: TensorFlow counts traces by code
            return calls(iterator)
        self.train_function = self.train_tf_function = tf.function(
            train_function, reduce_retracing=True, autograph=False)
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is not None and not force:
            return self.test_function
        # calls resized during training (`steps_per_execution: auto`) need the multi-step
        # function from the start: Keras' one-step function, made while calls were still
        # one step, runs one batch per call however many the loop counts (validation
        # after a mid-epoch resume then evaluated one batch in five)
        if not self._traced_once(self.resizable_calls):
            return super().make_test_function(force)
        calls = multi_step(self, self.test_step, internals.step_counters(self)[1],
                           self.get_metrics_result)

        def test_function(iterator):
            return calls(iterator)
        self.test_function = self.test_tf_function = tf.function(
            test_function, reduce_retracing=True, autograph=False)
        return self.test_function

    def make_predict_function(self, force=False):
        # Keras' predict function runs one step per call when it was made at one step per
        # call; made again once the calls are resized (`steps_per_execution: auto`)
        spe = internals.steps_per_execution(self)
        several = spe is not None and spe.numpy().item() > 1
        if self.predict_function is not None and self.__dict__.get("_predict_several") != several:
            force = True
        self.__dict__["_predict_several"] = several
        return super().make_predict_function(force)

    # `data.feed: device` (`tftrain.data.feed.DeviceFeed`): the train function gathers each
    # step's batches on the replicas' devices and leaves the iterator `fit` passes unread.
    # Set with `feed_from` before the train function is made.
    feed = None

    def feed_from(self, feed) -> None:
        """Train on batches from `feed` (None: from the iterator `fit` is given)."""
        self.__dict__["feed"] = feed
        self.train_function = None

    def settle_calls(self, steps: int) -> None:
        """The steps per call, settled (`ExecutionSizer`): settled at one step a call, the
        train function is made again without its loop (one more trace, for steps long
        enough that one call each is cheap: a loop of one step cost a ResNet-20's steps
        about 2% here)."""
        if steps == 1 and self.resizable_calls and self.train_function is not None:
            self.resizable_calls = False
            self.train_function = self.make_train_function(force=True)

    def _traced_once(self, resizable: bool) -> bool:
        """Whether `calls.multi_step` replaces Keras' multi-step function (several steps per call,
        calls that may be resized, or a device feed; not eager, XLA-compiled or
        coordinated)."""
        several = (resizable or self.feed is not None
                   or internals.steps_per_execution(self).numpy().item() > 1)
        return several and not (self.run_eagerly or self.jit_compile
                                or internals.cluster_coordinator(self))

    local_step_logs = False

    def log_local_metrics(self) -> None:
        """Log each replica's own metric values from the step (`local_metrics`); the
        caller puts the global values into each epoch's logs (`callbacks.GlobalMetrics`,
        as the runner does). Call before training starts."""
        self.local_step_logs = True
        self.distribute_reduction_method = "first"

    def local_metrics(self) -> dict:
        """Each metric's value on this replica, read without synchronising replicas.

        Keras' `metric.result()` in a train step synchronises every metric variable
        across replicas on every step (one all-reduce per variable under
        MultiWorkerMirroredStrategy, a `merge_call` under MirroredStrategy), and `fit`
        then sums the results over workers, another all-reduce per metric: a cluster's
        step would exchange three scalars per metric beside its gradients. With
        `log_local_metrics`, the step returns the local values instead and
        `callbacks.GlobalMetrics` puts the values over all replicas into each epoch's logs
        (one read at the epoch's last training batch)."""
        results = {}
        for metric in self.metrics:
            value = type(metric).result(metric)       # the class's: no synchronising wrapper
            results.update(value if isinstance(value, dict) else {metric.name: value})
        return results

    def _run_hooks(self, method: str) -> None:
        context = tf.distribute.get_replica_context()
        for hook in self.update_hooks:
            context.merge_call(lambda _, h=hook: getattr(h, method)(self.optimizer.iterations))

    def _packs(self, grads) -> bool:
        """Whether the update's gradients travel packed into flat buffers: where the
        strategy's reduction sends one tensor at a time (`AllReduce.packed`: 3% of a
        ResNet-20's mirrored step on 2 CPU devices), unless a gradient is sparse (an
        embedding's rows: packed, it would travel whole)."""
        return self.precision.wire.packed and not any(
            isinstance(g, tf.IndexedSlices) for g in grads)

    def _all_reduce(self, grads, variables):
        """The update's one cross-replica sum, cast to `all_reduce_dtype` on the wire only,
        packed where `_packs` says so."""
        sent = [tf.cast(g, self.all_reduce_dtype) for g in grads]
        context = tf.distribute.get_replica_context()
        if self._packs(grads):
            summed = unpack(context.all_reduce(tf.distribute.ReduceOp.SUM,
                                               pack(sent, variables)), variables)
        else:
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
        return [tf.cast(g, tf.float32) for g in summed]

    def _gradients(self, x, y, sample_weight, variables):
        """Gradients of one micro-batch's share of the update's loss."""
        def forward():
            y_pred = self.recompute(x) if self.recompute else self(x, training=True)
            return y_pred, self._micro_loss(x, y, y_pred, sample_weight)

        y_pred, _, grads = self.parallel.gradients(forward, variables)
        self.compiled_metrics.update_state(hard_labels(y, y_pred), y_pred, sample_weight)
        filled = []
        for g, v in zip(grads, variables):
            if g is None:
                with self.parallel.beside(v):
                    g = tf.zeros_like(v, tf.float32)
            filled.append(g)
        return filled

    def _micro_loss(self, x, y, y_pred, sample_weight):
        # The loss (Keras' `compute_loss`: compiled loss plus the layers' losses) averages
        # over the micro-batch and divides by the number of replicas (the all-reduce
        # sums); dividing by the accumulation steps too makes the summed gradient that of
        # the mean loss over the whole global batch.
        loss = self.compute_loss(x, y, y_pred, sample_weight) / self.accumulation_steps
        return self.precision.scale_loss(self.optimizer, loss)

    def train_step(self, data):
        with self.parallel.step_scope(self):     # what no variable owns: beside the outputs
            return self._step(data)

    def _replica_gradients(self, x, y, sample_weight):
        """The replica's summed gradients of the update's micro-batches (float32), with the
        loss and metrics updated: everything of the step before the all-reduce."""
        variables = self.trainable_variables
        n = self.accumulation_steps
        if n == 1:
            return self._gradients(x, y, sample_weight, variables)
        size = _size(x, n)
        if self.unroll:
            grads = self._gradients(*_micro_batch(x, y, sample_weight, 0, size), variables)
            wait = not self.parallel.overlap_micro_batches
            for i in range(1, n):
                grads = _add(grads, self._gradients(
                    *_micro_batch(x, y, sample_weight, i, size, after=grads if wait else ()),
                    variables), variables, self.parallel)
            return grads
        def accumulate(i, acc):
            return i + 1, _add(acc, self._gradients(
                *_micro_batch(x, y, sample_weight, i, size, after=acc), variables), variables,
                               self.parallel)

        if self.compiled_loss.built and self.compiled_metrics.built:     # `build_metrics`
            # every micro-batch in the loop, from zeros (0 + g is g exactly): the forward
            # and backward pass are traced once, not twice
            start = (tf.constant(0), [self._zeros_beside(v) for v in variables])
        else:
            # Keras creates its metric variables on first use, and no variable can be
            # created inside a while loop: the first micro-batch runs before it
            first = self._gradients(*_micro_batch(x, y, sample_weight, 0, size), variables)
            start = (tf.constant(1), [tf.convert_to_tensor(g) for g in first])
        # parallel_iterations=1: one micro-batch's activations alive at a time.
        _, grads = tf.while_loop(lambda i, _: i < n, accumulate, start, parallel_iterations=1)
        return grads

    def _zeros_beside(self, variable):
        with self.parallel.beside(variable):
            return tf.zeros(variable.shape, tf.float32)

    def build_metrics(self, y):
        """Create the loss and metric variables now, for labels like `y` (a tensor or a
        `tf.TensorSpec`), before the step is first traced: Keras creates them on first use,
        which makes `tf.function` trace the train function twice (once creating them, once
        without; 4 traces of the quickstart's step become 2, about 3 s less per stage), and
        no variable can be created inside the XLA-compiled part. Call inside the strategy
        scope."""
        if self.compiled_loss.built and self.compiled_metrics.built:
            return
        if isinstance(y, tf.TensorSpec):
            y = tf.zeros([1, *y.shape[1:]], y.dtype)
        shape = [1, *self.outputs[0].shape[1:]]
        y_pred = tf.zeros(shape, self.outputs[0].dtype)
        if not self.compiled_loss.built:
            self.compiled_loss.build(y_pred)
        if not self.compiled_metrics.built:
            self.compiled_metrics.build(y_pred, hard_labels(y[:1], y_pred))

    def _step(self, data):
        timed = self.clocked and self.feed is None      # a fed call is clocked as a whole
        if timed:           # clocks are ordered by data dependencies only: after the batch,
            with tf.control_dependencies(tf.nest.flatten(data)):     # before any compute
                began = tf.timestamp()
            with tf.control_dependencies([began]):
                data = tf.nest.map_structure(tf.identity, data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._run_hooks("before_update")
        if self.jit_compile_gradients:
            self.build_metrics(y)
            grads = self._compiled_gradients(x, y, sample_weight)
        else:
            grads = self._replica_gradients(x, y, sample_weight)
        variables = self.trainable_variables
        optimizer = self.optimizer
        # The one all-reduce: in float32 the optimizer's own aggregation (as in Keras);
        # for float16/bfloat16 here, while still loss-scaled so small gradients survive,
        # and here in packed buffers where the strategy would send a tensor at a time.
        reduce_here = ((self.all_reduce_dtype != tf.float32 or self._packs(grads))
                       and self.distribute_strategy.num_replicas_in_sync > 1)
        if reduce_here:
            grads = self._all_reduce(grads, variables)
        scaled = self.precision.loss_scaled
        if scaled:
            scale_before = tf.identity(optimizer.loss_scale)
            unscaled = []
            for g, v in zip(grads, variables):
                with self.parallel.beside(v):
                    unscaled.append(self.precision.unscale(optimizer, g))
            grads = unscaled
        # A non-finite (reduced) sum makes a dynamic LossScaleOptimizer skip the update
        # on every replica and halve the scale.
        optimizer.apply_gradients(zip(grads, variables), skip_gradients_aggregation=reduce_here)
        if scaled and optimizer.dynamic:
            # tf_keras counts a skipped update as an iteration; tftrain counts updates
            # made, so schedules, checkpoints, the weight average and `steps` never count
            # a skipped one. A skip resets the growth counter and halves the scale, but
            # never below 1, so at the floor only the counter tells; a made update that
            # grows the scale also resets the counter, but doubles the scale.
            skipped = tf.logical_and(tf.equal(optimizer.dynamic_counter, 0),
                                     optimizer.loss_scale <= scale_before)
            optimizer.iterations.assign_sub(tf.cast(skipped, tf.int64))
        self._run_hooks("after_update")
        results = self.local_metrics() if self.local_step_logs else self.get_metrics_result()
        if timed:           # ... and after the update (the iterations read follows it)
            done = [optimizer.iterations.read_value(), *tf.nest.flatten(results)]
            with tf.control_dependencies(done):
                self.step_seconds.assign_add(tf.timestamp() - began)
        return results
