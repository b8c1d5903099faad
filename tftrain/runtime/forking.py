"""Worker processes forked from one that has imported TensorFlow already, for
`tftrain.launch` (its workers and tf.data service workers) and `tftrain.sweep` (its
trials).

A fresh `python -m tftrain.run` spends about 5 s of CPU importing TensorFlow, tf_keras
and tftrain before it reads its config: a launch of N workers pays it N times, a sweep
once per trial. `preload` imports them once in the parent, which runs no TensorFlow op;
each worker is then forked from it and runs its module as `python -m` would, configuring
its devices (logical CPUs, collectives) as a fresh process does, with the imported pages
shared with its siblings until written.

Only where no GPU is visible, from a process that has run no TensorFlow op: a CUDA
driver initialised before a fork cannot be used in the child (and TensorFlow gives no way
to know that importing it left the driver alone), and a started runtime's threads and
devices would be the child's. Otherwise (or with `start="fresh"`) workers are fresh
interpreters (`subprocess.Popen`).
"""
from __future__ import annotations

import importlib.util
import io
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback

from tftrain.core import exit_codes, internals

MODES = ("auto", "fork", "fresh")


def forks(mode: str, gpus: list) -> bool:
    """Whether workers are forked: `auto` forks where no GPU is visible and this process
    has run no TensorFlow op (its runtime, threads and devices would be the child's)."""
    if mode not in MODES:
        raise ValueError(f"worker start {mode!r}: use one of {', '.join(MODES)}")
    if mode == "fork" and (gpus or started()):
        raise ValueError("workers cannot be forked " + (
            "when they use GPUs (CUDA cannot be used in a child forked after it was loaded)"
            if gpus else "from a process that has run TensorFlow ops") +
            "; use --start fresh or auto")
    return mode == "fork" or (mode == "auto" and not gpus and not started())


def worker_setup(cpus) -> None:
    """In a worker (or a sweep's trial, a search's candidate) before it starts: pinned to `cpus` (if any), and
    sent SIGTERM if its parent dies (Linux), so it saves and stops instead of training on
    alone."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)             # PR_SET_PDEATHSIG


def local_gpus() -> list[str]:
    """The GPU ids this machine offers (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), read
    without starting TensorFlow, which would claim them in the launcher."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU ")]


def started() -> bool:
    """Whether TensorFlow's runtime has started in this process: an op ran, or its
    devices were listed (as configuring logical devices does; on a GPU machine that
    initialises CUDA)."""
    if "tensorflow" not in sys.modules:
        return False
    return internals.runtime_started()


def preload(module: str) -> None:
    """Import `module` (what the children run), what it imports, and the modules it names
    as imported when it runs (its `PRELOAD`, `tftrain.run`'s), running no op (so each
    child still configures its own devices). Call it before starting threads: a fork
    copies only the calling one."""
    from tftrain.core.native_log import quiet
    with quiet():           # TensorFlow's native start-up lines held back
        # TF_USE_LEGACY_KERAS set, then TensorFlow and tf_keras imported
        from tftrain.core.keras import keras  # noqa: F401
        for name in getattr(importlib.import_module(module), "PRELOAD", ()):
            importlib.import_module(name)


def start(module: str, args: list[str], *, fork: bool, env: dict | None = None,
          stdout=None, setup=None):
    """`python -m module *args` in a new session, with `env` (default: this process's
    environment), output to `stdout` (a file,
    or `subprocess.PIPE`: a text stream on the handle), stderr with it, stdin empty, and
    `setup()` run in the child before the module: a `subprocess.Popen`, or (`fork`) a
    `Forked` with the same `pid`, `stdout`, `returncode`, `poll`, `wait`, `send_signal`,
    `terminate` and `kill`."""
    env = dict(os.environ if env is None else env)
    if not fork:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env,
                                stdin=subprocess.DEVNULL, stdout=stdout,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=setup)
    return Forked(module, args, env, stdout, setup)


class Forked:
    """A child forked from this process that runs `module` as `__main__`."""

    def __init__(self, module: str, args: list[str], env: dict, stdout, setup):
        self.args, self.returncode, self.stdout = [module, *args], None, None
        read = None
        if stdout == subprocess.PIPE:
            read, target = os.pipe()
        else:
            target = stdout.fileno() if stdout is not None else 1
        sys.stdout.flush()                  # nothing buffered here is written twice
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:                   # the child: never returns
            _child(module, args, env, target, read, setup)
        if read is not None:
            os.close(target)
            self.stdout = open(read, encoding="utf-8", errors="replace")

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _child(module, args, env, target, read, setup) -> None:
    try:
        os.setsid()
        if setup is not None:
            setup()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(target, 1)
        os.dup2(target, 2)
        for fd in {null, target, read} - {None, 0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        # streams of our own (the parent's may hold a lock another of its threads took),
        # buffered as a fresh interpreter's on these files (PYTHONUNBUFFERED: not at all)
        raw = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if raw else -1, closefd=False),
                                      encoding="utf-8", write_through=raw)
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0 if raw else -1, closefd=False),
                                      encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True, write_through=raw)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)      # (the parent's may forward)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    except BaseException:                   # the set-up failed: no module to run
        traceback.print_exc()
        os._exit(exit_codes.RUNTIME)
    run_as_main(module, args)


def run_as_main(module: str, args: list[str]):
    """Run `module` as `__main__` with `args`, as `python -m` does, then end this (forked)
    process with its exit code, after its exit functions; never returns."""
    import atexit

    atexit._clear()      # the parent's exit functions (a launcher's, a test's) are not ours
    code = 1
    try:
        sys.argv = [importlib.util.find_spec(module).origin, *args]
        sys.modules.pop(module, None)       # as under `python -m`: the module runs once
        code = 0
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:                   # as Python reports an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
