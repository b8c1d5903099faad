"""Sweeps: the space file checked, trials as tftrain.run subprocesses, median pruning, and
an interrupted sweep resumed without rerunning a finished trial."""

import csv
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, start_run

from tftrain import sweep
from tftrain.config import ConfigError

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
TINY = ["train.epochs=3", "export.tflite=none", "export.saved_model=false",
        "model.params={filters: [8], dense: [16]}"]


def run_sweep(*args) -> str:
    """`python -m tftrain.sweep ...` forked from the fork server (TensorFlow imported, no op
    run), so it forks its trials as a sweep started fresh does; its output."""
    proc = start_run(*args, module="tftrain.sweep", stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def write_space(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text,problem", [
    ("params: {}", "--space params: give at least one"),
    ("params: {train.epochs: {low: 5, high: 2}}", "--space params.train.epochs: expected"),
    ("params: {a: {choices: []}}", "--space params.a: expected"),
    ("direction: up\nparams: {a: {choices: [1]}}", "--space direction: expected maximize"),
    ("metrics: val_loss\nparams: {a: {choices: [1]}}", "--space: unknown key(s) ['metrics']"),
    ("pruner: {patience: 2}\nparams: {a: {choices: [1]}}", "--space pruner: expected"),
])
def test_a_malformed_space_is_a_config_error(tmp_path, text, problem):
    with pytest.raises(ConfigError) as err:
        sweep.parse_space(write_space(tmp_path, text))
    assert err.value.problems[0].startswith(problem), err.value.problems


def test_defaults_and_overrides():
    space = sweep.parse_space(ROOT / "configs" / "spaces" / "quickstart.yaml")
    assert space["metric"] == "val_accuracy" and space["direction"] == "maximize"
    assert sweep.overrides({"train.optimizer.learning_rate": 0.001, "model.params.dense": [64]}) \
        == ["train.optimizer.learning_rate=0.001", "model.params.dense=[64]"]


def test_a_key_the_config_refuses_exits_2_before_any_trial(tmp_path, capsys):
    space = write_space(tmp_path, "params: {train.optimiser.learning_rate: {low: 0.001, high: 0.01}}")
    code = sweep.main([QUICKSTART, "--space", str(space), "--trials", "2", "--dir", str(tmp_path)])
    assert code == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["space.yaml"]
    assert capsys.readouterr().err == (
        "tftrain: config error: --space params (tried with train.optimiser.learning_rate=0.001): "
        "train.optimiser: unknown key; did you mean optimizer?\n")


@pytest.mark.slow
def test_a_trial_far_below_the_median_is_pruned_and_the_best_config_written(tmp_path):
    space = write_space(tmp_path, "pruner: {warmup_epochs: 1, startup_trials: 1}\nparams:\n"
                                  "  train.optimizer.learning_rate: {low: 1.0e-7, high: 0.01, log: true}\n")
    parsed = sweep.parse_space(space)
    study = sweep.Sweep(QUICKSTART, parsed, 2, tmp_path / "space", TINY).study
    for rate in (0.003, 1e-7):                   # a good trial, then a hopeless one
        study.enqueue_trial({"train.optimizer.learning_rate": rate})
    out = run_sweep(QUICKSTART, "--space", space, "--trials", "2", "--dir", tmp_path,
                    *[a for s in TINY for a in ("--set", s)])
    rows = list(csv.DictReader(open(tmp_path / "space" / "trials.csv")))
    assert [(r["state"], float(r["train.optimizer.learning_rate"])) for r in rows] == [
        ("complete", 0.003), ("pruned", 1e-7)]
    assert int(rows[0]["epochs"]) == 3 and int(rows[1]["epochs"]) < 3
    best = (tmp_path / "space" / "best.yaml").read_text()
    assert "learning_rate: 0.003" in best and best.startswith("# best of 1 completed trials: trial 0")
    assert "best: trial 0, val_accuracy" in out


