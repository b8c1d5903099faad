"""CPU-seconds each test costs, whatever else runs on the machine: with
`TFTRAIN_TEST_CPU=<file>` set, each test's user + system time (setup, call, teardown) is
appended to the file as a JSON line {"test", "cpu", "wall"}: the pytest worker's own time,
the processes it started and waited for, and the runs its fork server forked and reaped
(`tests/forkserver.py`; read from /proc, the server's own and its children's ticks).
Wall-clock durations move with the load (3 workers on 2 cores, a benchmark beside them);
CPU-seconds much less, so they say where the suite's time goes. Summed, they bound the
suite's wall time from below: CPU-s / cores.
"""
from __future__ import annotations

import json
import os
import time

import pytest

TICKS = os.sysconf("SC_CLK_TCK")


def _server_seconds() -> float:
    """The fork server's CPU-seconds and its reaped children's, 0 before it starts."""
    import forkserver
    proc = forkserver._server.get("proc") if forkserver._server.get("pid") == os.getpid() else None
    if proc is None:
        return 0.0
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / TICKS     # utime stime cutime cstime


def _seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _server_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("TFTRAIN_TEST_CPU")
    if not path:
        yield
        return
    cpu, wall = _seconds(), time.perf_counter()
    yield
    record = {"test": item.nodeid, "cpu": round(_seconds() - cpu, 2),
              "wall": round(time.perf_counter() - wall, 2)}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
