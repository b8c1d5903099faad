"""Shared test set-up: one TensorFlow process with 2 logical CPU devices.

Logical devices can be configured once per process, so every in-process test uses 2
virtual CPUs; other layouts are tested through the CLI in a subprocess.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tftrain  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
from tftrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]
VIRTUAL_CPUS = 2


def pytest_configure(config):
    from tftrain.strategy import configure_devices
    configure_devices(load_config(None, [f"distribute.virtual_cpus={VIRTUAL_CPUS}"]))


@pytest.fixture(autouse=True)
def _reset_precision():
    yield
    from tftrain._keras import keras
    keras.mixed_precision.set_global_policy("float32")


def cli(*args, cwd=None, timeout=600, env=None):
    """Run `python -m tftrain.run ...` in a fresh process."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "tftrain.run", *map(str, args)], cwd=cwd,
                          env=full_env, capture_output=True, text=True, timeout=timeout)


def saved_model_cli_show_and_run(path, x, tmp_path) -> None:
    """`saved_model_cli show --all` and `run` on a SavedModel in a fresh process: both
    succeed, the signature is `serving_default` and it returns `logits` for `x`."""
    import numpy as np

    tool = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]
    show = subprocess.run(tool + ["show", "--all", "--dir", str(path)], capture_output=True, text=True)
    assert show.returncode == 0 and "serving_default" in show.stdout and "logits" in show.stdout
    np.save(tmp_path / "x.npy", x)
    ran = subprocess.run(tool + ["run", "--dir", str(path), "--tag_set", "serve", "--signature_def",
                                 "serving_default", "--inputs", f"inputs={tmp_path / 'x.npy'}"],
                         capture_output=True, text=True)
    assert ran.returncode == 0 and "logits" in ran.stdout, ran.stderr[-2000:]


def quick_config(tmp_path, *overrides):
    """The quickstart config in a temporary run dir, with overrides."""
    return load_config(ROOT / "configs" / "quickstart.yaml",
                       [f"run.dir={tmp_path}", "train.verbose=0", "train.jit_compile=false",
                        *overrides])


def model_weights(run_path, stage="train"):
    """Model variables (and weight averages) of the newest checkpoint of a run's stage,
    by name."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(run_path / "checkpoints" / ("" if stage == "train" else stage)))
    names = [n for n in reader.get_variable_to_shape_map()
             if n.startswith(("model/", "average/")) and n.endswith("VARIABLE_VALUE")
             and "OPTIMIZER" not in n]
    return {n: reader.get_tensor(n) for n in names}


def wait_for_checkpoint(path, proc, at_least=20, timeout=240):
    """Poll until a checkpoint numbered >= `at_least` is saved in `path` (listed in the
    directory's `checkpoint` state file, written once the save is complete); its number."""
    import re
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            state = (path / "checkpoint").read_text()
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
    from tftrain._keras import keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def fit(model, callbacks, epochs=2, steps=5, start=0):
    """`model.fit` on constant data for `epochs` x `steps`, resumed at update `start`."""
    import numpy as np
    import tensorflow as tf
    from tftrain.callbacks import ResumePoint
    x, y = np.ones((10, 3), np.float32), np.zeros((10, 2), np.float32)
    model._training_state = ResumePoint(start)
    history = model.fit(tf.data.Dataset.from_tensors((x, y)).repeat(), epochs=epochs,
                        steps_per_epoch=steps, callbacks=callbacks, verbose=0)
    model._training_state = None
    return history
