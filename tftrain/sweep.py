"""`python -m tftrain.sweep CONFIG --space SPACE.yaml --trials N`: a hyperparameter sweep.

Each trial is a `tftrain.run` process of its own (a strategy cannot be created twice in
one process) with the trial's values as `--set` overrides, or a `tftrain.launch` of
several workers (`--workers K`); where no GPU is visible it is forked from the sweep,
which imports TensorFlow once (`tftrain.runtime.forking`). Optuna samples with TPE and
prunes with the median rule on the per-epoch validation metric the trial writes to its
metrics.csv (a pruned trial gets SIGTERM, stops at a safe point). `DIR/NAME/study.db`
holds the study: rerunning the command resumes the sweep, never rerunning a finished
trial; one cut short runs again with the same values, resuming its own checkpoints.

SPACE.yaml:
    metric: val_accuracy          # a per-epoch metric of metrics.csv and summary.json
    direction: maximize           # or minimize
    pruner: {warmup_epochs: 2, startup_trials: 3}     # median pruning; `pruner: none`
    seed: 0
    params:                       # dotted config keys
      train.optimizer.learning_rate: {low: 1.0e-4, high: 1.0e-2, log: true}
      train.epochs: {low: 5, high: 20, int: true}
      model.params.dense: {choices: [[64], [128]]}

Writes `DIR/NAME/trials.csv` and `DIR/NAME/best.yaml` (CONFIG with the best values) and
prints the table. Exit codes as `tftrain.run`: 2 for a bad space, config or arguments.
"""
from __future__ import annotations

import argparse
import csv
import fcntl
import hashlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import yaml

from tftrain.core import console, exit_codes
from tftrain.core.config_types import ConfigError
from tftrain.core.extras import missing
from tftrain.launch import local_gpus, worker_setup
from tftrain.runtime import forking


class NoTrialCompleted(RuntimeError):
    """Every trial failed, was pruned or refused its values."""


def parse_space(path: Path) -> dict:
    """The space file, checked: a clear `ConfigError` for anything malformed."""
    from tftrain.config.loading import parse_yaml

    try:
        space = parse_yaml(path.read_text(), "--space") or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"--space: cannot read {path}: {err}") from None
    unknown = set(space) - {"metric", "direction", "pruner", "seed", "params"}
    if unknown:
        raise ConfigError(f"--space: unknown key(s) {sorted(unknown)}; expected metric, "
                          "direction, pruner, seed, params")
    if space.get("direction", "maximize") not in ("maximize", "minimize"):
        raise ConfigError("--space direction: expected maximize or minimize")
    params = space.get("params")
    if not isinstance(params, dict) or not params:
        raise ConfigError("--space params: give at least one dotted config key with "
                          "{low, high[, log, int]} or {choices: [...]}")
    for key, dist in params.items():
        ok = isinstance(dist, dict) and (
            (set(dist) == {"choices"} and isinstance(dist["choices"], list) and dist["choices"])
            or ({"low", "high"} <= set(dist) <= {"low", "high", "log", "int"}
                and all(isinstance(dist[k], (int, float)) for k in ("low", "high"))
                and dist["low"] < dist["high"]))
        if not ok:
            raise ConfigError(f"--space params.{key}: expected {{low, high[, log, int]}} with "
                              "low < high, or {choices: [...]}")
    pruner = space.get("pruner", {})
    if pruner != "none" and not (isinstance(pruner, dict)
                                 and set(pruner) <= {"warmup_epochs", "startup_trials"}):
        raise ConfigError("--space pruner: expected {warmup_epochs, startup_trials} or none")
    return {"metric": "val_accuracy", "direction": "maximize", "seed": 0, **space,
            "pruner": pruner}


def _suggest(trial, key: str, dist: dict):
    if "choices" in dist:
        index = trial.suggest_categorical(key, list(range(len(dist["choices"]))))
        return dist["choices"][index]
    suggest, kind = (trial.suggest_int, int) if dist.get("int") else (trial.suggest_float, float)
    return suggest(key, kind(dist["low"]), kind(dist["high"]), log=dist.get("log", False))


