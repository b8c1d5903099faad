"""`python -m tftrain.run ...` processes started by forking a process that has imported
TensorFlow already, for the tests (`helpers.cli`, `helpers.start_run`).

Every fresh process pays 7-9 s importing TensorFlow before tftrain reads its config; the
tests start dozens. A server process per pytest worker imports tftrain, TensorFlow,
tf_keras and what a run imports once (`forking.preload`: tfmot alone is about 1 s of a
run's CPU), runs no op (so each child configures its own devices, as a fresh process
does) and forks a child per run: the child takes the caller's stdin, stdout and stderr
(passed over a Unix socket), working directory, environment and arguments, and runs
`tftrain.run` as `__main__`, as `python -m` does. The caller gets a `Popen`-like handle
whose `pid` is the child's: signals go straight to the run, and its exit status (a
negative number for a signal, as `subprocess` reports it) comes back from the server,
the child's parent. What needs a fresh interpreter (what happens before tftrain's first
import, environment read when TensorFlow is imported) starts one with
`subprocess` instead.
"""
from __future__ import annotations

import array
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tftrain.runtime.forking import Forked

ROOT = Path(__file__).resolve().parents[1]

SERVER = r"""
import array, json, os, selectors, signal, socket, sys
import tftrain                                   # sets TF_USE_LEGACY_KERAS first
from tftrain.runtime.forking import preload, run_as_main
preload("tftrain.run")                           # TensorFlow, tf_keras, what a run imports
from tensorflow.python.eager import context
assert context.context()._context_handle is None, "an op ran before forking"

path = sys.argv[1]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(64)
print("ready", flush=True)
waiting = {}                                     # child pid -> the caller's connection


def child(conn, request, fds):
    listener.close()
    conn.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    run_as_main(request["module"], request["args"])   # as `python -m`; never returns


def serve(conn):
    data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * array.array("i").itemsize))
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    request = json.loads(data.decode())
    pid = os.fork()
    if pid == 0:
        child(conn, request, list(fds))
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    waiting[pid] = conn


def reap():
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{code}\n".encode())
            except OSError:
                pass
            conn.close()


selector = selectors.DefaultSelector()
selector.register(listener, selectors.EVENT_READ)
while True:
    for _ in selector.select(timeout=0.02):
        conn, _ = listener.accept()
        serve(conn)
    reap()
    if os.getppid() == 1:                        # the pytest worker is gone
        break
"""

_server: dict = {}
_lock = threading.Lock()


def _address() -> str:
    """The server's socket, started on first use in this process."""
    with _lock:
        if _server.get("pid") == os.getpid():
            return _server["path"]
        directory = tempfile.mkdtemp(prefix="tftrain-fork-")
        atexit.register(shutil.rmtree, directory, True)      # runs after the kill below
        path = os.path.join(directory, "socket")
        proc = subprocess.Popen([sys.executable, "-c", SERVER, path], cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the fork server did not start (exit {proc.wait()})")
        atexit.register(proc.kill)
        _server.update(pid=os.getpid(), path=path, proc=proc)
        return path


class ForkedRun(Forked):
    """A child of the fork server running `module` (`tftrain.run`, `tftrain.launch`,
    `tftrain.sweep`) as `python -m` does, in a session of its own with `session`, with the parts of `subprocess.Popen`
    the tests use: `pid`, `returncode`, `stdout`/`stderr` (text, when piped), `poll`,
    `wait`, `communicate`, `send_signal`, `kill`, `terminate`."""

    def __init__(self, args, cwd=None, env=None, stdout=None, stderr=None,
                 module="tftrain.run", session=False):
        self.args, self.returncode = [str(a) for a in args], None
        self.stdout = self.stderr = None
        ends, mine = [], []

        def target(kind, which):
            if kind == subprocess.PIPE:
                read, write = os.pipe()
                mine.append((which, read))
                ends.append(write)
                return write, True
            if kind == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                ends.append(fd)
                return fd, True
            if kind is None:
                return which, False
            return kind.fileno() if hasattr(kind, "fileno") else kind, False
        stdin = os.open(os.devnull, os.O_RDONLY)
        ends.append(stdin)
        out, _ = target(stdout, 1)
        err = out if stderr == subprocess.STDOUT else target(stderr, 2)[0]
        request = {"args": self.args, "module": module, "session": session,
                   "cwd": str(cwd or os.getcwd()),
                   "env": dict(os.environ if env is None else env)}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_address())
        self._conn.sendmsg([json.dumps(request).encode()],
                           [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [stdin, out, err]))])
        for fd in ends:
            os.close(fd)
        for which, fd in mine:
            setattr(self, "stdout" if which == 1 else "stderr", open(fd, encoding="utf-8",
                                                                    errors="replace"))
        self._buffer = b""
        self.pid = int(self._line(block=True))

    def _line(self, block: bool) -> str:
        """The server's next line about this child ("" if none has come yet)."""
        self._conn.setblocking(block)
        try:
            while b"\n" not in self._buffer:
                try:
                    chunk = self._conn.recv(64)
                except BlockingIOError:
                    return ""
                if not chunk:
                    raise RuntimeError("the fork server closed the connection")
                self._buffer += chunk
        finally:
            self._conn.setblocking(True)
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self):
        if self.returncode is None:
            line = self._line(block=False)
            if line:
                self.returncode = int(line)
                self._conn.close()
        return self.returncode

    def communicate(self, timeout=None):
        outputs = {}

        def drain(name, stream):
            # the caller may close the stream after a timeout while this still reads
            try:
                outputs[name] = stream.read()
                stream.close()
            except ValueError:
                outputs[name] = None
        readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
                   for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
                   if stream is not None]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return outputs.get("stdout"), outputs.get("stderr")
