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

import functools
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
# The share of a device's memory (less what it holds before any step) a step is planned
# into: the rest is for what the estimate does not itemize, the allocator's fragmentation
# (rounded bins), the runtime's buffers and the copies of the model a run keeps (planned,
# exported). Measured on MobileNetV2 at 64 x 8 on a CPU (benchmarks/recompute.py's grid):
# peak 203 MiB where the estimate with the host's data said 176 MiB (0.87).
USABLE = 0.85
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


def estimate(costs: list[LayerCost], micro_batch: int, slots: int, policy: str,
             kept: float | None = None) -> Estimate:
    """Training bytes of `costs` (a whole model or one stage) at `micro_batch` examples;
    `kept`: the activation bytes per example kept with recomputation (float32), else all
    the layers' outputs."""
    params = sum(c.params for c in costs) * 4.0
    acts = (sum(c.activation_bytes for c in costs) if kept is None else kept) / 4 * \
        compute_bytes(policy)
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


# What a step costs besides its FLOPs, per layer and pass (forward, or each half of the
# backward): an op's dispatch and a kernel's launch, about 20 microseconds on both a CPU
# (TensorFlow's executor) and a GPU (a launch and its synchronisation); what makes many
# small micro-batches slower than few large ones at the same FLOPs.
LAUNCH_SECONDS = 2e-5
# the micro-batches a pipeline of `model.placement.microbatches: auto` is timed at
PIPELINE_MICROBATCHES = 4


@dataclass(frozen=True)
class Way:
    """One way to run the update's step: its layout, the largest bytes one device holds,
    and the estimated seconds per optimizer update (`update_seconds`)."""
    stages: int
    per_replica: int
    accumulation: int
    recompute: bool
    per_device: tuple[Estimate, ...]
    seconds: float

    @property
    def bytes(self) -> float:
        return max(e.total for e in self.per_device)

    def name(self) -> str:
        what = (f"model parallel over {self.stages} stages" if self.stages > 1
                else "recompute" if self.recompute
                else "accumulation" if self.accumulation > 1 else "data parallel")
        return f"{what}, micro-batch {self.per_replica} x {self.accumulation} accumulated"

    def line(self, memory: float) -> str:
        fits = "fits" if self.bytes <= memory else "does not fit"
        return (f"{self.name()}: {_bytes(self.bytes)} per device ({fits}), "
                f"{self.seconds * 1e3:,.1f} ms per update (estimate)")


def update_seconds(costs: list[LayerCost], micro: int, accumulation: int, recompute: bool,
                   stages: int, peak: float, overlap: bool) -> float:
    """Estimated seconds per update on one device (or pipeline): forward and backward (the
    backward twice the forward's FLOPs), a second forward with recomputation, at `peak`
    FLOP/s, plus `LAUNCH_SECONDS` per layer and pass for each micro-batch. A pipeline runs
    each micro-batch as M smaller ones (`PIPELINE_MICROBATCHES`: M times the launches);
    K stages overlapping them take (M + K - 1) / (M K) of that (GPipe); where stages
    cannot overlap (logical CPU devices share the processor: docs/performance.md), all
    of it."""
    passes = 4 if recompute else 3
    launch = len(costs) * LAUNCH_SECONDS * passes
    compute = sum(c.flops for c in costs) * micro * passes / peak
    if stages == 1:
        return accumulation * (launch + compute)
    m = PIPELINE_MICROBATCHES
    serial = accumulation * (m * launch + compute)
    return serial * (m + stages - 1) / (m * stages) if overlap else serial


@dataclass(frozen=True)
class Resident:
    """Bytes of each training device held before any step, and what holds them (a device
    feed's copy of the training set; on a CPU, the host's data in the same allocator)."""
    bytes: float = 0.0
    what: str = ""
    remedy: str = ""         # how to free it, for the error when nothing fits

    def __bool__(self) -> bool:
        return self.bytes > 0


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
    recompute: bool = False         # activations recomputed in the backward pass
    # the ways compared when the configured one did not fit (the chosen one among them)
    considered: tuple[Way, ...] = ()
    resident: Resident = Resident()  # what each device holds before any step

    @property
    def room(self) -> float:
        """The bytes a step may take: `USABLE` of the device's, less what it holds before
        any step."""
        return self.memory * USABLE - self.resident.bytes

    def describe(self) -> str:
        why = "as model.placement says" if self.configured else "the model does not fit one device"
        what = ("data parallel (the model fits one device)" if self.kind == "data"
                else f"model parallel over {self.stages} stages ({why})")
        if self.recompute:
            what += ", activations recomputed in the backward pass"
        memory = (f"host memory {_bytes(self.memory)} available" if self.host
                  else f"device memory {_bytes(self.memory)}")
        if self.resident:
            memory += f" ({_bytes(self.resident.bytes)} of it {self.resident.what})"
        lines = [f"planner: {what}; {memory}; forward FLOPs per example "
                 f"{self.flops_per_example:,.0f}"]
        for i, e in enumerate(self.per_device):
            lines.append(f"  device {i}: {e.describe()}")
            if self.kind == "data":
                break          # every replica holds the same
        if self.considered:
            lines.append(f"  the configured step does not fit the {_bytes(self.room)} a step may take "
                         f"({USABLE:.0%} of the device{', less what it holds' if self.resident else ''}"
                         "); the ways compared:")
            chosen = min((w for w in self.considered if w.bytes <= self.room),
                         key=lambda w: w.seconds)
            for way in self.considered:
                mark = "chosen, the fastest that fits" if way is chosen else ""
                lines.append(f"    {way.line(self.room)}" + (f": {mark}" if mark else ""))
        return "\n".join(lines)


