"""Memory and FLOP estimates, and the choice between data and model parallelism.

Bytes per device for a training step: float32 parameters, float32 gradients, optimizer
slots (per optimizer: Adam 2, SGD with momentum 1, ...), and the activations kept for the
backward pass at the micro-batch, in the policy's compute dtype. The planner chooses
data parallelism when the model fits one device, else the smallest number of stages of
model parallelism that fits; a plan that cannot fit is a config error saying what to
change. `distribute.device_memory` overrides the memory read from the device (GPUs: from
TensorFlow; CPUs: available RAM), to plan for hardware you are not on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from tftrain.config import Config, ConfigError
from tftrain.runtime.placement import LayerCost, partition
from tftrain.optim.optimizers import slots_per_weight
from tftrain.core import internals
from tftrain.core.cpu import theoretical_peak

# Activations kept for the backward pass, as a multiple of what `activation_bytes` counts;
# checked against the allocator peak on this project's models (benchmarks/planner.py).
ACTIVATION_FACTOR = 1.0
GIB = 2**30


def optimizer_slots(cfg: Config) -> int:
    """Optimizer state variables per weight, from the configured optimizer itself."""
    return slots_per_weight(cfg.train.optimizer)


def compute_bytes(policy: str) -> int:
    return 2 if policy in ("mixed_float16", "mixed_bfloat16") else 4


@dataclass(frozen=True)
class Estimate:
    params: float
    gradients: float        # and as much again for the optimizer's update temporaries
    slots: float
    activations: float

    @property
    def total(self) -> float:
        return self.params + 2 * self.gradients + self.slots + self.activations

    def describe(self) -> str:
        mib = 2**20
        return (f"{self.total / mib:,.1f} MiB = params {self.params / mib:,.1f} + gradients and update "
                f"temporaries {2 * self.gradients / mib:,.1f} + optimizer slots {self.slots / mib:,.1f} + "
                f"activations {self.activations / mib:,.1f}")


def estimate(costs: list[LayerCost], micro_batch: int, slots: int, policy: str) -> Estimate:
    """Training bytes of `costs` (a whole model or one stage) at `micro_batch` examples."""
    params = sum(c.params for c in costs) * 4.0
    acts = sum(c.activation_bytes for c in costs) / 4 * compute_bytes(policy)
    return Estimate(params, params, params * slots, acts * micro_batch * ACTIVATION_FACTOR)


def device_memory(device: str, override: int | None) -> int:
    """Bytes a device offers: the override, else TensorFlow's GPU limit or available RAM."""
    if override:
        return int(override)
    if "GPU" in device.upper():
        index = int(device.rsplit(":", 1)[-1])
        gpus = [d for d in internals.local_devices() if d.device_type == "GPU"]
        if index < len(gpus):
            return int(gpus[index].memory_limit)
    return _available_ram()


_RAM: list[int] = []


def _available_ram() -> int:
    """The host's available RAM, read once per process (it moves from run to run with
    the page cache; one figure for every plan of a process)."""
    if not _RAM:
        _RAM.append(_read_available_ram())
    return _RAM[0]


def _read_available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Plan:
    kind: str                       # "data" or "model"
    stages: int                     # 1 for data parallel
    per_replica: int                # micro-batch per replica (or per pipeline)
    accumulation: int
    per_device: tuple[Estimate, ...]
    memory: int
    flops_per_example: float
    configured: bool = False        # model.placement chose the stages, not the planner
    host: bool = False              # the devices are CPUs: `memory` is the host's RAM

    def describe(self) -> str:
        why = "as model.placement says" if self.configured else "the model does not fit one device"
        what = ("data parallel (the model fits one device)" if self.kind == "data"
                else f"model parallel over {self.stages} stages ({why})")
        memory = (f"host memory {_bytes(self.memory)} available" if self.host
                  else f"device memory {_bytes(self.memory)}")
        lines = [f"planner: {what}; {memory}; forward FLOPs per example "
                 f"{self.flops_per_example:,.0f}"]
        for i, e in enumerate(self.per_device):
            lines.append(f"  device {i}: {e.describe()}")
            if self.kind == "data":
                break          # every replica holds the same
        return "\n".join(lines)


