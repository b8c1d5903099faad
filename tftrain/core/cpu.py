"""The CPU's features, read without TensorFlow: what bfloat16 and int8 speed depend on."""
from __future__ import annotations

from pathlib import Path

INT8_FLAGS = (("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"), ("amx_int8", "AMX-INT8"),
              ("asimddp", "ARM dot product"))


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def int8_instructions(flags: str | None = None) -> list[str]:
    """The CPU's int8 dot-product instructions (int8 outruns float with them)."""
    flags = cpu_flags() if flags is None else flags
    return [name for flag, name in INT8_FLAGS if f" {flag}" in flags]


def busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine spent busy, CPU seconds this process spent) so far,
    from /proc/stat and `os.times`; None where /proc/stat cannot be read. Their differences
    over an interval give the cores other processes kept busy meanwhile (`others_cores`)."""
    import os

    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal: busy is all but idle and iowait
    values = [int(v) for v in fields[:8]]
    busy = sum(values) - values[3] - values[4]
    own = os.times()
    return busy / ticks, own.user + own.system


def others_cores(before: tuple[float, float] | None, after: tuple[float, float] | None,
                 wall: float) -> float | None:
    """The cores other processes kept busy on average over `wall` seconds between two
    `busy_seconds` readings (None when either is missing)."""
    if before is None or after is None or wall <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall


# float32 FLOPs a core can do per cycle at most, by the widest vectors its flags name: an
# x86 core issues at most two fused multiply-adds a cycle (2 x lanes x 2 FLOPs)
FP32_PER_CYCLE = (("avx512f", 64), ("fma", 32), ("avx", 16), ("sse2", 8))


def theoretical_peak(dtype: str = "float32", flags: str | None = None,
                     cores: int | None = None, mhz: float | None = None) -> float | None:
    """FLOP/s the CPU cannot exceed in `dtype`: cores x clock x FLOPs per cycle (None
    where the flags name no known vector unit). bfloat16 counts twice float32's with
    AVX-512 BF16 (its dot product takes two bfloat16 products per float32 lane). The clock
    is the highest /proc/cpuinfo reports; a core that turbo-boosts above it can exceed the
    figure, which is why MFU is quoted against the larger of this and a measured peak."""
    import os
    import re

    flags = cpu_flags() if flags is None else flags
    per = next((n for flag, n in FP32_PER_CYCLE if f" {flag}" in flags), None)
    if per is None:
        return None
    if dtype == "bfloat16" and " avx512_bf16" in flags:
        per *= 2
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    if mhz is None:
        clocks = [float(v) for v in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", flags, re.M)]
        if not clocks:
            return None
        mhz = max(clocks)
    return float(cores) * mhz * 1e6 * per
