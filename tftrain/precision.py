"""Precision policy: float32, mixed_float16 (loss scaling), mixed_bfloat16, and `auto`.

Variables stay float32 under every policy (Keras mixed precision); model outputs and
losses are float32 because `float32_outputs` appends a float32 cast to any model whose
outputs are not already float32.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import tensorflow as tf

from tftrain._keras import keras
from tftrain.config import PrecisionConfig


def cpu_has_bf16() -> bool:
    """True on CPUs with native bfloat16 arithmetic (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
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


def wrap_optimizer(optimizer, policy: str, cfg: PrecisionConfig):
    """Loss scaling for float16: dynamic (grows/halves) or a fixed scale."""
    if policy != "mixed_float16":
        return optimizer
    if cfg.loss_scale == "dynamic":
        return keras.mixed_precision.LossScaleOptimizer(
            optimizer, dynamic=True, initial_scale=cfg.initial_scale)
    return keras.mixed_precision.LossScaleOptimizer(
        optimizer, dynamic=False, initial_scale=float(cfg.loss_scale))


def float32_outputs(model):
    """The same model with float32 outputs (a no-op when they already are)."""
    if all(out.dtype == tf.float32 for out in model.outputs):
        return model
    outputs = [keras.layers.Activation("linear", dtype="float32", name=f"{out.name.split('/')[0]}_float32")(out)
               for out in model.outputs]
    return keras.Model(model.inputs, outputs if len(outputs) > 1 else outputs[0], name=model.name)