def choose(cfg: Config, costs: list[LayerCost], devices: list[str], policy: str,
           micro_batch: int, accumulation: int, replicas: int | None = None,
           force_stages: int | None = None) -> Plan:
    """Data parallel if the model fits one device, else the fewest stages that fit. With
    `train.global_batch_size`, the largest micro-batch per replica that fits, starting
    from the configured accumulation steps (more accumulation, smaller micro-batches)."""
    slots = optimizer_slots(cfg)
    memory = device_memory(devices[0], cfg.distribute.device_memory)
    flops = sum(c.flops for c in costs)
    tried = []
    for stages in ([force_stages] if force_stages else range(1, len(devices) + 1)):
        copies = (replicas or len(devices)) if stages == 1 else 1
        for micro, acc in _batch_options(cfg, micro_batch, accumulation, copies):
            per_stage = _stage_estimates(costs, stages, micro, slots, policy)
            tried.append((stages, micro, max(e.total for e in per_stage)))
            if tried[-1][2] <= memory:
                return Plan("data" if stages == 1 and not force_stages else "model", stages,
                            micro, acc, tuple(per_stage), memory, flops, bool(force_stages),
                            host=not cfg.distribute.device_memory and "GPU" not in devices[0].upper())
    one = min(t[2] for t in tried if t[0] == tried[0][0])
    split = min(t[2] for t in tried)
    raise ConfigError(
        f"distribute.device_memory: the model needs {_bytes(one)} on one device and "
        f"{_bytes(split)} per device at best over {len(devices)} devices, which have "
        f"{_bytes(memory)} each; lower data.per_replica_batch_size (or set "
        "train.global_batch_size with more train.accumulation_steps), use precision.policy: "
        "mixed_bfloat16, a smaller model, or more devices")


def _bytes(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.2f} MiB"


def _batch_options(cfg: Config, micro: int, accumulation: int, copies: int):
    """(micro-batch, accumulation) pairs to try, largest micro-batch first."""
    total = cfg.train.global_batch_size
    if total is None or total % (copies * accumulation):
        # not divisible: the batch plan reports it; the planner does not work around it
        return [(max(1, (total or 0) // (copies * accumulation)) if total else micro, accumulation)]
    return [(total // (copies * a), a) for a in range(accumulation, total + 1)
            if total % (copies * a) == 0]


def _stage_estimates(costs, stages, micro, slots, policy) -> list[Estimate]:
    if stages == 1:
        return [estimate(costs, micro, slots, policy)]
    weights = [c.memory(micro, slots, compute_bytes(policy)) for c in costs]
    assignment = partition(weights, stages)
    return [estimate([c for c, s in zip(costs, assignment) if s == k], micro, slots, policy)
            for k in range(stages)]


def matmul_peak_flops(device: str = "/cpu:0", n: int = 1024, repeats: int = 5,
                      dtype: str = "float32") -> float:
    """Measured matmul FLOP/s on `device` in `dtype` (what model FLOP utilisation is
    quoted against)."""
    with tf.device(device):
        a = tf.cast(tf.random.normal((n, n)), dtype)
        b = tf.cast(tf.random.normal((n, n)), dtype)
        matmul = tf.function(lambda: tf.reduce_sum(tf.cast(tf.matmul(a, b), tf.float32)))
        matmul()
        best = np.inf
        for _ in range(repeats):
            start = time.perf_counter()
            matmul().numpy()
            best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


@dataclass(frozen=True)
class Peak:
    """The FLOP/s the training devices could reach, for MFU: `flops`, the larger of the
    `measured` matmul and, on a CPU, the `theoretical` peak of its vector units and clock
    (a matmul timed briefly on a shared machine read below what convolutions then
    reached: MFU 1.03 on a compute-bound CNN)."""
    flops: float
    dtype: str
    description: str       # e.g. "2 x NVIDIA A100 (bfloat16 matmul, measured) x 2 workers"
    measured: float = 0.0
    theoretical: float | None = None


def compute_dtype(policy: str) -> str:
    return {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}.get(policy, "float32")


def peak_flops(devices, policy: str, workers: int = 1) -> Peak:
    """Peak of the devices that train, in the policy's compute dtype: a matmul measured
    on one device of each kind (GPUs by model name, times their count; logical CPU
    devices share one processor, so the CPU counts once), times the workers (alike)."""
    dtype = compute_dtype(policy)
    gpus = [d for d in devices if "GPU" in d.upper()]
    if gpus:
        kinds: dict[str, list[str]] = {}
        for device in gpus:
            kinds.setdefault(_gpu_name(device), []).append(device)
        flops = sum(matmul_peak_flops(group[0], n=4096, dtype=dtype) * len(group)
                    for group in kinds.values())
        what = " + ".join(f"{len(g)} x GPU {name}".rstrip() for name, g in kinds.items())
        theoretical = None
    else:
        flops, what = matmul_peak_flops("/cpu:0", dtype=dtype), "the CPU"
        theoretical = theoretical_peak(dtype)
    workers_text = f" x {workers} workers" if workers > 1 else ""
    if theoretical is not None and theoretical > flops:
        return Peak(theoretical * workers, dtype, f"{what} ({dtype}, vector units x clock; "
                    f"measured matmul {flops / 1e9:.0f} GFLOP/s){workers_text}",
                    flops * workers, theoretical * workers)
    return Peak(flops * workers, dtype, f"{what} ({dtype} matmul, measured){workers_text}",
                flops * workers, None if theoretical is None else theoretical * workers)


def _gpu_name(device: str) -> str:
    index = int(device.rsplit(":", 1)[-1])
    gpus = tf.config.list_physical_devices("GPU")
    if index < len(gpus):
        return tf.config.experimental.get_device_details(gpus[index]).get("device_name", "")
    return ""