def overrides(values: dict) -> list[str]:
    """`--set` items for a trial's values (YAML flow values)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def _trial_name(values: dict) -> str:
    """Named by its values: a trial cut short and run again resumes its own run directory."""
    return "trial-" + hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]


class Sweep:
    def __init__(self, config: str, space: dict, trials: int, directory: Path, sets: list[str],
                 workers: int = 1):
        import optuna

        self.config, self.space, self.trials, self.sets = config, space, trials, sets
        self.directory, self.workers = directory, workers
        directory.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        pruner = (optuna.pruners.NopPruner() if space["pruner"] == "none" else
                  optuna.pruners.MedianPruner(
                      n_startup_trials=space["pruner"].get("startup_trials", 3),
                      n_warmup_steps=space["pruner"].get("warmup_epochs", 2)))
        # one sweep at a time creates the database: two creating it at once race on its
        # schema (alembic's version row: UNIQUE constraint failed)
        with open(directory / "study.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.study = optuna.create_study(
                study_name="sweep", storage=f"sqlite:///{directory / 'study.db'}",
                load_if_exists=True, direction=space["direction"], pruner=pruner,
                sampler=optuna.samplers.TPESampler(seed=space["seed"]))

    def run(self) -> dict:
        """Run trials until `trials` have ended; returns the best trial's values. Other
        sweeps may run on the same study at the same time: each trial is trained once."""
        import optuna
        from optuna.trial import TrialState

        # trials forked from here where no GPU is visible (`tftrain.runtime.forking`)
        self.fork = forking.forks("auto", local_gpus())
        if self.fork:
            forking.preload("tftrain.run")
        for cut in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if _alive(cut):
                continue                       # another sweep's, running now
            self.study.tell(cut.number, state=TrialState.FAIL)        # cut short: run again
            self.study.enqueue_trial(cut.params)
            print(f"trial {cut.number} was cut short: it runs again with the same values")
        while self.ended() < self.trials:
            trial = self.study.ask()
            _beat(trial)                       # owned at once: see `_alive`
            values = {k: _suggest(trial, k, d) for k, d in self.space["params"].items()}
            trial.set_user_attr("run", str(self.directory / "runs" / _trial_name(values)))
            twin = self._twin(trial, values)
            if twin is not None:               # trained by another trial: its result
                self._tell_as(trial, twin)
                continue
            try:
                value = self._run_trial(trial, values)
                self.study.tell(trial, value, state=TrialState.COMPLETE if value is not None
                                else TrialState.FAIL)
            except optuna.TrialPruned:
                self.study.tell(trial, state=TrialState.PRUNED)
                print(f"trial {trial.number} pruned", flush=True)
            except ConfigError:
                self.study.tell(trial, state=TrialState.FAIL)
                raise
            self.write_table()                 # after every trial, however it ended
        return self.best()

    def _twin(self, trial, values: dict):
        """An earlier trial with the same values (a sweep beside this one, seeded alike,
        or the sampler repeating itself), finished or running now: waited for, never
        trained twice (the earlier trial trains; the later never waits for a later one, so
        two sweeps cannot wait for each other). None when there is none."""
        from optuna.trial import TrialState

        def same(t):
            return t.number < trial.number and "run" in t.user_attrs and \
                set(t.params) == set(values) and self._values(t) == values and \
                t.state != TrialState.FAIL
        while True:
            found = [t for t in self.study.get_trials(deepcopy=False) if same(t)]
            done = [t for t in found if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
            if done:
                return done[0]
            if not any(t.state == TrialState.RUNNING and _alive(t) for t in found):
                return None
            _beat(trial)
            time.sleep(1.0)

    def _tell_as(self, trial, twin) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("same_as", twin.number)
        trial.set_user_attr("run", twin.user_attrs["run"])
        print(f"trial {trial.number}: the values of trial {twin.number}, not trained again",
              flush=True)
        if twin.state == TrialState.COMPLETE:
            self.study.tell(trial, twin.value)
        else:
            self.study.tell(trial, state=twin.state)
        self.study.sampler.reseed_rng()       # a sweep seeded alike: sample elsewhere now
        self.write_table()

    def ended(self) -> int:
        """Trials that ran to their end: completed, pruned, or failed on their own (not
        cut short by an interruption: those run again); and the trials other sweeps on
        the same study are running now (they will end there)."""
        return sum(1 for t in self.study.get_trials(deepcopy=False)
                   if t.state.name in ("COMPLETE", "PRUNED")
                   or (t.state.name == "FAIL" and "exit_code" in t.user_attrs)
                   or (t.state.name == "RUNNING" and t.user_attrs.get("owner") != OWNER
                       and _alive(t)))

    def command(self, values: dict) -> tuple[str, list[str]]:
        """The trial's module (`tftrain.run`, or `tftrain.launch` for several workers) and
        its arguments."""
        sets = [*self.sets, *overrides(values), f"run.dir={self.directory / 'runs'}",
                f"run.name={_trial_name(values)}", "train.verbose=0"]
        module, head = (("tftrain.run", []) if self.workers == 1 else
                        ("tftrain.launch", ["--workers", str(self.workers)]))
        return module, [*head, self.config, *[a for s in sets for a in ("--set", s)]]

    def _run_trial(self, trial, values: dict):
        import optuna

        name = _trial_name(values)
        run_path = self.directory / "runs" / name
        trial.set_user_attr("run", str(run_path))
        print(f"trial {trial.number}: {' '.join(overrides(values))}", flush=True)
        log = open(self.directory / f"{name}.log", "a")
        module, args = self.command(values)
        proc = forking.start(module, args, fork=self.fork, stdout=log,
                             setup=lambda: worker_setup(None))
        reported = -1
        while True:
            _beat(trial)
            done = proc.poll() is not None
            for epoch, value in self._epochs(run_path):
                if epoch > reported:
                    trial.report(value, epoch)
                    reported = epoch
                    if trial.should_prune() and not done:
                        os.killpg(proc.pid, signal.SIGTERM)    # stops at a safe point
                        proc.wait()
                        raise optuna.TrialPruned()
            if done:
                break
            time.sleep(0.5)
        log.close()
        trial.set_user_attr("exit_code", proc.returncode)
        if proc.returncode == exit_codes.CONFIG:       # e.g. a builder refusing a sampled value
            refused = [line.removeprefix("tftrain: config error: ") for line in
                       Path(log.name).read_text().splitlines()
                       if line.startswith("tftrain: config error: ")]
            trial.set_user_attr("refused", refused[0] if refused else "")
            print(f"trial {trial.number} refused its values ({' '.join(overrides(values))}): "
                  f"{refused[0] if refused else 'see ' + log.name}; the sweep goes on", flush=True)
            return None
        if proc.returncode != 0:
            print(f"trial {trial.number} failed (exit {proc.returncode}); see {log.name}")
            return None
        metrics = json.loads((run_path / "summary.json").read_text())["metrics"]
        if self.space["metric"] not in metrics:
            raise ConfigError(f"--space metric: {self.space['metric']} is not one of the run's "
                              f"metrics ({', '.join(metrics)})")
        return float(metrics[self.space["metric"]])

    def _epochs(self, run_path: Path) -> list[tuple[int, float]]:
        try:
            rows = list(csv.DictReader(open(run_path / "metrics.csv")))
        except OSError:
            return []
        metric = self.space["metric"]
        return [(int(r["epoch"]), float(r[metric])) for r in rows if r.get(metric)]

    def best(self) -> dict:
        from tftrain.config import dump_config, load_config

        done = [t for t in self.study.trials if t.state.name == "COMPLETE"]
        if not done:
            raise NoTrialCompleted("no trial completed; see trials.csv and the trial logs in "
                                   + str(self.directory))
        trial = self.study.best_trial
        values = self._values(trial)
        cfg = load_config(self.config, [*self.sets, *overrides(values)])
        (self.directory / "best.yaml").write_text(
            f"# best of {len(done)} completed trials: trial {trial.number}, "
            f"{self.space['metric']} {trial.value:.4f}\n" + dump_config(cfg))
        return {"trial": trial.number, "value": trial.value, "values": values}

    def _values(self, trial) -> dict:
        return {k: d["choices"][trial.params[k]] if "choices" in d else trial.params[k]
                for k, d in self.space["params"].items()}

    def write_table(self) -> None:
        keys = list(self.space["params"])
        rows = []
        for t in self.study.trials:
            if t.state.name == "RUNNING" or not set(keys) <= set(t.params):
                continue
            values = self._values(t)
            state = t.state.name.lower()
            if state == "fail" and "exit_code" not in t.user_attrs:
                state = "cut short"                  # ran again as a later trial
            elif "refused" in t.user_attrs:
                state = "refused"                    # tftrain.run refused the values
            elif "same_as" in t.user_attrs:
                state = f"{state} (trial {t.user_attrs['same_as']})"   # not trained again
            rows.append({"trial": t.number, "state": state, **values,
                         self.space["metric"]: "" if t.value is None else f"{t.value:.4f}",
                         "epochs": len(t.intermediate_values),
                         "seconds": f"{(t.datetime_complete - t.datetime_start).total_seconds():.0f}"
                         if t.datetime_complete else ""})
        with open(self.directory / "trials.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["trial", "state", *keys, self.space["metric"], "epochs",
                                        "seconds"])
            writer.writeheader()
            writer.writerows(rows)


OWNER = f"{socket.gethostname()}:{os.getpid()}"     # this sweep process
BEAT_EVERY, STALE_AFTER = 10.0, 60.0


def _beat(trial) -> None:
    """Mark `trial` as this sweep's and alive now (every BEAT_EVERY seconds at most)."""
    now = time.time()
    if trial.user_attrs.get("owner") != OWNER:
        trial.set_user_attr("owner", OWNER)
    if now - trial.user_attrs.get("beat", 0.0) >= BEAT_EVERY:
        trial.set_user_attr("beat", now)


