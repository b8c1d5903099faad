"""Helpers the test modules share (imported as `from helpers import ...`; fixtures live in
`conftest.py`).

`shared_run` builds a whole-pipeline run once per test session, however many pytest-xdist
workers read it: the first worker to ask trains it under a file lock, the others wait for
it and read the same directory.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
QUICKSTART = CONFIGS / "quickstart.yaml"
COMPRESS = CONFIGS / "compress.yaml"
VIRTUAL_CPUS = 2
# TFTRAIN_TEST_FRESH=1: every run a new interpreter, no fork server (to compare, or to
# rule the fork server out)
FRESH = os.environ.get("TFTRAIN_TEST_FRESH") == "1"


def sets(*overrides) -> list[str]:
    """`--set` arguments for each override."""
    return [a for s in overrides for a in ("--set", str(s))]


def cli(*args, cwd=None, timeout=600, env=None, fresh=False):
    """Run `python -m tftrain.run ...` in a process of its own (`start_run`) and wait for it."""
    proc = start_run(*args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                     fresh=fresh)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_run(*args, cwd=ROOT, env=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              fresh=False, module="tftrain.run", session=False):
    """Start `python -m MODULE ...` (`tftrain.run`, or `tftrain.launch`, `tftrain.sweep`)
    and return its `Popen`-like handle: forked from a process that has imported
    TensorFlow already (`forkserver.py`), or with `fresh=True` (or TFTRAIN_TEST_FRESH=1) a
    new interpreter, for what happens before TensorFlow is imported. `session`: in a
    session of its own (a process group to signal)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)} if env is None else env
    if fresh or FRESH:
        return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=cwd,
                                env=env, stdout=stdout, stderr=stderr, text=True,
                                start_new_session=session)
    from forkserver import ForkedRun
    return ForkedRun([str(a) for a in args], cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                     module=module, session=session)


