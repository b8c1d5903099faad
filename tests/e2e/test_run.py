"""The CLI end to end: exit codes, run directory contract, resume after a kill."""
import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from helpers import (COMPRESS, QUICKSTART, ROOT, cli, model_weights, quick_config, resumed_at,
                     saved_model_cli_show_and_run, shared_run, start_run,
                     unwrapped, wait_for_checkpoint)
from tftrain.run import main, run



# --- bad input: exit 2, one line naming the key, no run directory -------------------------
BAD_SETS = [
    (["train.acumulation_steps=2"], r"train\.acumulation_steps: unknown key; did you mean accumulation_steps\?"),
    (["train.epochs=abc"], r"train\.epochs: "),
    (["data.validation_fraction=2"], r"data\.validation_fraction: "),
    (["model.name=resnett"], r"model\.name: unknown model 'resnett'.*did you mean 'resnet'\?"),
    (["data.name=digit"], r"data\.name: unknown dataset 'digit'.*did you mean 'digits'\?"),
    (["train.optimizer.name=adamm"], r"train\.optimizer\.name: unknown optimizer 'adamm'"),
    (["train.schedule.name=cosin"], r"train\.schedule\.name: unknown schedule 'cosin'"),
    (["train.loss=hinge_x"], r"train\.loss: unknown loss"),
    (["train.metrics=[acc_x]"], r"train\.metrics: unknown metric 'acc_x'"),
    (["model.params.filterz=[8]"], r"model\.params\.filterz: unknown parameter of cnn in tftrain/models/cnn\.py; did you mean filters\?"),
    (["model.params.filters=abc"], r"model\.params\.filters: 'abc' is not a list of ints \(cnn in tftrain/models/cnn\.py defaults it to \(32, 64\)\)"),
    (["data.name=npz", "data.params.path=/no/such/file.npz"], r"data\.params\.path: /no/such/file\.npz does not exist"),
    (["distribute.devices=['/cpu:0', '/cpu:7']"], r"distribute\.devices: /cpu:7 does not exist"),
    (["train.global_batch_size=100", "train.accumulation_steps=3"], r"train\.global_batch_size: 100 is not divisible"),
    (["data.per_replica_batch_size=2000"], r"data\.per_replica_batch_size: global batch 4000"),
    (["train.optimizer.params.momentun=0.9", "train.optimizer.name=sgd"], r"train\.optimizer\.params\.momentun: unknown parameter; did you mean momentum\?"),
    (["model.params.pool=median"], r"model\.params: cnn rejected"),
    (["train.optimizer.learning_rate=.inf"], r"train\.optimizer\.learning_rate: .*finite number"),
    (["data.validation_fraction=0"], r"data\.validation_fraction: 0\.0 leaves no validation examples"),
    (["train.schedule={name: multistep, milestones: ['2 epochs', 5]}"], r"train\.schedule\.milestones: they fall at updates \[\d+, 5\], which must be increasing"),
    (["train.early_stopping={monitor: val_acuracy}"], r"train\.early_stopping\.monitor: 'val_acuracy' is not a logged metric"),
    (["compression.quantization.enabled=true", "export.tflite=float16"], r"export\.tflite: a quantization-aware trained model exports as int8"),
    (["compression.pruning={enabled: true, layers: [conv_0, nope]}"], r"compression\.pruning\.layers\[1\]: rule 'nope' matches no layer"),
    (["compression.pruning={enabled: true, epochs: 1, end: 50}"], r"compression\.pruning\.end: update 50 is after the last update"),
    (["model.placement={devices: ['/cpu:0', '/cpu:1']}"], r"distribute\.strategy: model\.placement places one model copy .* 'mirrored'; set distribute\.strategy: auto"),
    (["distribute.strategy=auto", "model.placement={devices: ['/cpu:0', '/cpu:5']}"], r"model\.placement\.devices: /cpu:5 does not exist"),
    (["distribute.strategy=auto", "model.placement={devices: ['/cpu:0', '/cpu:1'], microbatches: 5}"], r"model\.placement\.microbatches: 5 does not divide the batch of 32"),
    (["distribute.strategy=auto", "model.placement={devices: ['/cpu:0', '/cpu:1'], stages: [[conv_0], [nope]]}"], r"model\.placement\.stages\[1\]\[0\]: rule 'nope' matches no layer"),
]


@pytest.mark.parametrize("sets,pattern", BAD_SETS, ids=[s[0][0].split("=")[0] for s in BAD_SETS])
def test_bad_input_exits_2_naming_the_key(tmp_path, capsys, sets, pattern):
    args = [str(QUICKSTART), "--run-dir", str(tmp_path)] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(pattern, err), err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []          # no run directory left behind


def _bad_data(root):
    """Data files with one problem each, for the bad-data cases."""
    import tensorflow as tf
    rng = np.random.default_rng(0)
    x = rng.random((60, 8, 8, 1)).astype(np.float32)
    np.savez(root / "ok.npz", x=x, y=np.arange(60) % 10, short=np.arange(59) % 10,
             big=np.arange(60) % 10 + 5)
    np.save(root / "arr.npy", x)
    for label in ("a", "b"):
        (root / "imgs" / label).mkdir(parents=True)
        for i in range(3):
            tf.io.write_file(str(root / "imgs" / label / f"{i}.png"),
                             tf.io.encode_png(np.zeros((8, 8, 1), np.uint8)))
    (root / "imgs" / "b" / "3.png").write_bytes(b"garbage, not a png")


BAD_DATA = [
    (["data.params.x_key=nope"], r"data\.params: key 'nope' not in .*ok\.npz \(it has x, y, short, big\)"),
    (["data.params.y_key=short"], r"ok\.npz: x has 60 examples but y has 59"),
    (["data.params.y_key=big", "data.params.num_classes=10"], r"ok\.npz: label 1[0-4] is outside \[0, 10\)"),
    (["data.params.path={root}/arr.npy"], r"arr\.npy holds a single array \(\.npy\), not a \.npz"),
    (["data.per_replica_batch_size=64"], r"data\.per_replica_batch_size: global batch 128 .* exceeds the 51 training examples"),
    (["data={name: image_folder, params: {path: {root}/imgs}}"], r"data: .*imgs/b/3\.png is not a PNG/JPEG/BMP/GIF image; remove it or set data\.on_bad_record: skip"),
]