def _alive(trial) -> bool:
    """Whether a RUNNING trial is run: its owner alive here, a recent beat, or just asked."""
    owner = trial.user_attrs.get("owner", "")
    if not owner and trial.datetime_start is not None:
        return time.time() - trial.datetime_start.timestamp() < STALE_AFTER
    host, _, pid = owner.rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return time.time() - trial.user_attrs.get("beat", 0.0) < STALE_AFTER


def check_values(config: str, space: dict, sets: list[str]) -> None:
    """Every key of the space must be a config key taking such values: checked with the
    low end (or first choice) of each, before any trial runs."""

    first = {k: d["choices"][0] if "choices" in d else (int(d["low"]) if d.get("int") else d["low"])
             for k, d in space["params"].items()}
    from tftrain.config import load_config
    load_config(config, sets)           # the sweep's own --set first: blamed on --set
    try:
        load_config(config, [*sets, *overrides(first)])
    except ConfigError as err:
        raise ConfigError(*[f"--space params (tried with {', '.join(overrides(first))}): "
                            f"{p.removeprefix('--set: ')}" for p in err.problems]) from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tftrain.sweep", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--space", required=True, help="SPACE.yaml: the parameters and their ranges")
    p.add_argument("--trials", type=int, required=True, help="trials to run in all")
    p.add_argument("--dir", default="sweeps", help="parent directory of the sweep")
    p.add_argument("--name", help="the sweep's name (default: the space file's stem)")
    p.add_argument("--workers", type=int, default=1, help="workers per trial (tftrain.launch)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key in every trial (repeatable)")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exit_:
        return exit_codes.CONFIG if exit_.code else exit_codes.OK
    try:
        if args.trials < 1 or args.workers < 1:
            raise ConfigError("--trials and --workers: at least 1")
        if missing("optuna"):
            raise ConfigError('python -m tftrain.sweep needs optuna: pip install -e ".[sweep]"')
        space = parse_space(Path(args.space))
        check_values(args.config, space, args.set)
        sweep = Sweep(args.config, space, args.trials,
                      Path(args.dir) / (args.name or Path(args.space).stem), args.set, args.workers)
        best = sweep.run()
    except ConfigError as err:
        for problem in err.problems:
            print(console.problem("tftrain: config error: ", problem), file=sys.stderr)
        return exit_codes.CONFIG
    except NoTrialCompleted as err:
        print(f"tftrain: sweep: {err}", file=sys.stderr)
        return exit_codes.RUNTIME
    print((sweep.directory / "trials.csv").read_text())
    print(f"best: trial {best['trial']}, {space['metric']} {best['value']:.4f}: "
          f"{' '.join(overrides(best['values']))}; config in {sweep.directory / 'best.yaml'}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