def choose(cfg: Config, costs: list[LayerCost], devices: list[str], policy: str,
           micro_batch: int, accumulation: int, replicas: int | None = None,
           force_stages: int | None = None, kept: float | None = None,
           resident: Resident = Resident()) -> Plan:
    """The configured step if it fits a device (`train.recompute` as set), else the
    fastest way that fits by `update_seconds`: smaller micro-batches with more
    accumulation (with `train.global_batch_size`), recomputation (`train.recompute:
    auto`, where `kept` gives what it keeps per example), or model parallelism over the
    fewest stages that fit (`distribute.strategy: auto`). `resident`: what each
    device holds before any step (the training set's copy of a device feed; on a CPU,
    the host's data)."""
    slots = optimizer_slots(cfg)
    memory = device_memory(devices[0], cfg.distribute.device_memory)
    room = memory * USABLE - resident.bytes
    flops = sum(c.flops for c in costs)
    host = not cfg.distribute.device_memory and "GPU" not in devices[0].upper()
    setting = cfg.train.recompute
    explicit = setting not in ("none", "auto")
    recomputes = ([explicit] if force_stages else [True] if explicit
                  else [False, True] if setting == "auto" and kept else [False])

    def sized(stages, micro, recompute) -> tuple[Estimate, ...]:
        return tuple(_stage_estimates(costs, stages, micro, slots, policy,
                                      kept if recompute else None))

    def way(stages, micro, acc, recompute):
        return Way(stages, micro, acc, recompute, sized(stages, micro, recompute), update_seconds(
            costs, micro, acc, recompute, stages, _peak(devices[0], policy),
            overlap="GPU" in devices[0].upper()))

    def plan(stages, micro, acc, recompute, per_device, considered=()) -> Plan:
        return Plan("data" if stages == 1 and not force_stages else "model", stages, micro, acc,
                    per_device, memory, flops, bool(force_stages), host=host,
                    recompute=recompute, considered=considered, resident=resident)

    first_stages = force_stages or 1
    first_micro, first_acc = _batch_options(
        cfg, micro_batch, accumulation, (replicas or len(devices)) if not force_stages else 1)[0]
    configured = sized(first_stages, first_micro, recomputes[0])
    if max(e.total for e in configured) <= room:
        return plan(first_stages, first_micro, first_acc, recomputes[0], configured)
    ways = []
    for stages in ([force_stages] if force_stages else range(1, len(devices) + 1)):
        copies = (replicas or len(devices)) if stages == 1 else 1
        for recompute in (recomputes if stages == 1 else [explicit]):
            family = [way(stages, micro, acc, recompute)
                      for micro, acc in _batch_options(cfg, micro_batch, accumulation, copies)]
            fitting = [w for w in family if w.bytes <= room]
            # the family's best: its largest micro-batch that fits (else its configured one)
            ways.append(fitting[0] if fitting else family[0])
    allowed = [w for w in ways if w.bytes <= room and (
        w.stages == 1 or force_stages or cfg.distribute.strategy == "auto")]
    fitting = allowed or [w for w in ways if w.bytes <= room]
    if fitting:
        best = min(fitting, key=lambda w: w.seconds)
        return plan(best.stages, best.per_replica, best.accumulation, best.recompute,
                    best.per_device, tuple(ways) if len(ways) > 1 else ())
    one = min(w.bytes for w in ways if w.stages == ways[0].stages)
    split = min(w.bytes for w in ways)
    raise ConfigError(
        f"distribute.device_memory: the model needs {_bytes(one)} on one device and "
        f"{_bytes(split)} per device at best over {len(devices)} devices, which have "
        f"{_bytes(memory)} each, {USABLE:.0%} of it planned for a step" + (
            f" ({_bytes(resident.bytes)} of it {resident.what}"
            f"{': ' + resident.remedy if resident.remedy else ''})" if resident else "")
        + "; lower data.per_replica_batch_size (or set "
        "train.global_batch_size with more train.accumulation_steps), use precision.policy: "
        "mixed_bfloat16, train.recompute: blocks, a smaller model, or more devices")


@functools.lru_cache(maxsize=None)
def _peak(device: str, policy: str) -> float:
    """FLOP/s the estimates are made at: a CPU's vector units times its clock, else a
    matmul measured on the device (once per process)."""
    dtype = compute_dtype(policy)
    if "GPU" not in device.upper():
        theoretical = theoretical_peak(dtype)
        if theoretical:
            return theoretical
    return matmul_peak_flops(device, n=1024 if "GPU" not in device.upper() else 4096,
                             dtype=dtype)


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


def _stage_estimates(costs, stages, micro, slots, policy, kept=None) -> list[Estimate]:
    if stages == 1:
        return [estimate(costs, micro, slots, policy, kept)]
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
