"""The CPU's features and the machine's load as tftrain reads them."""
import subprocess
import sys
import time

from tftrain.core.cpu import busy_seconds, int8_instructions, others_cores


def test_int8_instructions_are_named_from_the_flags():
    assert int8_instructions("flags : fpu avx2 avx512_vnni avx512_bf16") == ["AVX-512 VNNI"]
    assert int8_instructions("flags : fpu avx2 avx_vnni amx_int8") == ["AVX-VNNI", "AMX-INT8"]
    assert int8_instructions("flags : fpu avx2") == []


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_own_work_is_not_counted_as_other_processes_load():
    """This process busy for 0.6 s: the machine's busy seconds grow by about that much and
    so do the process's own, so others kept (close to) no core busy."""
    before, began = busy_seconds(), time.perf_counter()
    _spin(0.6)
    after = busy_seconds()
    assert after[1] - before[1] >= 0.5
    assert others_cores(before, after, time.perf_counter() - began) < 0.4


def test_a_busy_child_process_is_other_processes_load():
    """A child spinning one core for the interval: about one core of others' load."""
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 1.5\n"
                              "while time.time() < t: pass"])
    time.sleep(0.3)                   # its interpreter started
    before, began = busy_seconds(), time.perf_counter()
    time.sleep(0.8)
    load = others_cores(before, busy_seconds(), time.perf_counter() - began)
    child.wait()
    assert 0.7 <= load <= 2.0, load


def test_missing_readings_give_no_load():
    assert others_cores(None, (1.0, 1.0), 1.0) is None
    assert others_cores((1.0, 1.0), (2.0, 1.0), 0.0) is None
    assert others_cores((1.0, 0.0), (3.0, 0.5), 1.0) == 1.5