def saved_model_cli(*args, timeout=300):
    """TensorFlow's `saved_model_cli` in a fresh process of this interpreter (whatever
    venv the tests run in)."""
    tool = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
    return subprocess.run(tool + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def saved_model_cli_show_and_run(path, x, tmp_path) -> None:
    """`saved_model_cli show --all` and `run` on a SavedModel in a fresh process: the
    signature `serving_default` takes `inputs` and gives `logits`, and the logits the
    command writes for `x` are the ones the SavedModel loaded here computes."""
    import numpy as np
    import tensorflow as tf

    show = saved_model_cli("show", "--all", "--dir", path)
    assert show.returncode == 0, show.stderr[-2000:]
    signature = show.stdout[show.stdout.index("signature_def['serving_default']"):]
    assert "inputs['inputs']" in signature and "outputs['logits']" in signature, show.stdout
    np.save(tmp_path / "x.npy", x)
    ran = saved_model_cli("run", "--dir", path, "--tag_set", "serve", "--signature_def",
                          "serving_default", "--inputs", f"inputs={tmp_path / 'x.npy'}",
                          "--outdir", str(tmp_path / "cli"))
    assert ran.returncode == 0, ran.stderr[-2000:]
    expected = tf.saved_model.load(str(path)).signatures["serving_default"](
        inputs=tf.constant(x))["logits"].numpy()
    np.testing.assert_allclose(np.load(tmp_path / "cli" / "logits.npy"), expected,
                               rtol=1e-5, atol=1e-6)


def quick_config(tmp_path, *overrides):
    """The quickstart config in a temporary run dir, with overrides."""
    from tftrain.config import load_config
    return load_config(QUICKSTART, [f"run.dir={tmp_path}", "train.verbose=0",
                                    "train.jit_compile=false",
                                    # what preflight refuses is test_preflight.py's and
                                    # test_matrix.py's; the other runs export what it checks
                                    "export.preflight=false", *overrides])


def model_weights(run_path, stage="train"):
    """Model variables (and weight averages) of the newest checkpoint of a run's stage,
    by name."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(Path(run_path) / "checkpoints" /
                                          ("" if stage == "train" else stage)))
    names = [n for n in reader.get_variable_to_shape_map()
             if n.startswith(("model/", "average/")) and n.endswith("VARIABLE_VALUE")
             and "OPTIMIZER" not in n]
    return {n: reader.get_tensor(n) for n in names}


def resumed_at(printed: str) -> int:
    """The update a run said it resumed from ("resuming from ... at update N/M")."""
    return int(printed.split("resuming from")[1].split("at update ")[1].split("/")[0])


def wait_for_checkpoint(path, proc, at_least=20, timeout=240):
    """Poll until a checkpoint numbered >= `at_least` is saved in `path` (listed in the
    directory's `checkpoint` state file, written once the save is complete); its number."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            state = (Path(path) / "checkpoint").read_text()
        except OSError:
            state = ""
        numbers = [int(n) for n in re.findall(r'all_model_checkpoint_paths: "ckpt-(\d+)"', state)]
        if numbers and max(numbers) >= at_least:
            return max(numbers)
        assert proc.poll() is None, "".join(o or "" for o in proc.communicate())[-3000:]
        time.sleep(0.05)
    raise AssertionError("no checkpoint written in time")


def tiny():
    """A one-layer regression model, compiled (for callback tests)."""
    from tftrain.core.keras import keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def fit(model, callbacks, epochs=2, steps=5, start=0):
    """`model.fit` on constant data for `epochs` x `steps`, resumed at update `start`."""
    import numpy as np
    import tensorflow as tf
    from tftrain.training.callbacks import ResumePoint
    x, y = np.ones((10, 3), np.float32), np.zeros((10, 2), np.float32)
    model._training_state = ResumePoint(start)
    history = model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(), epochs=epochs,
                        steps_per_epoch=steps, callbacks=callbacks, verbose=0)
    model._training_state = None
    return history


def summary_of(run_path) -> dict:
    return json.loads((Path(run_path) / "summary.json").read_text())


# --- runs shared by the whole session, across xdist workers --------------------------
def session_root(tmp_path_factory) -> Path:
    """A directory every worker of this test session sees (pytest-xdist gives each worker
    its own base temp directory inside one shared parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_run(tmp_path_factory, name: str, build):
    """`build(directory)` once per session, whichever worker asks first; every caller gets
    (directory, what build returned, JSON-serialisable). A failed build fails every test
    that reads it, with the first failure's traceback, instead of training again."""
    root = session_root(tmp_path_factory) / "shared"
    root.mkdir(exist_ok=True)
    directory, record = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes
        try:
            if not record.exists():
                directory.mkdir(exist_ok=True)
                try:
                    result = {"ok": True, "value": build(directory)}
                except Exception:
                    result = {"ok": False, "value": traceback.format_exc()}
                record.write_text(json.dumps(result))
            result = json.loads(record.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if not result["ok"]:
        raise AssertionError(f"shared run {name!r} failed:\n{result['value']}")
    return directory, result["value"]


# --- an MLflow tracking server, for tests of tracking over HTTP -------------------------
SERVE_MLFLOW = """
import os, sys
os.environ["_MLFLOW_SERVER_FILE_STORE"] = sys.argv[2]          # what `mlflow server` sets
os.environ["_MLFLOW_SERVER_ARTIFACT_ROOT"] = sys.argv[3]
os.environ["_MLFLOW_SERVER_SERVE_ARTIFACTS"] = "true"
from mlflow.server import app
app.run(host="127.0.0.1", port=int(sys.argv[1]))
"""


class MlflowServer:
    """MLflow's tracking server (its Flask app) on a localhost port, backed by a sqlite
    store in `root`: `with MlflowServer(port, root):` ... (the test extras install flask)."""

    def __init__(self, port: int, root: Path):
        self.port, self.root = port, Path(root)

    def __enter__(self):
        import socket
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE_MLFLOW, str(self.port), f"sqlite:///{self.root}/mlflow.db",
             str(self.root / "artifacts")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, "the MLflow server did not start"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            except OSError:
                time.sleep(0.2)
                continue
            return self._ready(f"http://127.0.0.1:{self.port}")
        raise AssertionError("the MLflow server did not listen in time")

    @staticmethod
    def _ready(uri: str) -> str:
        """The server creates its store (sqlite schema migrations, seconds on a loaded
        machine) on the first request: made here with a long timeout, so the run's own
        calls (10 s each) meet a ready server."""
        import urllib.error
        import urllib.request
        try:
            urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/get-by-name?"
                                   "experiment_name=Default", timeout=180).close()
        except urllib.error.HTTPError:
            pass                         # an answer, even "not found": the store is up
        return uri

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def digit_tfrecords(directory, sizes) -> None:
    """The digits (scaled to [0, 1]) written in order as TFRecord files
    `part-<i>.tfrecord` of `sizes[i]` examples (features `x`: 64 floats, `y`: the label)."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    at = 0
    for i, n in enumerate(sizes):
        with tf.io.TFRecordWriter(str(Path(directory) / f"part-{i}.tfrecord")) as w:
            for x, y in zip(digits.images[at:at + n] / 16.0, digits.target[at:at + n]):
                w.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=list(np.ravel(x)))),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y)]))}))
                    .SerializeToString())
        at += n


def unwrapped(text: str) -> list[str]:
    """What a run printed, as its lines before `console.say` wrapped them at 120 columns
    (a wrapped line goes on in lines indented by four spaces)."""
    lines: list[str] = []
    for line in text.splitlines():
        if lines and line.startswith("    ") and not line.startswith("     ") and line.strip():
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    return lines


# --- report.html in a real browser (Debian's chromium, headless) ------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=8000"]


def render(page, tmp_path, height=9000):
    """(the DOM after the page's scripts ran, the screenshot as an RGB image)."""
    import pytest
    from PIL import Image

    if CHROMIUM is None:
        pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
    profile = tmp_path / "chromium-profile"
    common = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}"]
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True,
                         text=True, timeout=180).stdout
    shot = tmp_path / "page.png"
    subprocess.run([*common, f"--screenshot={shot}", f"--window-size=1200,{height}",
                    page.as_uri()], capture_output=True, timeout=180, check=True)
    return dom, Image.open(shot).convert("RGB")


def charts_drawn(dom: str) -> dict[str, int]:
    """Each chart div's id and how many traces Plotly drew in it (scatter lines and
    markers, bars, heatmap images)."""
    found = {}
    for match in re.finditer(r'<div id="(chart-\d+)"', dom):
        end = dom.find('<div id="chart-', match.end())
        part = dom[match.start():end if end > 0 else len(dom)]
        found[match.group(1)] = len(re.findall(r'class="(trace scatter|trace bars|hm|point)', part))
    return found


def blue_pixels(image) -> int:
    """Pixels of Plotly's first trace colour (#1f77b4) and its neighbours."""
    return sum(1 for r, g, b in image.getdata()
               if abs(r - 31) < 30 and abs(g - 119) < 30 and abs(b - 180) < 30)