def _state(directory):
    try:
        return list(csv.DictReader(open(directory / "trials.csv")))
    except OSError:
        return []


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_without_rerunning_finished_trials(tmp_path):
    space = write_space(tmp_path, "pruner: none\nparams:\n"
                                  "  train.optimizer.learning_rate: {low: 0.001, high: 0.01, log: true}\n")
    sets = [*TINY, "train.epochs=6"]
    args = [sys.executable, "-m", "tftrain.sweep", QUICKSTART, "--space", str(space),
            "--trials", "2", "--dir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    directory = tmp_path / "space"
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not _state(directory):         # trial 0 finished
        time.sleep(0.5)
    first = _state(directory)
    assert len(first) == 1 and first[0]["state"] == "complete"
    runs = directory / "runs"
    while time.time() < deadline and not [p for p in runs.glob("*/checkpoints/checkpoint")
                                          if p.parent.parent.name != first_run(directory)]:
        time.sleep(0.5)                           # trial 1 saved its first checkpoint
    proc.send_signal(signal.SIGKILL)              # the sweep dies mid-trial 1
    proc.communicate(timeout=60)
    done_summary = runs / first_run(directory) / "summary.json"
    stamp = done_summary.stat().st_mtime_ns
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trial 1 was cut short: it runs again with the same values" in again.stdout
    assert "trial 0:" not in again.stdout and done_summary.stat().st_mtime_ns == stamp
    rows = _state(directory)
    assert [(r["trial"], r["state"]) for r in rows] == [("0", "complete"), ("1", "cut short"),
                                                        ("2", "complete")]
    assert rows[1]["train.optimizer.learning_rate"] == rows[2]["train.optimizer.learning_rate"]
    cut = runs.parent / (sorted(p.name for p in runs.iterdir() if p.name != first_run(directory))[0]
                         + ".log")
    assert "resuming from" in cut.read_text()     # the cut trial's run continued from its checkpoint


def first_run(directory) -> str:
    row = _state(directory)[0]
    return sweep._trial_name({"train.optimizer.learning_rate": float(row["train.optimizer.learning_rate"])})


@pytest.mark.slow
def test_trials_of_two_workers_run_through_the_launcher(tmp_path):
    """In this process, which has run TensorFlow ops, the sweep starts its trial fresh (a
    launcher, which forks its two workers)."""
    space = write_space(tmp_path, "pruner: none\nparams:\n"
                                  "  train.optimizer.learning_rate: {low: 0.001, high: 0.01, log: true}\n")
    args = [QUICKSTART, "--space", str(space), "--trials", "1", "--workers", "2", "--dir", str(tmp_path),
            *[a for s in [*TINY, "train.epochs=1", "distribute.strategy=auto",
                          "distribute.virtual_cpus=1"] for a in ("--set", s)]]     # 1 replica each
    assert sweep.main(args) == 0
    rows = _state(tmp_path / "space")
    assert [r["state"] for r in rows] == ["complete"] and float(rows[0]["val_accuracy"]) > 0.2
    log = next((tmp_path / "space").glob("trial-*.log")).read_text()
    assert "[worker 0] strategy: multi_worker   replicas: 2   workers: 2" in log
    assert "[worker 1]" in log


@pytest.mark.slow
def test_a_value_the_builder_refuses_fails_that_trial_and_the_sweep_goes_on(tmp_path):
    """A sampled value that passes the config schema but that the model builder refuses
    (exit 2 from the trial) ends that trial as refused, not the sweep."""
    space = write_space(tmp_path, "pruner: none\nparams:\n  model.params.pool: {choices: [max, median]}\n")
    study = sweep.Sweep(QUICKSTART, sweep.parse_space(space), 2, tmp_path / "space", TINY).study
    study.enqueue_trial({"model.params.pool": 1})         # median: cnn refuses it
    study.enqueue_trial({"model.params.pool": 0})
    out = run_sweep(QUICKSTART, "--space", space, "--trials", "2", "--dir", tmp_path,
                    *[a for s in [*TINY, "train.epochs=1"] for a in ("--set", s)])
    rows = _state(tmp_path / "space")
    assert [(r["state"], r["model.params.pool"]) for r in rows] == [("refused", "median"),
                                                                      ("complete", "max")]
    assert "trial 0 refused its values (model.params.pool=\"median\"): " in out
    assert "model.params: cnn rejected" in out


@pytest.mark.slow
def test_two_sweeps_on_one_study_train_each_trial_once(tmp_path):
    """Two sweep processes on the same study directory, seeded alike: neither fails the
    other's running trial, together they end the trials asked for, and no trial directory
    is trained twice (a repeated value waits for the trial that trains it)."""
    space = write_space(tmp_path, "pruner: none\nseed: 3\nparams:\n"
                                  "  train.optimizer.learning_rate: {choices: [0.001, 0.003, 0.01]}\n")
    args = [sys.executable, "-m", "tftrain.sweep", QUICKSTART, "--space", str(space), "--trials", "3",
            "--dir", str(tmp_path), *[a for s in [*TINY, "train.epochs=2"] for a in ("--set", s)]]
    procs = [subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    rows = _state(tmp_path / "space")
    assert len(rows) >= 3 and all(r["state"].startswith("complete") for r in rows), rows
    trained = [r for r in rows if "(trial" not in r["state"]]
    assert len({r["train.optimizer.learning_rate"] for r in trained}) == len(trained)
    for run in (tmp_path / "space" / "runs").iterdir():          # each trained once, whole
        epochs = [line.split(",")[0] for line in (run / "metrics.csv").read_text().splitlines()[1:]]
        assert epochs == ["0", "1"], (run, epochs)
        assert "resuming from" not in (tmp_path / "space" / f"{run.name}.log").read_text()
    assert len(list((tmp_path / "space" / "runs").iterdir())) == len(trained)


def test_a_trial_just_asked_by_another_sweep_is_not_taken_for_one_cut_short():
    """Between `ask` and its first beat a trial has no owner: a sweep starting then must
    not fail it and run it again (two sweeps on one study raced on this), but an unowned
    trial begun long ago is cut short."""
    import datetime

    import optuna

    from tftrain import sweep

    study = optuna.create_study()
    study.ask()
    frozen, = study.get_trials(deepcopy=True)
    assert not frozen.user_attrs.get("owner") and sweep._alive(frozen)
    frozen.datetime_start -= datetime.timedelta(seconds=sweep.STALE_AFTER + 1)
    assert not sweep._alive(frozen)
