"""Precision policy: float32, mixed_float16 (loss scaling), mixed_bfloat16, and `auto`.

Variables stay float32 under every policy (Keras mixed precision); model outputs and
losses are float32 because `float32_outputs` appends a float32 cast to any model whose
outputs are not already float32.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.config import DistributeConfig, PrecisionConfig
from tftrain.core.cpu import cpu_flags
from tftrain.core import internals


def cpu_has_bf16() -> bool:
    """True on CPUs with native bfloat16 arithmetic (AVX512-BF16 or AMX)."""
    flags = cpu_flags()
    return any(flag in flags for flag in (" avx512_bf16", " amx_bf16"))


def gpu_compute_capability() -> tuple[int, int] | None:
    """The lowest compute capability among visible GPUs, or None without GPUs."""
    caps = []
    for gpu in tf.config.list_physical_devices("GPU"):
        cap = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if cap:
            caps.append(tuple(cap))
    return min(caps) if caps else None


def choose_policy(cfg: PrecisionConfig) -> str:
    """Resolve `auto` by hardware: bf16 on Ampere+ GPUs and BF16 CPUs, fp16 on 7.x GPUs."""
    if cfg.policy != "auto":
        if cfg.policy == "mixed_float16" and gpu_compute_capability() is None:
            warnings.warn("precision.policy=mixed_float16 on a CPU is emulated and slower than "
                          "float32 (about 4x here); use mixed_bfloat16 or float32 on CPUs.",
                          stacklevel=2)
        return cfg.policy
    cap = gpu_compute_capability()
    if cap is not None:
        if cap >= (8, 0):
            return "mixed_bfloat16"
        return "mixed_float16" if cap >= (7, 0) else "float32"
    return "mixed_bfloat16" if cpu_has_bf16() else "float32"


def apply_policy(name: str) -> None:
    """Set the global Keras policy; models built afterwards compute in it."""
    keras.mixed_precision.set_global_policy(name)


@dataclass(frozen=True)
class AllReduce:
    """How the gradients of one update travel between replicas."""
    dtype: str            # on the wire
    loss_scaled: bool     # float16 on the wire: scaled so small gradients do not flush to 0
    nccl: bool
    note: str = ""
    # gradients packed into flat buffers before the sum (`packed`): where the strategy's
    # reduction sends one tensor at a time (ReductionToOneDevice, MirroredStrategy's
    # choice without GPUs: three ops a variable); NCCL, hierarchical copy and the
    # multi-worker collectives pack of their own
    packed: bool = False

    def describe(self) -> str:
        return (f"all-reduce: {self.dtype}{', loss-scaled' if self.loss_scaled else ''}"
                f"{' over NCCL' if self.nccl else ''}{', packed' if self.packed else ''}"
                f"{'; ' + self.note if self.note else ''}")


def reduces_with_nccl(strategy) -> bool:
    """Whether the strategy's gradient all-reduce runs on NCCL: MirroredStrategy with
    NcclAllReduce, or a multi-worker strategy on GPUs whose collectives are NCCL (AUTO is
    a hint the collective runtime resolves to RingReduce; tftrain never passes it)."""
    ext = strategy.extended
    cross_device, options = internals.all_reduce(strategy)
    if isinstance(cross_device, tf.distribute.NcclAllReduce):
        return True
    if options is None:
        return False
    impl = tf.distribute.experimental.CommunicationImplementation
    on_gpu = any("GPU" in d.upper() for d in getattr(ext, "worker_devices", ()))
    return on_gpu and options.implementation == impl.NCCL


def all_reduce_plan(d: DistributeConfig, strategy, policy: str) -> AllReduce:
    """The wire dtype for `distribute.all_reduce_dtype` on this strategy. NCCL's all-reduce
    takes half, float32/64 and int32/64 but no bfloat16, so bfloat16 travels as float16
    there; float16 on the wire is always loss-scaled, whatever the policy (a float32 run
    gets a dynamic loss scale of its own)."""
    nccl = reduces_with_nccl(strategy)
    dtype, note = d.all_reduce_dtype, ""
    if dtype == "bfloat16" and nccl:
        dtype, note = "float16", "NCCL has no bfloat16 all-reduce, so gradients travel as float16"
    cross_device, _ = internals.all_reduce(strategy)
    packed = (strategy.num_replicas_in_sync > 1
              and isinstance(cross_device, tf.distribute.ReductionToOneDevice))
    return AllReduce(dtype, dtype == "float16" and strategy.num_replicas_in_sync > 1
                     or policy == "mixed_float16", nccl, note, packed)


def wrap_optimizer(optimizer, policy: str, cfg: PrecisionConfig, loss_scaled: bool | None = None):
    """Loss scaling for float16 compute or a float16 all-reduce: dynamic (grows/halves) or a
    fixed scale."""
    if not (policy == "mixed_float16" if loss_scaled is None else loss_scaled):
        return optimizer
    if cfg.loss_scale == "dynamic":
        return keras.mixed_precision.LossScaleOptimizer(
            optimizer, dynamic=True, initial_scale=cfg.initial_scale)
    return keras.mixed_precision.LossScaleOptimizer(
        optimizer, dynamic=False, initial_scale=float(cfg.loss_scale))


class Precision:
    """The numeric format a stage trains in, owned by the stage: the Keras policy its
    model is built under (set only while building, then the previous one is restored, so
    QAT's float32 leaves the run's policy alone), the optimizer's loss scaling, the loss
    scaling and unscaling inside the step, and float32 model outputs."""

    def __init__(self, *, policy: str, config: PrecisionConfig, wire: AllReduce | None = None):
        self.policy, self.config = policy, config
        self.wire = wire or AllReduce("float32", policy == "mixed_float16", False)

    @classmethod
    def for_strategy(cls, *, policy: str, config: PrecisionConfig, distribute: DistributeConfig,
                     strategy) -> "Precision":
        """The precision of `policy` with the all-reduce the strategy will run."""
        return cls(policy=policy, config=config,
                   wire=all_reduce_plan(distribute, strategy, policy))

    def with_policy(self, policy: str, *, distribute: DistributeConfig, strategy) -> "Precision":
        """The same loss-scale settings and wire dtype under another policy."""
        return Precision.for_strategy(policy=policy, config=self.config, distribute=distribute,
                                      strategy=strategy)

    @property
    def loss_scaled(self) -> bool:
        """float16 compute or float16 on the wire: the loss is scaled so that small
        gradients do not flush to zero."""
        return self.wire.loss_scaled

    @property
    def all_reduce_dtype(self) -> str:
        return self.wire.dtype

    @contextlib.contextmanager
    def scope(self):
        """Models built inside compute in this policy; the previous policy is restored."""
        previous = keras.mixed_precision.global_policy()
        apply_policy(self.policy)
        try:
            yield self
        finally:
            keras.mixed_precision.set_global_policy(previous)

    def build(self, builder):
        """`builder()` under this policy, with float32 outputs."""
        with self.scope():
            return float32_outputs(builder())

    def wrap_optimizer(self, optimizer):
        return wrap_optimizer(optimizer, self.policy, self.config, loss_scaled=self.loss_scaled)

    def scale_loss(self, optimizer, loss):
        return optimizer.get_scaled_loss(loss) if self.loss_scaled else loss

    def unscale(self, optimizer, gradient):
        return optimizer.get_unscaled_gradients([gradient])[0] if self.loss_scaled else gradient


def float32_outputs(model):
    """The same model with float32 outputs (a no-op when they already are)."""
    if all(out.dtype == tf.float32 for out in model.outputs):
        return model
    # named after the layer that gives the output (a tensor's own name may be a graph
    # placeholder's, "Placeholder:0", which is no valid layer name)
    outputs = [keras.layers.Activation("linear", dtype="float32",
                                       name=f"{internals.history(out).layer.name}_float32")(out)
               for out in model.outputs]
    return keras.Model(model.inputs, outputs if len(outputs) > 1 else outputs[0], name=model.name)


# gradients per packed buffer at most (a flat copy of each is made on both sides of the sum)
PACK_BYTES = 32 * 2**20


def pack(tensors: list, like: list) -> list:
    """`tensors` flattened and concatenated, in order, into buffers of at most
    `PACK_BYTES` (a tensor larger than that is a buffer of its own); `like`: what gives
    each one's static size (its variable: a gradient's own shape may be unknown)."""
    packs, current, size = [], [], 0
    for t, v in zip(tensors, like):
        nbytes = t.dtype.size * v.shape.num_elements()
        if current and size + nbytes > PACK_BYTES:
            packs.append(tf.concat(current, 0))
            current, size = [], 0
        current.append(tf.reshape(t, [-1]))
        size += nbytes
    if current:
        packs.append(tf.concat(current, 0))
    return packs


def unpack(packs: list, like: list) -> list:
    """`pack`'s buffers back into tensors shaped as `like`."""
    flat = tf.concat(packs, 0) if len(packs) > 1 else packs[0]
    sizes = [t.shape.num_elements() for t in like]
    return [tf.reshape(part, t.shape) for part, t in zip(tf.split(flat, sizes), like)]
