"""Shared test set-up: one TensorFlow process with 2 logical CPU devices per pytest
worker, and the whole-pipeline runs many tests read (trained once per session, whichever
xdist worker asks first: `helpers.shared_run`).

Logical devices can be configured once per process, so every in-process test uses 2
virtual CPUs; other layouts are tested through the CLI in a subprocess. Helpers the test
modules share are in `helpers.py`.
"""
import os
import subprocess
import sys
import tempfile

import pytest

# Under xdist (`-n auto`: one worker more than the CPUs, tests/conftest.py's
# pytest_xdist_auto_num_workers) each worker's TensorFlow, and every process a test
# starts, computes an op on one thread: with as many thread pools as workers on 2 cores,
# Eigen's threads spun waiting for each other. Measured on the fast tier (2 cores, 3
# workers): 208 s and 389 CPU-s with TensorFlow's default pools, 188 s and 350 CPU-s with
# one thread an op. A run under `-n0` keeps the defaults.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

import tftrain  # noqa: F401,E402  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from helpers import COMPRESS, QUICKSTART, ROOT, VIRTUAL_CPUS, cli, shared_run, summary_of
from tftrain.config import load_config

pytest_plugins = ["cputime"]        # TFTRAIN_TEST_CPU=<file>: each test's CPU-seconds


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return          # the xdist controller runs no test: no TensorFlow devices to set
    from tftrain.runtime.strategy import configure_devices
    configure_devices(load_config(None, [f"distribute.virtual_cpus={VIRTUAL_CPUS}"]))


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_basetemp(tmp_path_factory):
    """The temporary files of the tests and of the runs they start (a killed worker's
    scratch checkpoints, the fork server's socket) under pytest's base temporary
    directory, removed with it, instead of left in /tmp."""
    path = tmp_path_factory.mktemp("tmp", numbered=False)
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None            # read TMPDIR again
    # XLA decisions cached by the session's runs only, not by the user's earlier ones
    os.environ["TFTRAIN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache", numbered=False))


@pytest.fixture(autouse=True)
def _reset_precision():
    yield
    from tftrain.core.keras import keras
    keras.mixed_precision.set_global_policy("float32")


# --- whole-pipeline runs shared by the session -------------------------------------------
@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """`python -m tftrain.run configs/quickstart.yaml` as README runs it: (run path, what
    it printed as {"stdout", "stderr"})."""
    def build(out):
        proc = cli(QUICKSTART, "--run-dir", out, fresh=True)     # README's command, as typed
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {"stdout": proc.stdout, "stderr": proc.stderr}
    out, printed = shared_run(tmp_path_factory, "quickstart", build)
    return out / "quickstart", printed


@pytest.fixture(scope="session")
def compress_run(tmp_path_factory):
    """configs/compress.yaml (train -> prune -> PQAT -> int8 TFLite, int8 SavedModel and
    int8 ONNX), in a worker's process: (run path, summary)."""
    def build(out):
        from tftrain.run import run
        run(load_config(COMPRESS, [f"run.dir={out}", "train.verbose=0", "export.onnx=true"]))
    out, _ = shared_run(tmp_path_factory, "compress", build)
    return out / "compress", summary_of(out / "compress")


# --- data made here, once per session ----------------------------------------------------
@pytest.fixture(scope="session")
def spoken_digits(tmp_path_factory):
    """Spoken digits synthesized with espeak-ng (16 voices x 10 digits)."""
    def build(out):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_speech_digits.py"), "--out",
                        str(out / "digits"), "--voices", "16", "--takes", "1"], check=True,
                       capture_output=True)
    return shared_run(tmp_path_factory, "spoken-digits", build)[0] / "digits"


@pytest.fixture(scope="session")
def fortunes(tmp_path_factory):
    """Two categories of the fortunes package as a text folder."""
    def build(out):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_fortunes_text.py"), "--out",
                        str(out / "fortunes"), "--categories", "computers", "law"], check=True,
                       capture_output=True)
    return shared_run(tmp_path_factory, "fortunes", build)[0] / "fortunes"


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per CPU this process may use and one more, at most 4 (each
    holds a TensorFlow runtime and starts training processes of its own). Two workers on
    2 cores kept the CPUs 76% busy (2,035 CPU-s in 1,341 s): a worker is often waiting,
    on a process it started, a retry's back-off, a port or a poll; a third kept them 93%
    busy and the whole suite took 1,061 s instead (same tree, same machine)."""
    return max(1, min(len(os.sched_getaffinity(0)) + 1, 4))


# seconds each test took when last run here (setup, call and teardown), kept in pytest's
# cache (.pytest_cache) to order the next run
DURATIONS = "tftrain/durations"
_took: dict[str, float] = {}


def estimate(item, known: dict) -> float:
    """A test's expected seconds: as it took when last run here, else a feature-matrix
    row's (`test_matrix.seconds`: its cost times the fitted seconds of the base row; a
    refused row 0.3 s), else 60 s for a slow test and 1 s for another."""
    if item.nodeid in known:
        return known[item.nodeid]
    row = item.callspec.params.get("row") if hasattr(item, "callspec") else None
    if isinstance(row, dict):           # tests/e2e/test_matrix.py
        matrix = item.module
        return matrix.seconds(row) if matrix.runs(row) else 0.3
    return 60.0 if item.get_closest_marker("slow") else 1.0


def pytest_collection_modifyitems(config, items):
    """Slow tests first, longest first; then the rest in file order (their module
    fixtures built once per worker). With `--dist worksteal` (pyproject's addopts) the
    first worker starts on the slow tests, longest first, while the others run short
    in-process ones (handing tests out one by one, longest first, took 2,447 s against
    2,401 s with two workers), and a worker that runs out takes from the tail of
    another's queue: the run ends on short tests that even out the workers, not on one
    long run while the others idle."""
    cache = getattr(config, "cache", None)          # (None under -p no:cacheprovider)
    known = cache.get(DURATIONS, {}) if cache is not None else {}
    slow = sorted((item for item in items if item.get_closest_marker("slow")),
                  key=lambda item: -estimate(item, known))
    items[:] = slow + [item for item in items if not item.get_closest_marker("slow")]


def pytest_runtest_logreport(report):
    _took[report.nodeid] = _took.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput") or getattr(session.config, "cache", None) is None \
            or not _took:
        return                          # a worker, or nothing ran: the controller records
    known = session.config.cache.get(DURATIONS, {})
    session.config.cache.set(DURATIONS, {**known, **{k: round(v, 2) for k, v in _took.items()}})
