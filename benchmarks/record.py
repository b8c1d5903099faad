"""How a benchmark reports its figures: `rows(...)` prints them and, under
`python -m benchmarks`, hands them to the harness, which keeps them in
`benchmarks/results.json` and writes the benchmark table from that file."""
import json
import os
import sys
from pathlib import Path

ENV = "TFTRAIN_BENCHMARK_RESULTS"


def rows(figures: list[tuple[str, str]], command: str | None = None) -> None:
    """`figures`: (what is measured, value) rows of the benchmark table
    (docs/performance.md), for this script's run; `command`: how to rerun it (default: the script with its arguments)."""
    command = command or "python " + " ".join(
        [os.path.relpath(sys.argv[0], os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
         *sys.argv[1:]])
    for figure, value in figures:
        print(f"{figure}: {value}", flush=True)
    path = os.environ.get(ENV)
    if path:
        with open(path, "a") as f:
            for figure, value in figures:
                f.write(json.dumps({"figure": figure, "value": value, "command": command}) + "\n")


def cpu_features() -> str:
    """The CPU's bfloat16 and int8 instructions, to print beside a speed figure (they flip
    which precision is fast)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.exists() else ""
    found = [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni")
             if f" {f}" in flags]
    return ", ".join(found) or "no AVX-512 BF16/VNNI"
