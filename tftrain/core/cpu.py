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
