"""The CPU's features and the machine's load as tftrain reads them."""
import os
import subprocess
import sys
import time

import pytest

from tftrain.core.cpu import busy_seconds, int8_instructions, others_cores


def test_int8_instructions_are_named_from_the_flags():
    assert int8_instructions("flags : fpu avx2 avx512_vnni avx512_bf16") == ["AVX-512 VNNI"]
    assert int8_instructions("flags : fpu avx2 avx_vnni amx_int8") == ["AVX-VNNI", "AMX-INT8"]
    assert int8_instructions("flags : fpu avx2") == []


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _cpu_seconds(pid) -> float:
    """A process's user and system CPU seconds, from /proc/PID/stat."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_machines_busy_seconds_include_this_process_own():
    """This process busy until it has spent 0.5 CPU seconds (however long a busy machine
    makes that): its own CPU seconds grow by that much, and the machine's at least as
    much (other processes, the suite's other workers, only add); what is left over is
    other processes' load (never below zero)."""
    before, began = busy_seconds(), time.perf_counter()
    start = os.times()
    while (lambda t: t.user + t.system)(os.times()) - start.user - start.system < 0.5:
        _spin(0.01)
    after = busy_seconds()
    own = after[1] - before[1]
    assert 0.5 <= own <= 0.7, own
    assert after[0] - before[0] >= own - 0.05
    assert others_cores(before, after, time.perf_counter() - began) >= 0.0


def test_a_busy_child_process_is_counted_as_other_processes_load():
    """A child spinning on a core: the load put on other processes is at least the CPU
    seconds the child spent in the interval (read from /proc), whatever else the machine
    runs."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 3\n"
                              "while time.time() < t: pass"])
    time.sleep(0.5)                   # its interpreter started
    before, spent, began = busy_seconds(), _cpu_seconds(child.pid), time.perf_counter()
    time.sleep(1.0)
    after, spent = busy_seconds(), _cpu_seconds(child.pid) - spent
    wall = time.perf_counter() - began
    child.wait()
    assert spent >= 0.2, spent                  # it ran
    assert others_cores(before, after, wall) * wall >= spent - 0.05


def test_missing_readings_give_no_load():
    assert others_cores(None, (1.0, 1.0), 1.0) is None
    assert others_cores((1.0, 1.0), (2.0, 1.0), 0.0) is None
    assert others_cores((1.0, 0.0), (3.0, 0.5), 1.0) == 1.5


def test_the_theoretical_peak_is_cores_clock_and_the_widest_vectors_fmas():
    """Two fused multiply-adds a cycle of the widest vectors the flags name: AVX-512 64
    float32 FLOPs a cycle, AVX2 with FMA 32; bfloat16 twice with AVX-512 BF16; the
    highest clock /proc/cpuinfo lists; nothing without a known vector unit."""
    from tftrain.core.cpu import theoretical_peak
    zen4 = "flags : fpu sse2 avx fma avx512f avx512_bf16\ncpu MHz : 2596.152\ncpu MHz : 2400.0\n"
    assert theoretical_peak("float32", zen4, cores=2) == pytest.approx(2 * 2596.152e6 * 64)
    assert theoretical_peak("bfloat16", zen4, cores=2) == pytest.approx(2 * 2596.152e6 * 128)
    assert theoretical_peak("float32", "flags : sse2 avx fma\ncpu MHz : 3000\n", cores=4) == 4 * 3e9 * 32
    assert theoretical_peak("float16", "flags : sse2 avx fma\ncpu MHz : 3000\n", cores=1) == 3e9 * 32
    assert theoretical_peak("float32", "flags : neon\n", cores=2) is None
