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

import pytest

import tftrain  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from helpers import COMPRESS, QUICKSTART, ROOT, VIRTUAL_CPUS, cli, shared_run, summary_of
from tftrain.config import load_config


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return          # the xdist controller runs no test: no TensorFlow devices to set
    from tftrain.strategy import configure_devices
    configure_devices(load_config(None, [f"distribute.virtual_cpus={VIRTUAL_CPUS}"]))


@pytest.fixture(autouse=True)
def _reset_precision():
    yield
    from tftrain._keras import keras
    keras.mixed_precision.set_global_policy("float32")


# --- whole-pipeline runs shared by the session -------------------------------------------
@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """`python -m tftrain.run configs/quickstart.yaml` as README runs it: (run path, what
    it printed as {"stdout", "stderr"})."""
    def build(out):
        proc = cli(QUICKSTART, "--run-dir", out)
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
    """`-n auto`: a worker per CPU this process may use, at most 4 (each holds a TensorFlow
    runtime and starts training processes of its own)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_collection_modifyitems(config, items):
    """Slow tests first (in file order), then the rest: a parallel run then ends on many
    short tests that even out the workers, not on one long run while the others idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