@pytest.mark.parametrize("sets,pattern", BAD_DATA, ids=[s[0][0] for s in BAD_DATA])
def test_bad_data_exits_2_naming_the_culprit(tmp_path, capsys, sets, pattern):
    root = tmp_path / "data"
    root.mkdir()
    _bad_data(root)
    base = ["data.name=npz", f"data.params={{path: {root}/ok.npz}}"]
    sets = [s.replace("{root}", str(root)) for s in sets]
    runs = tmp_path / "runs"
    args = [str(QUICKSTART), "--run-dir", str(runs)] + [a for s in base + sets for a in ("--set", s)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(pattern, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not runs.exists()


@pytest.mark.parametrize("text,pattern", [
    ("train:\n  epochs: [1\n", r"malformed YAML"),
    ("model:\n  name: !!python/object/apply:os.system ['echo hi']\n", r"key 'name'\): tag not allowed"),
])
def test_bad_yaml_files_exit_2(tmp_path, capsys, text, pattern):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main([str(path), "--run-dir", str(tmp_path / "runs")]) == 2
    assert __import__("re").search(pattern, capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_duplicate_key_and_binary_files_exit_2(tmp_path, capsys):
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  epochs: 1\n  epochs: 2\n")
    blob = tmp_path / "blob.yaml"
    blob.write_bytes(bytes(range(256)))
    for path, pattern in ((dup, r"key 'epochs' is given twice"),
                          (blob, r"not a UTF-8 text file|binary file")):
        assert main([str(path), "--run-dir", str(tmp_path / "runs")]) == 2
        err = capsys.readouterr().err
        assert __import__("re").search(pattern, err) and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists()


def test_a_bug_in_a_user_builder_exits_1_with_its_traceback(tmp_path, capsys, monkeypatch):
    import types
    module = types.ModuleType("buggy_user_models")

    def build(spec):
        raise TypeError("unsupported operand in the user's builder")
    module.build = build
    monkeypatch.setitem(sys.modules, "buggy_user_models", module)
    assert main([str(QUICKSTART), "--run-dir", str(tmp_path / "runs"),
                 "--set", "model={name: 'buggy_user_models:build'}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and 'in build\n    raise TypeError' in err
    assert err.strip().splitlines()[-1] == ("tftrain: error: TypeError: unsupported operand "
                                            "in the user's builder")


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_real_cli_config_error_has_no_traceback(tmp_path):
    """A new interpreter, as a user starts it (a config error exits before TensorFlow is
    imported, so it costs under a second)."""
    proc = cli(QUICKSTART, "--run-dir", tmp_path, "--set", "train.acumulation_steps=2",
               fresh=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "tftrain: config error: --set: train.acumulation_steps: unknown key; "
        "did you mean accumulation_steps?")
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


# --- the quickstart through the real CLI -------------------------------------------------
SLOW_CALLBACK = "is slow compared to the batch time"


@pytest.mark.slow
def test_keras_slow_callback_warning_is_not_emitted_by_the_quickstart(quickstart_run, capfd):
    _, printed = quickstart_run
    assert SLOW_CALLBACK not in printed["stderr"] + printed["stdout"]
    # the check can fail: the same words for a callback that is slow
    import time as clock

    from tftrain.core.keras import keras

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            clock.sleep(0.02)

    import logging

    from tftrain.core import native_log
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    logger = logging.getLogger("tensorflow")
    held = list(logger.filters)                  # (a CLI run in this process holds them)
    logger.filters[:] = [f for f in held if f is not native_log._errors_only]
    try:
        model.fit(np.ones((64, 3)), np.ones((64, 2)), batch_size=8, epochs=1, verbose=0,
                  callbacks=[Slow()])
    finally:
        logger.filters[:] = held
    assert SLOW_CALLBACK in capfd.readouterr().err


@pytest.mark.slow
def test_quickstart_reaches_095(quickstart_run):
    path, printed = quickstart_run
    summary = json.loads((path / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["metrics"]["val_accuracy"] >= 0.95
    assert summary["strategy"] == "mirrored" and summary["replicas"] == 2
    assert summary["global_batch_size"] == 32 * 2 * 1
    assert summary["steps"] == summary["epochs"] * summary["steps_per_epoch"] == 15 * (1527 // 64)
    assert summary["throughput"]["examples_per_sec"] > 0
    assert "val_accuracy" in printed["stdout"] and "global batch 64" in printed["stdout"]


@pytest.mark.slow
def test_the_quickstart_console_is_one_screen_that_ends_with_where_things_are(quickstart_run):
    """README's command as typed: at most 60 lines, none over 120 columns, no line from
    TensorFlow's C++ start-up or absl, no input warning (the arrays are in memory), the
    XLA decision's cost set against the stage's steps, and a report ending with the
    artifacts' paths, the TensorBoard command and the total time."""
    path, printed = quickstart_run
    lines = (printed["stdout"] + printed["stderr"]).splitlines()
    assert len(lines) <= 60, len(lines)
    assert max(len(line) for line in lines) <= 120, [l for l in lines if len(l) > 120]
    native = re.compile(r"^[IWEF]\d{4} |absl|oneDNN|cuInit|cuda|TF-TRT|rebuild TensorFlow")
    assert not [l for l in lines if native.search(l)]
    assert "warning" not in printed["stdout"] + printed["stderr"]
    xla = " ".join(l.strip() for l in lines if l.startswith("[xla] done") or
                   (l.startswith("    ") and "as fast" in l))
    spent = re.search(r"the probe took ([\d.]+) s, (\d+)% of the", xla)
    skipped = re.search(r"probing would take about ([\d.]+) s, over 10% of the stage's "
                        r"([\d.]+) s of steps", xla)
    assert (spent and int(spent.group(2)) <= 10) or \
        (skipped and float(skipped.group(1)) > 0.1 * float(skipped.group(2))), xla
    summary = json.loads((path / "summary.json").read_text())
    report = "\n".join(lines[lines.index(next(l for l in lines if l.startswith("status"))):])
    for name in summary["artifacts"]:
        assert f"export {name}" in report
    assert "export/saved_model/" in report and "export/model.tflite" in report
    assert re.search(r"\d+\.\d KiB", report)
    assert f"tensorboard --logdir {path}/tensorboard" in report
    assert re.search(r"completed in [\d.]+ s", report) and f"run directory           {path}" in report
    assert (path / "report.html").exists()


SLEEPY = """import time
import tensorflow as tf

def sleepy(x, seed, seconds=0.004):
    def wait(v):
        time.sleep(seconds)
        return v
    y = tf.py_function(wait, [x], x.dtype)
    y.set_shape(x.shape)
    return y
"""


@pytest.mark.slow
def test_a_sleeping_augmentation_warns_that_input_is_the_bottleneck_naming_input_remedies(tmp_path):
    """The quickstart with an augmentation of the user's that sleeps 4 ms an example: the
    steps wait on input (the quickstart itself does not warn:
    `test_the_quickstart_console_is_one_screen...`), and the remedies are the input
    pipeline's that apply (the data is cached in memory already: not named)."""
    (tmp_path / "sleepy_aug.py").write_text(SLEEPY)
    proc = cli(QUICKSTART, "--run-dir", tmp_path / "runs", "--set", "train.epochs=3",
               "--set", "data.augment=[{sleepy_aug:sleepy: {seconds: 0.004}}]",
               "--set", "export.tflite=none", "--set", "export.preflight=false",
               env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}, fresh=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warning = " ".join(l.strip() for l in proc.stdout.split("tftrain: warning: ")[1].splitlines()
                       if not l.startswith(("[", "epoch")))
    share = int(re.match(r"the steps wait for input (\d+)% of the time", warning).group(1))
    assert share > 50, warning
    assert "lighten data.augment (sleepy_aug:sleepy run for every example)" in warning
    assert "tf.data service" in warning and "data.cache" not in warning
    assert "steps_per_execution" not in warning
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["throughput"]["input_wait"] > 0.5, summary["throughput"]


# report.html's charts by their place on the page (`report_page.write`)
CHARTS = {"per update": "chart-0", "per epoch": "chart-1", "accuracy": "chart-2",
          "confusion": "chart-3", "artifacts": "chart-4", "sqnr": "chart-5"}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["quickstart", "compress"])
def test_report_html_of_a_real_run_draws_its_charts_in_a_browser(which, request, tmp_path):
    """The quickstart's and the compress recipe's report.html, rendered by headless
    chromium: curves, confusion matrix and artifact chart drawn (traces in each chart's
    DOM, Plotly's colours on the screenshot); the compress run's int8 file adds the SQNR
    chart, the float-only quickstart has none."""
    from helpers import blue_pixels, charts_drawn, render
    path = request.getfixturevalue(f"{which}_run")[0]
    dom, image = render(path / "report.html", tmp_path)
    drawn = charts_drawn(dom)
    for name in ("per update", "per epoch", "accuracy", "confusion", "artifacts"):
        assert drawn.get(CHARTS[name], 0) > 0, (name, drawn)
    assert (drawn.get(CHARTS["sqnr"], 0) > 0) == (which == "compress"), drawn
    assert blue_pixels(image) > 2000                  # traces on the screenshot, not a blank page
    summary = json.loads((path / "summary.json").read_text())
    for name in summary["artifacts"]:
        assert name in dom


@pytest.mark.slow
def test_utilisation_of_a_compute_bound_cnn_is_below_its_ceiling(tmp_path):
    """A CNN of 32-64-128 filters and a 256-unit dense layer on 32 x 32 x 3 images, batch
    128 on one device in float32, read MFU 1.03, 0.97 and 0.90 against a matmul timed
    briefly at plan time: the ceiling is now the larger of that and the CPU's vector units
    x clock, both in summary.json, and MFU stays below 1."""
    summary = run(quick_config(
        tmp_path, "data.name=synthetic", "data.params={shape: [32, 32, 3], num_examples: 2048}",
        "model.params={filters: [32, 64, 128], dense: [256]}", "data.per_replica_batch_size=128",
        "distribute.strategy=one_device", "train.epochs=2", "export.tflite=none",
        "export.saved_model=false"))
    t = summary["throughput"]
    assert 0 < t["mfu"] < 1.0 and t["model_flops_per_sec"] < t["peak_flops_per_sec"]
    assert t["peak_flops_measured"] > 0 and t["peak_flops_theoretical"] > 0
    assert t["peak_flops_per_sec"] == max(t["peak_flops_measured"], t["peak_flops_theoretical"])


@pytest.mark.slow
def test_run_directory_contract(quickstart_run):
    path, _ = quickstart_run
    for name in ("config.yaml", "summary.json", "metrics.csv", "tensorboard",
                 "checkpoints", "export/saved_model/saved_model.pb", "export/model.tflite"):
        assert (path / name).exists(), name
    rows = list(csv.DictReader(open(path / "metrics.csv")))
    assert [int(r["epoch"]) for r in rows] == list(range(15))
    assert {"loss", "accuracy", "val_loss", "val_accuracy", "lr", "examples_per_sec",
            "model_flops_per_sec", "mfu"} <= set(rows[0])
    assert 0 < float(rows[-1]["mfu"]) < 1
    assert float(rows[-1]["lr"]) < float(rows[1]["lr"])          # cosine decayed
    import tensorflow as tf
    tags = {v.tag for f in (path / "tensorboard" / "train").glob("events.out.tfevents.*")
            for e in tf.compat.v1.train.summary_iterator(str(f)) for v in e.summary.value}
    assert {"epoch_loss", "epoch_accuracy", "epoch_learning_rate", "epoch_examples_per_sec",
            "epoch_model_flops_per_sec", "epoch_mfu"} <= tags
    assert "epoch_lr" not in tags                                # the learning rate once
    summary = json.loads((path / "summary.json").read_text())
    for name, art in summary["artifacts"].items():
        assert art["size_bytes"] > art["gzip_bytes"] > 0, name
        assert abs(art["accuracy"] - summary["metrics"]["val_accuracy"]) < 0.01, name


@pytest.mark.slow
def test_rerun_of_completed_run_reports_it(quickstart_run, tmp_path):
    path = _copy(quickstart_run[0], tmp_path)
    before = (path / "summary.json").read_text()
    proc = cli(QUICKSTART, "--run-dir", path.parent)
    assert proc.returncode == 0
    assert "already completed" in proc.stdout
    assert (path / "summary.json").read_text() == before


@pytest.mark.slow
def test_a_changed_config_on_a_completed_run_exits_2_naming_the_keys_before_tensorflow_loads(
        quickstart_run, tmp_path):
    """A completed 15-epoch run given train.epochs=4 and another optimizer: exit 2, the
    keys that differ named with both values, before TensorFlow is imported (a fresh
    interpreter says which modules it loaded), nothing written."""
    path = _copy(quickstart_run[0], tmp_path)
    before = {p: p.stat().st_mtime_ns for p in path.rglob("*")}
    probe = ("import sys; from tftrain.run import main; code = main(sys.argv[1:]); "
             "print('tensorflow loaded' if 'tensorflow' in sys.modules else 'no tensorflow'); "
             "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, str(QUICKSTART), "--run-dir",
                           str(path.parent), "--set", "train.epochs=4", "--set",
                           "train.optimizer.learning_rate=0.01"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout.strip() == "no tensorflow"
    line, = proc.stderr.strip().splitlines()
    assert line == (f"tftrain: config error: run.name: {path} is a completed run with a "
                    "different config: train.epochs (15 -> 4), train.optimizer.learning_rate "
                    "(0.003 -> 0.01); its results are not this config's. Use another run.name "
                    f"or --run-dir, or delete {path} to train again")
    assert {p: p.stat().st_mtime_ns for p in path.rglob("*")} == before


@pytest.mark.slow
def test_changed_config_on_existing_run_is_refused(quickstart_run, capsys, tmp_path):
    path = _copy(quickstart_run[0], tmp_path)
    (path / "summary.json").unlink()                          # looks interrupted
    assert main([str(QUICKSTART), "--run-dir", str(path.parent), "--set", "train.epochs=3"]) == 2
    assert "run.name: " in capsys.readouterr().err


def _copy(run_path, tmp_path):
    """A copy of a shared run's directory, for a test that changes it (other workers read
    the original)."""
    import shutil
    copy = Path(shutil.copytree(run_path, tmp_path / run_path.name))
    config = copy / "config.yaml"          # its run.dir is now tmp_path
    config.write_text(config.read_text().replace(str(run_path.parent), str(tmp_path)))
    return copy


@pytest.mark.slow
def test_a_full_dry_run_prints_the_built_plan_and_writes_nothing(tmp_path):
    proc = cli(QUICKSTART, "--run-dir", tmp_path, "--dry-run", "--full", "--set",
               "distribute.virtual_cpus=4", "--set", "train.accumulation_steps=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "replicas: 4" in out and "CPU:3" in out
    assert "32 per replica x 4 replicas x 2 accumulation steps = global batch 256" in out
    assert "53,002 parameters" in out and "export preflight" not in out
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_plans_from_the_config_before_tensorflow_loads(tmp_path):
    """`--dry-run` alone: the plan, optimizer, schedule, checkpoint interval and run
    directory, with no TensorFlow in the process (a fresh interpreter says so)."""
    probe = ("import sys; from tftrain.run import main; code = main(sys.argv[1:]); "
             "print('tensorflow' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, str(QUICKSTART), "--run-dir",
                           str(tmp_path), "--dry-run", "--set", "distribute.virtual_cpus=4",
                           "--set", "train.accumulation_steps=2"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.splitlines()
    assert out[-1] == "False"
    assert "strategy: mirrored   replicas: 4   workers: 1   devices: 4 logical CPU(s)" in out
    assert "batch: 32 per replica x 4 replicas x 2 accumulation steps = global batch 256" in out
    assert "data: digits, 1527 train / 270 validation examples" in out
    assert "training: 15 epochs x 5 updates = 75 updates" in out
    assert ("optimizer: adam, learning rate 0.003; schedule cosine after 5 warmup updates; "
            "checkpoint every 5 updates (keep 3)") in out
    assert f"run directory: {tmp_path}/quickstart" in out
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_refuses_the_global_batch_the_run_refuses_before_tensorflow_loads(tmp_path):
    """The dry run divides the global batch with the run's own function: 65 over 2
    replicas is exit 2 with the run's message, still without TensorFlow."""
    probe = ("import sys; from tftrain.run import main; code = main(sys.argv[1:]); "
             "print('tensorflow' in sys.modules); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, str(QUICKSTART), "--run-dir",
                           str(tmp_path), "--dry-run", "--set", "train.global_batch_size=65"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "tftrain: config error: train.global_batch_size: 65 is not divisible by replicas x "
        "accumulation_steps = 2 x 1; use a multiple of 2")
    assert proc.stdout.splitlines()[-1] == "False"
    assert list(tmp_path.iterdir()) == []


def test_dry_run_shows_the_compression_stages(tmp_path, capsys):
    assert main([str(COMPRESS), "--run-dir", str(tmp_path), "--dry-run", "--full"]) == 0
    out = "\n".join(unwrapped(capsys.readouterr().out))
    assert ("stage prune: 10 epochs = 230 updates at learning rate 0.001; sparsity reaches its "
            "target at update 160 (from 0, masks updated every 10 updates)") in out
    assert "stage qat: 2 epochs = 46 updates at learning rate 0.0003" in out
    assert list(tmp_path.iterdir()) == []


def test_schema_flag_prints_json_schema():
    proc = cli("--schema", fresh=True)          # a new interpreter: no TensorFlow imported
    assert proc.returncode == 0
    assert set(json.loads(proc.stdout)["properties"]) >= {"run", "distribute", "train"}


# --- resume ------------------------------------------------------------------------------
RESUME_EPOCHS = 8
RESUME_SETS = [f"train.epochs={RESUME_EPOCHS}", "train.checkpoint.every=10", "export.tflite=none",
               "export.preflight=false",      # (test_preflight.py's)
               "train.ema={decay: 0.9}",       # the weight average resumes exactly too
               "run.deterministic=true", "model.params={filters: [32, 64], dense: [128], dropout: 0.3}",
               # augmented: each example's crop and affine draw depend on (seed, epoch, position)
               "data.augment=[{random_crop: {padding: 1}}, {random_affine: {rotation: 0.03, zoom: 0.05}}]"]


def _start(tmp_path, *sets):
    return start_run(QUICKSTART, "--run-dir", tmp_path,
                     *[a for s in (*RESUME_SETS, *sets) for a in ("--set", s)])


@pytest.mark.slow
def test_killed_augmented_run_resumes_exactly(tmp_path, uninterrupted):
    """SIGKILLed after a checkpoint, resumed, stopped by SIGTERM (exit 42), resumed again:
    the same weights as the run never stopped."""
    planned = RESUME_EPOCHS * (1527 // 64)
    checkpoints = tmp_path / "quickstart" / "checkpoints"
    last = 0
    for sig, code, at_least in ((signal.SIGKILL, -signal.SIGKILL, 20), (signal.SIGTERM, 42, 60)):
        proc = _start(tmp_path)
        saved = wait_for_checkpoint(checkpoints, proc, at_least=at_least)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err[-2000:]
        assert not (tmp_path / "quickstart" / "summary.json").exists()
        if last:                       # the second process resumed where the first was cut
            resumed = resumed_at(out)
            assert last <= resumed < saved
        last = saved
    assert last < planned
    again = cli(QUICKSTART, "--run-dir", tmp_path, *[a for s in RESUME_SETS for a in ("--set", s)])
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = resumed_at(again.stdout)
    assert last <= resumed < planned
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == planned
    # it trained (chance is 0.1): 8 epochs of crops, affine draws and dropout got 257 or more
    # of the 270 examples right with tf_keras' update ops, 256 with the fused ones (one
    # example, rounding); whether it resumed exactly is the weights' check below
    assert summary["metrics"]["val_accuracy"] >= 0.94 and "val_accuracy" in summary["raw_metrics"]
    # Weights, weight averages, optimizer, schedule, data position, augmentation and
    # dropout RNG all resumed exactly.
    ours, reference = model_weights(tmp_path / "quickstart"), model_weights(uninterrupted)
    assert any(name.startswith("average/") for name in reference)
    for name in reference:
        np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-6)


# --- elastic resume: another number of replicas, the same global batch ------------------
ELASTIC_EPOCHS = 4
ELASTIC_SETS = [f"train.epochs={ELASTIC_EPOCHS}", "train.checkpoint.every=10",
                "export.tflite=none", "export.preflight=false", "run.deterministic=true",
                "model.params={filters: [16, 32], dense: [64]}",     # no dropout, no batch norm
                "data.augment=[{random_crop: {padding: 1}}]"]
ON = {2: ["distribute.virtual_cpus=2", "train.accumulation_steps=1"],
      1: ["distribute.virtual_cpus=1", "train.accumulation_steps=2"]}


@pytest.mark.slow
def test_a_killed_run_resumes_on_another_number_of_replicas_to_the_same_weights(tmp_path):
    """Mirrored on 2 virtual replicas, SIGKILLed mid-epoch, resumed on 1 replica with
    accumulation doubled, SIGKILLed again, resumed on 2: every update took the same 64
    examples (and crops) as the run never stopped, and the weights end within 1e-5 of it.
    (Processes of their own: the device count is set once per process.)"""
    planned = ELASTIC_EPOCHS * (1527 // 64)
    reference = cli(QUICKSTART, "--run-dir", tmp_path / "reference",
                    *[a for s in ELASTIC_SETS + ON[2] for a in ("--set", s)])
    assert reference.returncode == 0, reference.stderr[-3000:]
    checkpoints, last = tmp_path / "quickstart" / "checkpoints", 0
    for replicas, at_least in ((2, 20), (1, 50)):
        proc = start_run(QUICKSTART, "--run-dir", tmp_path,
                         *[a for s in ELASTIC_SETS + ON[replicas] for a in ("--set", s)])
        last = wait_for_checkpoint(checkpoints, proc, at_least=at_least)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        if replicas == 1:
            assert ("resuming on a different topology: 1 worker(s), 2 replica(s) x 32 x 1 "
                    "accumulation = global batch 64, float32 with a float32 all-reduce -> "
                    "1 worker(s), 1 replica(s) x 32 x 2 accumulation") in out, err[-2000:]
    assert last < planned
    again = cli(QUICKSTART, "--run-dir", tmp_path,
                *[a for s in ELASTIC_SETS + ON[2] for a in ("--set", s)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming on a different topology: 1 worker(s), 1 replica(s)" in again.stdout
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == planned and summary["replicas"] == 2
    ours = model_weights(tmp_path / "quickstart")
    theirs = model_weights(tmp_path / "reference" / "quickstart")
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_resume_that_adds_or_removes_loss_scaling_restores_and_trains_on(tmp_path):
    """A float32-wire run killed and resumed with a float16 all-reduce (a
    LossScaleOptimizer it did not have), killed again and resumed with float32: each
    resume restores the latest checkpoint (the optimizer's slots and iterations carry
    over, the loss scale starts from its initial value) and the run completes."""
    sets = [*ELASTIC_SETS, "train.epochs=3", "train.checkpoint.every=5"]
    checkpoints, last = tmp_path / "quickstart" / "checkpoints", 0
    for wire, at_least in (("float32", 10), ("float16", 35)):
        proc = start_run(QUICKSTART, "--run-dir", tmp_path, *[
            a for s in sets + [f"distribute.all_reduce_dtype={wire}"] for a in ("--set", s)])
        saved = wait_for_checkpoint(checkpoints, proc, at_least=at_least)
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        if wire == "float16":
            resumed = resumed_at(out)
            assert resumed == last, out[-2000:]                 # no checkpoint was unreadable
            assert "was written without loss scaling" in out and "loss scaled" in out
            assert "unreadable" not in err
        last = saved
    again = cli(QUICKSTART, "--run-dir", tmp_path,
                *[a for s in sets + ["distribute.all_reduce_dtype=float32"] for a in ("--set", s)])
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = resumed_at(again.stdout)
    assert resumed == last and "unreadable" not in again.stderr
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == 3 * (1527 // 64) and summary["all_reduce"]["dtype"] == "float32"
    # trained on across both changes: the loss fell, well above chance (uninterrupted,
    # these 69 updates reach 0.66 validation accuracy)
    with open(tmp_path / "quickstart" / "metrics.csv") as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]
    assert summary["metrics"]["val_accuracy"] > 0.4


@pytest.mark.slow
def test_a_resume_that_would_change_the_global_batch_exits_2_or_trains_on_when_allowed(tmp_path):
    """A run killed in its second epoch, resumed on one device instead of two: 32 examples
    per update instead of 64 is refused before anything is trained or written; with
    run.allow_batch_change it resumes at the same example of the epoch (update s of 64 is
    update 2s of 32), the learning rate halved, and summary.json records the change."""
    sets = [a for s in ELASTIC_SETS + ["train.epochs=2"] for a in ("--set", s)]
    proc = start_run(QUICKSTART, "--run-dir", tmp_path, *sets)
    wait_for_checkpoint(tmp_path / "quickstart" / "checkpoints", proc, at_least=30)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "quickstart").rglob("*")}
    one = ("--set", "distribute.virtual_cpus=1")
    again = cli(QUICKSTART, "--run-dir", tmp_path, *sets, *one)
    assert again.returncode == 2, again.stderr[-3000:]
    assert ("would change the global batch from 64 to 32 examples per update" in again.stderr
            and "train.global_batch_size: 64" in again.stderr
            and "run.allow_batch_change: true" in again.stderr and "Traceback" not in again.stderr)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "quickstart").rglob("*")} == before

    allowed = cli(QUICKSTART, "--run-dir", tmp_path, *sets, *one,
                  "--set", "run.allow_batch_change=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    old, new = 1527 // 64, 1527 // 32                  # updates per epoch: 23 of 64, 47 of 32
    moved = re.search(r"global batch 64 -> 32 \(run\.allow_batch_change\): update (\d+) of 64 "
                      r"becomes update (\d+) of 32", allowed.stdout)
    assert moved, allowed.stdout[-3000:]
    start, to = map(int, moved.groups())
    assert start >= 30 and to == (start // old) * new + (start % old) * 2
    assert resumed_at(allowed.stdout) == to
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["batch_changes"] == [{
        "stage": "train", "from_global_batch": 64, "to_global_batch": 32, "epoch": 1,
        "examples_into_epoch": (start - old) * 64, "from_update": start, "to_update": to,
        "examples_trained_again": 0, "learning_rate_scale": 0.5}]
    assert summary["global_batch_size"] == 32 and summary["steps"] == 2 * new
    assert (f"64 -> 32 at update {to} of stage train, learning rate x 0.5 "
            "(run.allow_batch_change)") in allowed.stdout
    with open(tmp_path / "quickstart" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[1]["loss"]) < float(rows[0]["loss"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    def build(out):
        proc = cli(QUICKSTART, "--run-dir", out, *[a for s in RESUME_SETS for a in ("--set", s)])
        assert proc.returncode == 0, proc.stderr[-3000:]
    return shared_run(tmp_path_factory, "uninterrupted", build)[0] / "quickstart"


# --- every strategy and precision policy -------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy,policy", [
    ("default", "float32"), ("one_device", "float32"), ("mirrored", "float32"),
    ("mirrored", "mixed_bfloat16"), ("mirrored", "mixed_float16"), ("auto", "auto"),
])
def test_every_strategy_and_policy_trains(tmp_path, strategy, policy):
    cfg = quick_config(tmp_path, f"distribute.strategy={strategy}", f"precision.policy={policy}",
                       "train.epochs=3", "export.tflite=none", "export.saved_model=false")
    summary = run(cfg)
    assert summary["metrics"]["val_accuracy"] > 0.9
    assert summary["strategy"] == {"auto": "mirrored"}.get(strategy, strategy)
    assert summary["steps"] == 3 * summary["steps_per_epoch"]
    # the allocator's peak during training, beside the planner's estimate (the logical CPU
    # devices share one allocator: one figure), in summary.json and per stage
    memory = summary["memory"]
    (peak,) = memory["peak_bytes"].values()
    assert peak > 0 and memory["estimate_bytes"] > 0
    assert memory["peak_over_estimate"] == round(peak / memory["estimate_bytes"], 3)
    assert summary["stages"]["train"]["memory"] == memory and summary["recompute"] == "none"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["run", "launch"])
def test_multi_worker_strategy_single_worker_trains(tmp_path, launcher):
    """One worker of MultiWorkerMirroredStrategy: under `tftrain.run`, and under
    `tftrain.launch --workers 1` (a TF_CONFIG cluster of one, whose collectives must be
    configured before planning runs any op)."""
    sets = [a for s in ("distribute.strategy=multi_worker", "distribute.virtual_cpus=1",
                        "train.epochs=3", "export.tflite=none",
                        "train.accumulation_steps=2", "data.per_replica_batch_size=16",
                        "train.jit_compile=false", "export.preflight=false")
            for a in ("--set", s)]
    head = [] if launcher == "run" else ["-m", "tftrain.launch", "--workers", "1"]
    proc = (cli(QUICKSTART, "--run-dir", tmp_path, *sets) if launcher == "run" else
            subprocess.run([sys.executable, *head, str(QUICKSTART), "--run-dir", str(tmp_path), *sets],
                           cwd=ROOT, capture_output=True, text=True, timeout=600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["strategy"] == "multi_worker" and summary["workers"] == 1
    assert summary["global_batch_size"] == 32 and summary["steps"] == 3 * (1527 // 32)
    assert summary["metrics"]["val_accuracy"] > 0.9


@pytest.mark.slow
def test_smoke_runs_whole_pipeline_with_the_configured_strategy(tmp_path):
    summary = run(quick_config(tmp_path, "compression.pruning.enabled=true", "export.tflite=int8",
                               "compression.quantization.enabled=true"), smoke=True)
    assert summary["smoke"] and summary["strategy"] == "mirrored"
    assert summary["steps"] == 3 and summary["replicas"] == 2
    assert [s["updates"] for s in summary["stages"].values()] == [3, 3, 3]
    # its phases are its own, not the process's earlier runs' too (one ran just before)
    again = run(quick_config(tmp_path, "run.name=again", "train.epochs=1", "export.tflite=none",
                             "export.saved_model=false"), smoke=True)
    assert set(again["phase_seconds"]) == {"plan", "train"}
    assert again["phase_seconds"]["train"] <= again["stages"]["train"]["seconds"] + 5.0
    assert (tmp_path / "quickstart-smoke" / "export" / "model.tflite").exists()
    assert not (tmp_path / "quickstart").exists()


@pytest.mark.slow
def test_python_api_example_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "strategy_and_models.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "replicas: 2" in proc.stdout and "global batch per update: 128" in proc.stdout
    accuracy = float(proc.stdout.split("val_accuracy: ")[-1].split()[0])
    assert accuracy > 0.9


@pytest.mark.slow
def test_accumulation_through_the_cli_equals_large_batch(tmp_path, capsys):
    common = ["--set", "model={name: mlp}", "--set", "data.shuffle=false", "--set", "train.epochs=1",
              "--set", "train.optimizer={name: sgd, learning_rate: 0.1, params: {momentum: 0.9}}",
              "--set", "train.schedule={name: constant}", "--set", "export.tflite=none",
              "--set", "export.saved_model=false", "--set", "train.jit_compile=false",
              "--run-dir", str(tmp_path)]
    assert main([str(QUICKSTART), *common, "--set", "run.name=accumulated",
                 "--set", "distribute.strategy=mirrored", "--set", "data.per_replica_batch_size=8",
                 "--set", "train.accumulation_steps=4"]) == 0
    assert "8 per replica x 2 replicas x 4 accumulation steps = global batch 64" in capsys.readouterr().out
    assert main([str(QUICKSTART), *common, "--set", "run.name=large",
                 "--set", "distribute.strategy=one_device", "--set", "data.per_replica_batch_size=64"]) == 0
    accumulated, large = model_weights(tmp_path / "accumulated"), model_weights(tmp_path / "large")
    assert len(accumulated) == 6 and accumulated.keys() == large.keys()
    for name in large:
        diff = np.linalg.norm(accumulated[name] - large[name])
        assert diff <= 1e-5 * np.linalg.norm(large[name]), name
    steps = [json.loads((tmp_path / r / "summary.json").read_text())["steps"] for r in ("accumulated", "large")]
    assert steps == [1527 // 64] * 2


DIVERGING = ["train.optimizer={name: sgd, learning_rate: 1.0e+12}", "train.schedule={name: constant}",
             "train.epochs=2", "export.tflite=none", "export.saved_model=false"]


@pytest.mark.slow
def test_non_finite_loss_stops_with_a_clear_error(tmp_path, capsys):
    args = [str(QUICKSTART), "--run-dir", str(tmp_path)] + [a for s in DIVERGING for a in ("--set", s)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "loss became non-finite by update" in err and "train.on_nan: rollback" in err
    assert not (tmp_path / "quickstart" / "summary.json").exists()
    assert not list((tmp_path / "quickstart" / "checkpoints").glob("*.index"))   # nothing NaN saved


@pytest.mark.slow
def test_non_finite_loss_rolls_back_with_a_lower_rate(tmp_path, capsys):
    summary = run(quick_config(tmp_path, *DIVERGING, "train.on_nan=rollback",
                               "train.nan_lr_factor=1.0e-13"))
    out = capsys.readouterr().out
    assert "rolled back to update 0, learning rate x 1e-13 (retry 1/3)" in out
    assert summary["steps"] == 2 * 23
    assert np.isfinite(summary["metrics"]["val_loss"]) and summary["metrics"]["val_accuracy"] > 0.3


@pytest.mark.slow
def test_profile_window_writes_a_trace_the_profiler_and_xprof_read(tmp_path):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    assert main([str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path), "--profile",
                 "3:13", "--set", "train.epochs=1", "--set", "train.verbose=0",
                 "--set", "train.steps_per_execution=1", "--set", "export.tflite=none"]) == 0
    traces = list((tmp_path / "quickstart" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
    space = xplane_pb2.XSpace()
    space.ParseFromString(traces[0].read_bytes())
    host, = [plane for plane in space.planes if plane.name == "/host:CPU"]
    calls = [e for line in host.lines for e in line.events
             if host.event_metadata[e.metadata_id].name == "train_function"]
    assert len(calls) == 10                       # updates 3..12, one per call here
    # and xprof (the profile plugin TensorBoard loads) converts it for its trace viewer
    from xprof.convert import raw_to_tool_data
    data, kind = raw_to_tool_data.xspace_to_tool_data([str(traces[0])], "trace_viewer", {})
    events = json.loads(data)["traceEvents"]
    assert kind == "application/json"
    assert sum(e.get("name") == "train_function" for e in events) == 10
    # the window closed: starting the profiler again does not find it running
    tf.profiler.experimental.start(str(tmp_path / "again"))
    tf.profiler.experimental.stop()


@pytest.mark.parametrize("window", ["5", "5:5", "a:b", "-1:3"])
def test_a_bad_profile_window_exits_2_naming_the_flag(tmp_path, capsys, window):
    assert main([str(ROOT / "configs" / "quickstart.yaml"), "--run-dir", str(tmp_path),
                 f"--profile={window}"]) == 2
    assert capsys.readouterr().err.startswith("tftrain: config error: --profile: ")
    assert not any(tmp_path.iterdir())


# --- compression: train -> prune -> QAT -> int8, from configs/compress.yaml --------------


@pytest.mark.slow
def test_compress_config_loses_under_a_point_and_is_10x_smaller(compress_run):
    path, summary = compress_run
    stages = summary["stages"]
    assert [(k, v["updates"]) for k, v in stages.items()] == [("train", 230), ("prune", 230), ("qat", 46)]
    float32 = stages["train"]["metrics"]["val_accuracy"]
    int8 = summary["artifacts"]["tflite_int8"]
    assert float32 >= 0.97 and int8["accuracy"] >= float32 - 0.01
    # the headline is the deployed file's accuracy, beside the QAT stage's evaluation
    assert summary["accuracy"]["artifact"] == "tflite_int8"
    assert summary["accuracy"]["value"] == int8["accuracy"]
    assert summary["accuracy"]["stage_value"] == stages["qat"]["metrics"]["val_accuracy"]
    # the exported QAT SavedModel scores exactly what the QAT stage's evaluation scored
    assert summary["artifacts"]["saved_model"]["accuracy"] == pytest.approx(
        stages["qat"]["metrics"]["val_accuracy"], abs=1e-6)
    assert int8["gzip_bytes"] * 10 <= stages["train"]["float32_variables_gzip_bytes"]
    assert set(summary["sparsity"]) == {"conv_0", "conv_1", "dense_0", "logits"}
    for layer, value in summary["sparsity"].items():
        assert value == pytest.approx(0.8, abs=0.01), layer
    assert json.loads((path / "summary.json").read_text())["sparsity"] == summary["sparsity"]
    rows = list(csv.DictReader(open(path / "metrics-prune.csv")))
    assert len(rows) == 10 and float(rows[-1]["sparsity_dense_0"]) == pytest.approx(0.8, abs=0.01)


@pytest.mark.slow
def test_every_int8_artifact_reports_each_layer_and_says_what_it_is(compress_run):
    """The compress run's int8 TFLite file, int8 SavedModel and int8 ONNX model each list
    every quantized layer with its SQNR against the QAT model (in summary.json, the
    printed report's five layers adding the most noise, and TensorBoard); each says
    whether all its compute is int8."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tftrain.training.report_table import report_table
    path, summary = compress_run
    arts = summary["artifacts"]
    wrapped = {f"quant_{name}" for name in summary["sparsity"]}     # conv_0 ... logits
    for name in ("tflite_int8", "saved_model_int8", "onnx_int8"):
        rows = {r["layer"]: r for r in arts[name]["layers"]}
        assert wrapped - {"quant_conv_0", "quant_conv_1"} <= set(rows), (name, sorted(rows))
        assert len(arts[name]["worst_layers"]) == 5
        # int8 rounding of what QAT simulated: each layer adds little
        assert min(r["local_sqnr_db"] for r in rows.values()) > 35, name
        assert min(r["sqnr_db"] for r in rows.values()) > 25, name
    assert arts["tflite_int8"]["label"] == arts["onnx_int8"]["label"] == "int8"
    assert arts["tflite_int8"]["float_ops"] == arts["onnx_int8"]["float_ops"] == []
    assert arts["saved_model_int8"]["label"] == "int8 kernels, float32 compute"
    table = report_table(summary)
    assert "tflite_int8 layers" in table and arts["tflite_int8"]["worst_layers"][0] in table
    # the int8 file is timed beside the float file of the QAT model's float function
    grid, beside = arts["tflite_int8"]["latency_grid"], arts["tflite_int8"]["float_latency_grid"]
    assert list(beside) == list(grid) and all(v > 0 for v in beside.values())
    fast = arts["tflite_int8"]["speedup_vs_float"]
    assert list(fast) == list(grid) and all(v > 0 for v in fast.values())
    assert f"/ {fast['batch32_threads1']:.2f}x as fast on 1 thread" in table
    events = EventAccumulator(str(path / "tensorboard" / "export"),
                              size_guidance={"tensors": 0}).Reload()
    assert len(events.Tensors("tflite_int8/sqnr_db")) == len(arts["tflite_int8"]["layers"])


@pytest.mark.slow
def test_compressed_tflite_keeps_the_pruned_zeros(compress_run):
    from tftrain.export.artifacts import tflite_weights
    path, summary = compress_run
    weights = tflite_weights((path / "export" / "model.tflite").read_bytes())
    for layer in summary["sparsity"]:
        kernel, = [w for name, w in weights.items() if f"quant_{layer}/" in name and w.ndim > 1]
        assert kernel.dtype == np.int8
        assert float(np.mean(kernel == 0)) == pytest.approx(0.8, abs=0.01), layer


@pytest.mark.slow
def test_compressed_saved_model_matches_and_runs_in_saved_model_cli(compress_run, tmp_path):
    path, summary = compress_run
    saved = summary["artifacts"]["saved_model"]
    assert saved["max_abs_logit_diff"] < 1e-4
    assert saved["accuracy"] == pytest.approx(summary["metrics"]["val_accuracy"], abs=1e-6)
    saved_model_cli_show_and_run(path / "export" / "saved_model", np.zeros((3, 8, 8, 1), np.float32),
                                 tmp_path)


@pytest.mark.slow
def test_compressed_int8_saved_model_is_8x_smaller_keeps_zeros_and_runs_alone(compress_run,
                                                                            tmp_path):
    path, summary = compress_run
    int8 = summary["artifacts"]["saved_model_int8"]
    float32 = summary["stages"]["train"]
    assert int8["variables_gzip_bytes"] * 8 <= float32["float32_variables_gzip_bytes"]
    assert int8["accuracy"] >= float32["metrics"]["val_accuracy"] - 0.01 and int8["verified"]
    saved = path / "export" / "saved_model_int8"
    # Example by example against the int8 TFLite file: both hold the same int8 kernels and
    # activation ranges, and differ only where float and integer arithmetic round a value
    # near a quantization level the other way. At the logits that is at most one step of
    # each input of the last layer times its weight, summed, plus the output's own
    # rounding (`_rounding_bound`, 12-26 output steps here; a wrong scale or kernel is
    # hundreds); a prediction may differ only where the two best logits are that close.
    from tftrain.export.artifacts import tflite_logits
    x, _ = _validation(path)
    blob = (path / "export" / "model.tflite").read_bytes()
    ours = tf.saved_model.load(str(saved)).signatures["serving_default"](
        inputs=tf.constant(x))["logits"].numpy()
    theirs, _ = tflite_logits(blob, x)
    bound = _rounding_bound(blob)
    assert np.all(np.abs(ours - theirs) <= bound + 1e-6), (np.abs(ours - theirs) / bound).max()
    top2 = np.sort(theirs, axis=-1)[:, -2:]
    differ = np.argmax(ours, -1) != np.argmax(theirs, -1)
    assert np.all(top2[differ, 1] - top2[differ, 0] <= 2 * bound.max())
    reader = tf.train.load_checkpoint(str(saved / "variables" / "variables"))
    kernels = [reader.get_tensor(k) for k, d in reader.get_variable_to_dtype_map().items()
               if d == tf.int8]
    assert len(kernels) == 4
    for kernel in kernels:
        assert float(np.mean(kernel == 0)) == pytest.approx(0.8, abs=0.01)
    saved_model_cli_show_and_run(saved, np.zeros((3, 8, 8, 1), np.float32), tmp_path)


def _validation(run_path):
    """The validation examples of a finished run, as its exported models take them."""
    from tftrain.config import load_config
    from tftrain.data import BatchPlan, load_source, val_dataset
    cfg = load_config(run_path / "config.yaml")
    source = load_source(cfg.data, cfg.run.seed)
    x, y = zip(*val_dataset(source, BatchPlan(1024, 1, 1), cfg.data).as_numpy_iterator())
    return np.concatenate(x), np.concatenate(y)


def _output_scale(blob) -> float:
    """The int8 step of a TFLite model's logits (the output, or the int8 tensor its final
    DEQUANTIZE reads)."""
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_content=blob)
    out = interp.get_output_details()[0]
    scale = out["quantization"][0]
    if not scale:
        op, = [op for op in interp._get_ops_details()
               if op["op_name"] == "DEQUANTIZE" and out["index"] in op["outputs"]]
        scale = interp._get_tensor_details(op["inputs"][0], 0)["quantization"][0]
    assert scale > 0
    return scale


def _rounding_bound(blob) -> np.ndarray:
    """Per logit: how far integer and float arithmetic can take it apart when each input
    of the last FULLY_CONNECTED is one quantization step off (s_in * sum |w|), plus two
    steps of the output's own rounding."""
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_content=blob)
    interp.allocate_tensors()
    fc = [op for op in interp._get_ops_details() if op["op_name"] == "FULLY_CONNECTED"][-1]
    inputs, weights = (interp._get_tensor_details(i, 0) for i in fc["inputs"][:2])
    scales = weights["quantization_parameters"]["scales"]
    kernel = interp.get_tensor(fc["inputs"][1]).astype(np.float64) * (
        scales[:, None] if len(scales) > 1 else scales[0])
    return inputs["quantization"][0] * np.abs(kernel).sum(axis=1) + 2 * _output_scale(blob)


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of an event directory, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(directory), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    found = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    for tag in acc.Tags()["tensors"]:          # Keras writes scalars as summary v2 tensors
        values = [(e.step, tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)]
        if values and values[0][1].ndim == 0 and values[0][1].dtype.kind == "f":
            found[tag] = [(step, float(v)) for step, v in values]
    return found


@pytest.mark.slow
def test_tensorboard_reads_every_epoch_and_each_stage_under_its_tag(compress_run):
    path, summary = compress_run
    tb = path / "tensorboard"
    train, val = tensorboard_scalars(tb / "train"), tensorboard_scalars(tb / "validation")
    for tag in ("epoch_loss", "epoch_accuracy", "epoch_learning_rate", "epoch_examples_per_sec",
                "epoch_mfu"):
        assert [step for step, _ in train[tag]] == list(range(10)), tag
    assert [step for step, _ in val["epoch_accuracy"]] == list(range(10))
    assert val["epoch_accuracy"][-1][1] == pytest.approx(
        summary["stages"]["train"]["metrics"]["val_accuracy"], abs=1e-6)
    rows = list(csv.DictReader(open(path / "metrics.csv")))
    assert [v for _, v in train["epoch_loss"]] == pytest.approx([float(r["loss"]) for r in rows])
    assert all(v > 0 for _, v in train["epoch_mfu"] + train["epoch_examples_per_sec"])
    prune, qat = tensorboard_scalars(tb / "prune" / "train"), tensorboard_scalars(tb / "qat" / "train")
    assert prune["epoch_sparsity_dense_0"][-1][1] == pytest.approx(0.8, abs=0.01)
    assert len(prune["epoch_loss"]) == 10 and len(qat["epoch_loss"]) == 2
    assert tensorboard_scalars(tb / "qat" / "validation")["epoch_accuracy"][-1][1] == pytest.approx(
        summary["stages"]["qat"]["metrics"]["val_accuracy"], abs=1e-6)
    # the export's figures and the config as hyperparameters, with the final metrics
    export = tensorboard_scalars(tb / "export")
    for name, art in summary["artifacts"].items():
        assert export[f"{name}/size_kib"] == [(0, pytest.approx(art["size_bytes"] / 1024))]
        assert export[f"{name}/accuracy"] == [(0, pytest.approx(art["accuracy"], abs=1e-6))]
    hparams = tensorboard_scalars(tb / "hparams")
    assert hparams["final/val_accuracy"] == [(0, pytest.approx(summary["metrics"]["val_accuracy"]))]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2
    content = EventAccumulator(str(tb / "hparams")).Reload().PluginTagToContent(metadata.PLUGIN_NAME)
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content[metadata.SESSION_START_INFO_TAG]).session_start_info
    assert start.hparams["compression.pruning.final_sparsity"].number_value == pytest.approx(0.8)


@pytest.mark.slow
def test_compression_after_mixed_bfloat16_with_accumulation(tmp_path):
    summary = run(quick_config(
        tmp_path, "precision.policy=mixed_bfloat16", "train.accumulation_steps=2",
        "data.per_replica_batch_size=16", "train.epochs=4", "export.tflite=int8",
        "compression.pruning={enabled: true, epochs: 2, final_sparsity: 0.5, structure: '2:4'}",
        "compression.quantization={enabled: true, epochs: 1}"))
    spe = summary["steps_per_epoch"]
    assert summary["precision"] == "mixed_bfloat16" and summary["accumulation_steps"] == 2
    assert summary["stages"]["prune"]["updates"] == 2 * spe      # updates, not micro-batches
    assert summary["sparsity"] == {"conv_1": 0.5, "dense_0": 0.5, "logits": 0.5}
    assert summary["artifacts"]["tflite_int8"]["accuracy"] > 0.9


USER_SETS = ["data.name=tests.data.test_data:user_digits", "train.epochs=3", "train.checkpoint.every=10",
             "export.tflite=none", "export.preflight=false", "run.deterministic=true", "data.remainder=pad",
             "model={name: mlp, params: {hidden: [64], dropout: 0.2}}"]


@pytest.mark.slow
def test_user_dataset_trains_and_resumes_after_sigkill(tmp_path, capsys):
    args = lambda out: [str(QUICKSTART), "--run-dir", str(out), *[a for s in USER_SETS for a in ("--set", s)]]  # noqa: E731
    assert main(args(tmp_path / "whole")) == 0
    assert "(your tf.data pipeline)" in capsys.readouterr().out
    proc = start_run(*args(tmp_path / "cut"))
    wait_for_checkpoint(tmp_path / "cut" / "quickstart" / "checkpoints", proc, at_least=30)
    proc.kill()
    proc.communicate(timeout=60)
    again = cli(*args(tmp_path / "cut"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout
    summary = json.loads((tmp_path / "cut" / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == 3 * 24 and summary["metrics"]["val_accuracy"] > 0.75
    ours, reference = model_weights(tmp_path / "cut" / "quickstart"), model_weights(tmp_path / "whole" / "quickstart")
    for name in reference:
        np.testing.assert_allclose(ours[name], reference[name], rtol=0, atol=1e-6)


# --- SIGTERM at any moment: exit 42, and the rerun ends as if nothing happened ------------
def _signal_during(monkeypatch, owner, name, call=1, after=False):
    """Send this process SIGTERM during (or right after) the `call`-th call of
    owner.name: a real signal at a chosen moment of an in-process run."""
    import os
    original, calls = getattr(owner, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call and not after:
            os.kill(os.getpid(), signal.SIGTERM)
        result = original(*args, **kwargs)
        if len(calls) == call and after:
            os.kill(os.getpid(), signal.SIGTERM)
        return result
    monkeypatch.setattr(owner, name, wrapped)


STAGED = ["train.epochs=1", "compression.pruning.epochs=1", "compression.quantization.epochs=1",
          "model.params.dense=[64]", "train.checkpoint.every=7", "export.tflite=none",
          "export.saved_model_int8=false", "train.verbose=0",
          # the export's own call is where the third stop lands (a preflight would be the
          # first call of export_all); preflight's stops are test_preflight's
          "export.preflight=false",
          # resume ends equal under run.deterministic only (README): without it, `auto`
          # choices (XLA, steps per call) are measured and can differ between runs
          "run.deterministic=true"]


def _staged(run_dir):
    return [str(COMPRESS), "--run-dir", str(run_dir), *[a for s in STAGED for a in ("--set", s)]]


@pytest.fixture(scope="module")
def staged_reference(tmp_path_factory):
    def build(out):
        assert main(_staged(out)) == 0
    return shared_run(tmp_path_factory, "staged", build)[0] / "compress"


@pytest.mark.slow
def test_sigterm_at_any_moment_exits_42_and_the_rerun_ends_equal(
        tmp_path, capsys, monkeypatch, staged_reference):
    """One run stopped three times, each at another moment (after a stage, during a
    validation, during the export), each rerun resuming; it ends equal to the run that was
    never stopped."""
    from tftrain import stages
    from tftrain.export import exports
    from tftrain.training.train_step import TrainModel
    run_path = tmp_path / "compress"
    moments = [  # (where the signal lands, what the stop message says, what the rerun says)
        ((stages.StageRunner, "run_stage", 1, True), "before stage prune", None),
        ((TrainModel, "evaluate", 1, False), "in stage prune at update 23/23",  # its validation
         "at update 23/23 of stage prune"),       # the epoch's checkpoint, validated again
        ((exports, "export_all", 1, False), "after the export", None)]
    for where, stopped, resumed in moments:
        with monkeypatch.context() as patch:
            _signal_during(patch, *where)
            assert main(_staged(tmp_path)) == 42
        out, err = capsys.readouterr()
        assert "stopped by SIGTERM" in err and "Traceback" not in err, err[-2000:]
        assert stopped in err, err[-2000:]
        assert not (run_path / "summary.json").exists()
    assert main(_staged(tmp_path)) == 0
    summary = json.loads((run_path / "summary.json").read_text())
    reference = json.loads((staged_reference / "summary.json").read_text())
    assert [s["updates"] for s in summary["stages"].values()] == [23, 23, 23]
    assert summary["metrics"] == pytest.approx(reference["metrics"], abs=1e-6)
    # (tfmot's auto-named quantize layer gets a suffix in the second run of a process)
    named = lambda w: {re.sub(r"quantize_layer_\d+", "quantize_layer", n): v for n, v in w.items()}  # noqa: E731
    ours, theirs = named(model_weights(run_path, "qat")), named(model_weights(staged_reference, "qat"))
    assert ours.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6)
    assert (run_path / "export" / "saved_model" / "saved_model.pb").exists()


STATEFUL = ["train.epochs=7", "export.tflite=none", "export.saved_model=false",
            # min_delta: small gains do not count, so the plateau lowers the rate on its own
            # clock across the restart
            "train.schedule={name: plateau, patience: 1, factor: 0.5, min_delta: 0.2}",
            # min_delta 0.5: after the first epochs nothing counts as better, so the stop
            # comes `patience` epochs after the last improvement, counted across the restart
            "train.early_stopping={monitor: val_loss, patience: 3, min_delta: 0.5}",
            "train.verbose=0", "run.deterministic=true"]


@pytest.mark.slow
def test_plateau_and_early_stopping_resume_equal_to_an_uninterrupted_run(
        tmp_path, capsys, monkeypatch):
    from tftrain.training.train_step import TrainModel
    args = lambda d: [str(QUICKSTART), "--run-dir", str(d), *[a for s in STATEFUL for a in ("--set", s)]]  # noqa: E731
    assert main(args(tmp_path / "reference")) == 0
    reference = json.loads((tmp_path / "reference" / "quickstart" / "summary.json").read_text())
    assert reference["epochs"] < 7                          # early stopping ended it
    with monkeypatch.context() as patch:
        _signal_during(patch, TrainModel, "evaluate", 3)    # during epoch 3's validation
        assert main(args(tmp_path / "resumed")) == 42
    saved = tf_checkpoint_values(tmp_path / "resumed" / "quickstart" / "checkpoints", "callbacks")
    assert any(v > 0 for k, v in saved.items() if "/wait/" in k), saved     # state to carry
    assert main(args(tmp_path / "resumed")) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "resumed" / "quickstart" / "summary.json").read_text())
    assert summary["epochs"] == reference["epochs"] and summary["steps"] == reference["steps"]
    ours, theirs = (model_weights(tmp_path / d / "quickstart") for d in ("resumed", "reference"))
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6)
    rates = [[row["lr"] for row in csv.DictReader(open(tmp_path / d / "quickstart" / "metrics.csv"))]
             for d in ("resumed", "reference")]
    assert rates[0] == rates[1] and len(set(rates[1])) > 1          # the plateau lowered it


def tf_checkpoint_values(directory, prefix):
    """Scalar values under `prefix` in the newest checkpoint of `directory`."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(directory))
    return {n: float(reader.get_tensor(n)) for n in reader.get_variable_to_shape_map()
            if n.startswith(prefix) and not reader.get_variable_to_shape_map()[n]}


@pytest.mark.slow
def test_rollback_learning_rate_cut_survives_a_restart(tmp_path, capsys, monkeypatch):
    from tftrain.training.train_step import TrainModel
    sets = [*DIVERGING, "train.epochs=3", "train.on_nan=rollback", "train.nan_lr_factor=1.0e-13",
            "train.verbose=0", "run.deterministic=true"]
    args = lambda d: [str(QUICKSTART), "--run-dir", str(d), *[a for s in sets for a in ("--set", s)]]  # noqa: E731
    assert main(args(tmp_path / "reference")) == 0
    assert "rolled back to update 0" in capsys.readouterr().out
    with monkeypatch.context() as patch:
        _signal_during(patch, TrainModel, "evaluate", 1)    # after the rollback, in epoch 1
        assert main(args(tmp_path / "resumed")) == 42
    assert "rolled back to update 0" in capsys.readouterr().out
    assert main(args(tmp_path / "resumed")) == 0
    out = capsys.readouterr().out
    assert "resuming from" in out and "rolled back" not in out   # the lowered rate was kept
    ours, theirs = (model_weights(tmp_path / d / "quickstart") for d in ("resumed", "reference"))
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_steps_count_updates_made_when_loss_scaling_skips_some(tmp_path):
    import math
    summary = run(quick_config(tmp_path, "precision={policy: mixed_float16, initial_scale: 268435456}",
                               "train.epochs=1", "export.tflite=none", "export.saved_model=false"))
    scale = tf_checkpoint_values(tmp_path / "quickstart" / "checkpoints", "optimizer")
    final, = [v for k, v in scale.items() if "current_loss_scale" in k]
    skipped = round(math.log2(2**28 / final))     # each skipped update halves the scale
    assert skipped >= 5
    assert summary["stages"]["train"]["batches"] == 23
    assert summary["steps"] == 23 - skipped == summary["stages"]["train"]["updates"]


@pytest.mark.slow
def test_an_early_stopped_stage_is_never_re_entered(tmp_path, capsys, monkeypatch):
    from tftrain import stages
    sets = ["train.epochs=6", "train.early_stopping={monitor: val_loss, patience: 1, min_delta: 5.0}",
            "compression.pruning.epochs=1", "compression.quantization.enabled=false",
            "model.params.dense=[64]", "export.tflite=none", "export.saved_model=false",
            "train.verbose=0", "train.jit_compile=false"]
    args = [str(COMPRESS), "--run-dir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    with monkeypatch.context() as patch:
        _signal_during(patch, stages.StageRunner, "run_stage", 1, after=True)   # after train
        assert main(args) == 42
    stopped = json.loads((tmp_path / "compress" / "stages.json").read_text())["train"]
    assert stopped["updates"] == 2 * 23 < 6 * 23                  # stopped after 2 of 6 epochs
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "of stage train" not in out                          # not resumed, not retrained
    import tensorflow as tf
    assert tf.train.latest_checkpoint(str(tmp_path / "compress" / "checkpoints")).endswith("ckpt-46")
    summary = json.loads((tmp_path / "compress" / "summary.json").read_text())
    assert summary["steps"] == summary["stages"]["train"]["updates"] == 2 * 23
    assert summary["epochs"] == 2 and summary["stages"]["prune"]["updates"] == 23


@pytest.mark.slow
def test_compressed_onnx_is_a_qdq_model_onnx_runtime_runs_in_int8(compress_run):
    path, summary = compress_run
    onnx8, lite = summary["artifacts"]["onnx_int8"], summary["artifacts"]["tflite_int8"]
    assert abs(onnx8["accuracy"] - lite["accuracy"]) <= 0.01 and onnx8["verified"]
    assert onnx8["max_abs_diff_vs_tflite_int8"] <= 1e-5
    assert onnx8["int8_kernels"] == {"QLinearConv": 2, "QGemm": 2}
    assert onnx8["float_ops"] == [] and lite["xnnpack"] == {"delegated": 9, "fallback": []}
    assert (path / "export" / "model_int8.onnx").stat().st_size == onnx8["size_bytes"]
    # a QAT model's float graph holds fake-quant ops: no float ONNX file for it
    assert "onnx" not in summary["artifacts"] and not (path / "export" / "model.onnx").exists()


@pytest.mark.slow
def test_an_int8_file_beyond_its_accuracy_budget_keeps_every_artifact_names_one_to_ship_exit_3(
        tmp_path, monkeypatch, capsys):
    """The int8 file's dense layer quantized wrong (its kernel scales x8, as a converter
    bug would): it works but loses more than export.max_accuracy_drop, so the run keeps
    every artifact, names the best within the budget (the SavedModel, the only other)
    and exits 3, neither success nor crash."""
    from tftrain.export import artifacts, fallback
    convert = artifacts.convert_tflite
    monkeypatch.setattr(artifacts, "convert_tflite", lambda *a, **k: fallback.with_kernel_scales(
        convert(*a, **k), "dense_0", 8.0))
    code = main([str(QUICKSTART), "--run-dir", str(tmp_path), "--set", "train.epochs=4",
                 "--set", "export.tflite=int8", "--set", "export.preflight=false",
                 "--set", "train.verbose=0"])
    captured = capsys.readouterr()
    assert code == 3, captured.err[-2000:]
    summary = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    assert summary["status"] == "accuracy budget missed" and summary["ship"] == "saved_model"
    int8 = summary["artifacts"]["tflite_int8"]
    assert not int8["verified"] and summary["artifacts"]["saved_model"]["verified"]
    assert summary["artifacts"]["saved_model"]["accuracy"] - int8["accuracy"] > 0.01
    assert (tmp_path / "quickstart" / "export" / "model.tflite").exists()
    assert "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1].startswith(
        "tftrain: accuracy budget missed: tflite_int8: accuracy ")
    assert "saved_model (export/saved_model/) is the best within the budget" in captured.err
    assert any(l.startswith("ship ") and "saved_model (export/saved_model/)" in l
               for l in unwrapped(captured.out))
