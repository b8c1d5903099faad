"""Worker processes forked from a process that imported TensorFlow (`runtime.forking`):
when they are forked, and that a forked worker runs its module as `python -m` does."""
import json
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT
from tftrain.runtime import forking

# run in a fresh interpreter: the pytest worker has run TensorFlow ops, so it never forks
DRIVER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    from tftrain.runtime import forking
    fork = sys.argv[1] == "fork"
    setup_mark = sys.argv[2]
    env = {**os.environ, "PROBE": "from the caller"}
    import atexit        # the launcher's own exit functions are not its workers'
    atexit.register(lambda: open(f"{setup_mark}.exit-{os.getpid()}", "w").close())
    def setup():
        open(setup_mark, "w").write(str(os.getpid()))
    results = {}
    proc = forking.start("probe", ["3", "b c"], fork=fork, env=env, stdout=subprocess.PIPE,
                         setup=setup)
    results["output"] = proc.stdout.read()
    results["code"] = proc.wait(timeout=60)
    results["setup_pid"] = int(open(setup_mark).read())
    results["pid"] = proc.pid
    sleeper = forking.start("probe", ["sleep"], fork=fork, env=env, stdout=subprocess.PIPE)
    assert sleeper.stdout.readline().startswith("sleeping")
    sleeper.terminate()
    results["terminated"] = sleeper.wait(timeout=60)
    results["forked"] = type(proc).__name__
    results["driver_pid"] = os.getpid()
    print(json.dumps(results))
""")

PROBE = textwrap.dedent("""
    import os, sys, time
    if sys.argv[1:] == ["sleep"]:
        print("sleeping", flush=True)
        time.sleep(60)
    print("main:", __name__, sys.argv[1:], os.environ["PROBE"])
    print("stdin:", repr(sys.stdin.read()), "session leader:", os.getsid(0) == os.getpid())
    print("to stderr", file=sys.stderr)
    import atexit
    atexit.register(lambda: print("the module's exit function ran", flush=True))
    raise SystemExit(int(sys.argv[1]))
""")


@pytest.mark.parametrize("how", ["fork", "fresh"])
def test_a_worker_runs_its_module_as_python_m_does(how, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    proc = subprocess.run([sys.executable, "-c", DRIVER, how, str(tmp_path / "setup")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["forked"] == ("Forked" if how == "fork" else "Popen")
    assert got["code"] == 3 and got["terminated"] == -15
    assert got["setup_pid"] == got["pid"]                 # set-up ran in the child
    lines = got["output"].splitlines()
    assert "main: __main__ ['3', 'b c'] from the caller" in lines
    assert "stdin: '' session leader: True" in lines and "to stderr" in lines
    assert "the module's exit function ran" in lines
    # the caller's exit function ran once, in the caller, not in its forked worker
    assert sorted(p.name for p in tmp_path.glob("setup.exit-*")) == [f"setup.exit-{proc_pid(got)}"]


def proc_pid(results) -> int:
    """The driver's own pid (the parent of the worker whose set-up reported `setup_pid`)."""
    return results["driver_pid"]


def test_workers_are_forked_only_without_gpus_and_before_any_op():
    import tensorflow as tf

    assert forking.forks("fresh", []) is False
    tf.constant(1.0) + 1             # (this pytest worker's runtime would be the child's)
    assert forking.started()
    assert forking.forks("auto", []) is False
    with pytest.raises(ValueError, match="from a process that has run TensorFlow ops"):
        forking.forks("fork", [])
    with pytest.raises(ValueError, match="when they use GPUs"):
        forking.forks("fork", ["0"])
    with pytest.raises(ValueError, match="use one of auto, fork, fresh"):
        forking.forks("spawn", [])


def test_a_fresh_interpreter_forks_until_an_op_runs():
    code = ("from tftrain.runtime import forking\n"
            "print(forking.forks('auto', []), forking.forks('auto', ['0']))\n"
            "forking.preload('tftrain.run')\n"
            "print(forking.forks('auto', []), forking.started())\n"
            "import sys, tftrain.run\n"
            "print(all(m in sys.modules for m in tftrain.run.PRELOAD),"
            " 'tensorflow_model_optimization' in sys.modules)\n"
            "import tensorflow as tf; tf.config.list_physical_devices('GPU')\n"
            "print(forking.forks('auto', []), forking.started())\n"
            "tf.constant(1.0) + 1\n"
            "print(forking.forks('auto', []), forking.started())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # devices listed (as configuring logical CPUs does), then an op run: no fork after either
    # what a run imports (tfmot among them) loaded before forking, no op run by it
    assert proc.stdout.split("\n")[:5] == ["True False", "True False", "True True",
                                           "False True", "False True"]
