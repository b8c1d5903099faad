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
