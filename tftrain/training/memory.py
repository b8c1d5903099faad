"""The allocator's peak bytes during a stage, per device, beside the planner's estimate.

GPUs: `tf.config.experimental.get_memory_info` per GPU. CPUs: the same, where the CPU
allocator keeps statistics (TensorFlow 2.21's builds here do by default; older ones
only with `TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow loads, and report zeros
otherwise: then nothing is recorded); logical CPU devices share that one allocator, so
the host has one figure. The peak is taken from the
stage's start (the model, optimizer slots and input pipeline already allocated count,
as the planner counts weights and slots).
"""
from __future__ import annotations

HOST = "CPU (one allocator for the logical CPU devices)"


def host_allocated() -> int:
    """Bytes the CPU allocator holds now (0 where it keeps no statistics)."""
    import tensorflow as tf
    return int(tf.config.experimental.get_memory_info("CPU:0")["current"])


def _name(device: str) -> str:
    """`/job:.../device:GPU:1` or `/gpu:1` -> `GPU:1`."""
    import tensorflow as tf
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type.upper()}:{spec.device_index or 0}"


class Peaks:
    """Reset at `started`, read at `read`: the allocator peak of each training device."""

    def __init__(self, devices: list[str]):
        names = [_name(d) for d in devices]
        gpus = sorted({n for n in names if n.startswith("GPU")})
        self.devices = gpus or (["CPU:0"] if names else [])

    def started(self) -> "Peaks":
        """Counting from now."""
        import tensorflow as tf
        for device in self.devices:
            tf.config.experimental.reset_memory_stats(device)
        return self

    def read(self, estimate: float | None) -> dict | None:
        """{"peak_bytes": {device: bytes}, "estimate_bytes", "peak_over_estimate"}; None
        where the allocator keeps no statistics (a CPU without the BFC allocator)."""
        import tensorflow as tf
        peaks = {}
        for device in self.devices:
            info = tf.config.experimental.get_memory_info(device)
            if info["peak"] == 0 and info["current"] == 0:
                continue
            peaks[HOST if device.startswith("CPU") else device] = int(info["peak"])
        if not peaks:
            return None
        out: dict = {"peak_bytes": peaks}
        if estimate:
            out["estimate_bytes"] = int(estimate)
            out["peak_over_estimate"] = round(max(peaks.values()) / estimate, 3)
        return out


def describe(memory: dict | None, stage: str) -> str | None:
    """The console's line for a stage's `memory` (None where nothing was measured)."""
    if not memory:
        return None
    mib = 2**20
    peaks = ", ".join(f"{d.split(' ')[0]} {b / mib:,.1f} MiB" for d, b in memory["peak_bytes"].items())
    if "estimate_bytes" not in memory:
        return f"allocator peak ({stage}) {peaks}"
    return (f"allocator peak ({stage}) {peaks}; planner's estimate "
            f"{memory['estimate_bytes'] / mib:,.1f} MiB per device "
            f"(peak / estimate {memory['peak_over_estimate']:.2f})")
