"""`python -m tftrain.run CONFIG`: the whole pipeline, top to bottom.

config -> plan -> strategy -> precision -> data -> model -> optimizer -> fit ->
evaluate -> export -> verify -> summary.json and a report table.

Exit codes (`tftrain.core.exit_codes`): 0 done, 2 bad config or arguments, 1 runtime
failure (a failed export check and an incoherent package stack included), 3 a budget
missed with something to ship (an artifact beyond export.max_accuracy_drop, every file
kept and the best within budget named), 42 stopped by SIGTERM or SIGINT at a safe point
(rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback

import tftrain  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
from tftrain import doctor
from tftrain.config import Config, ConfigError, json_schema, load_config
from tftrain.core import console, exit_codes, native_log
from tftrain.training.preemption import Preempted, Preemption

EXIT_CONFIG, EXIT_RUNTIME, EXIT_PREEMPTED = exit_codes.CONFIG, exit_codes.RUNTIME, exit_codes.PREEMPTED
EXIT_TARGET_MISSED = exit_codes.TARGET_MISSED


# the modules a run imports once its config has parsed (a typo, `--help` and `--dry-run`
# load no TensorFlow): a process that forks runs (`tftrain.launch`'s workers, a sweep's
# or search's trials) imports them once, before forking (`runtime.forking.preload`),
# rather than each child on its first run (tfmot, under the exports: about 1 s of CPU);
# TensorFlow and tf_keras `preload` imports first
PRELOAD = ("tftrain.plan", "tftrain.report", "tftrain.stages", "tftrain.export.exports",
           "tftrain.training.board", "tftrain.training.report_page", "tftrain.training.tracking")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"arguments: {message}; see python -m tftrain.run --help")


EPILOG = """examples:
  python -m tftrain.run configs/quickstart.yaml                       train, export, report
  python -m tftrain.run configs/quickstart.yaml --dry-run             the plan, in a second
  python -m tftrain.run configs/quickstart.yaml --smoke               a few batches per stage
  python -m tftrain.run configs/compress.yaml --set train.epochs=3    any key, by dotted path
  python -m tftrain.run my.yaml --set "model={name: 'file:model.keras'}" --set train.epochs=0
  python -m tftrain.run --schema > tftrain.schema.json                editor completion

exit codes:
  0   done (the run directory holds summary.json and report.html)
  1   runtime failure (a bug in your builder or dataset function keeps its traceback; an
      exported artifact failing its check; an incoherent package stack)
  2   bad config or arguments: one line per problem, nothing written
  3   a budget missed with something to ship: an artifact beyond export.max_accuracy_drop
      (every file kept, the best within budget named)
  42  stopped by SIGTERM or SIGINT after saving a checkpoint: rerun the same command

Running the same command again resumes an interrupted run; docs/config.md lists every key."""


def parse_args(argv):
    p = _Parser(prog="python -m tftrain.run", description=__doc__.splitlines()[0],
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path (repeatable)")
    p.add_argument("--run-dir", help="parent directory of the run (overrides run.dir)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan from the config and exit, before TensorFlow loads")
    p.add_argument("--full", action="store_true",
                   help="with --dry-run: build the model and plan its memory too")
    p.add_argument("--preflight", action="store_true",
                   help="with --dry-run: the full plan and the export preflight")
    p.add_argument("--smoke", action="store_true",
                   help="whole pipeline on train.smoke_steps batches per stage, with the "
                        "configured strategy, in RUN.NAME-smoke/")
    p.add_argument("--schema", action="store_true", help="print the config JSON Schema")
    p.add_argument("--profile", metavar="START:STOP",
                   help="profiler trace of training updates START to STOP into tensorboard/")
    p.add_argument("--verbose", action="store_true",
                   help="keep TensorFlow's native start-up and converter lines on stderr")
    return p.parse_args(argv)


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.schema:
            print(json.dumps(json_schema(), indent=2))
            return exit_codes.OK
        if not args.config:
            raise ConfigError("arguments: CONFIG is required, e.g. python -m tftrain.run "
                              "configs/quickstart.yaml")
        overrides = args.set + ([f"run.dir={args.run_dir}"] if args.run_dir else [])
        cfg = load_config(args.config, overrides)
        doctor.check_stack()            # versions only: an incoherent stack fails here
        if args.verbose:
            os.environ["TFTRAIN_VERBOSE"] = "1"
        else:
            native_log.python_warnings_held()
        profile = None
        if args.profile:
            from tftrain.training.profiling import parse_window
            profile = parse_window(args.profile)
        if args.dry_run and not (args.full or args.preflight):
            from tftrain.plan import sketch
            for line in sketch(cfg, args.smoke).splitlines():
                console.say(line)
            return exit_codes.OK
        if args.dry_run and not args.preflight:      # --full: all but the export preflight
            cfg = load_config(args.config, overrides + ["export.preflight=false"])
        with Preemption() as stop:      # SIGTERM/SIGINT from here on: stop at a safe point
            run(cfg, dry_run=args.dry_run, smoke=args.smoke, stop=stop, profile=profile)
        return exit_codes.OK
    except ConfigError as err:
        for problem in err.problems:
            print(console.problem("tftrain: config error: ", problem), file=sys.stderr)
        return EXIT_CONFIG
    except doctor.StackError as err:
        print(f"tftrain: environment: {err}", file=sys.stderr)
        return EXIT_RUNTIME
    except Preempted as err:
        print(f"tftrain: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except BudgetMissed as err:
        print(f"tftrain: {err}", file=sys.stderr)
        return EXIT_TARGET_MISSED
    except KeyboardInterrupt:
        print("tftrain: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_RUNTIME
    except Exception as err:  # runtime failure: one clear line, details after it
        traceback.print_exc()
        print(f"tftrain: error: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_RUNTIME


def run(cfg: Config, dry_run: bool = False, smoke: bool = False,
        stop: Preemption | None = None, profile: tuple[int, int] | None = None) -> dict | None:
    """Run the pipeline for `cfg`; returns the summary (None for a dry run). `stop`: the
    flag SIGTERM/SIGINT set (`with Preemption() as stop`); the run raises `Preempted` at
    the next safe point after it is set; by default one is installed for the run."""
    from tftrain.training import rundir

    done = None if dry_run else rundir.completed(cfg, smoke)   # files only: no TensorFlow yet
    if done is not None:
        return _completed(cfg, smoke, done)
    if not dry_run:                # a JobSet pod: its peers answer before TensorFlow starts
        from tftrain.runtime.cluster import await_peers
        waited = await_peers(cfg.distribute.peer_wait)
        if waited:
            print(waited, flush=True)
    from tftrain.core.native_log import quiet
    with quiet():                  # TensorFlow's native start-up lines held back
        import tensorflow  # noqa: F401
        from tftrain.core.keras import keras  # noqa: F401
    from tftrain.plan import process_settings_kept
    with process_settings_kept():         # the caller's process is as it was afterwards
        if stop is None:
            with Preemption() as stop:
                return _pipeline(cfg, dry_run, smoke, stop, profile)
        return _pipeline(cfg, dry_run, smoke, stop, profile)


def _completed(cfg: Config, smoke: bool, done: dict) -> dict:
    """A completed run, given its own config again: reported, not retrained."""
    from tftrain.runtime.cluster import current_task
    from tftrain.training import rundir
    from tftrain.training.report_table import report_table

    path = rundir.run_path(cfg, smoke)
    print(f"{path} already completed; use another run.name to train again")
    if cfg.tracking.mlflow is not None:          # what the tracker missed, logged now
        from tftrain.training import tracking
        tracking.finish_pending(cfg, path, done, current_task().chief)
    print(report_table(done))
    return done


def _pipeline(cfg: Config, dry_run: bool, smoke: bool, stop: Preemption,
              profile: tuple[int, int] | None) -> dict | None:
    # TensorFlow is imported only once the config has parsed: a typo costs no TF start-up
    from tftrain.core.native_log import quiet
    from tftrain import report
    from tftrain import plan as planning
    from tftrain.core import extras
    import yaml

    from tftrain.config import dump_config
    from tftrain.export import exports, kinds, verification
    from tftrain.export.context import ExportFlags
    from tftrain.training import board, report_page, rundir, tracking
    from tftrain.training.report_table import report_table
    from tftrain.stages import StageRunner

    extras.require(cfg)                   # a missing optional package: config error, exit 2

    # -- plan: devices, strategy, precision, data, batches, stages (nothing written yet) --
    began = time.perf_counter()
    console.PHASE_SECONDS.clear()         # the summary's phases are this run's own
    with console.phase("plan", "devices, data, model, stages and exports"):
        plan = planning.make(cfg, smoke=smoke, stop=stop)
    for line in plan.describe().splitlines():
        console.say(line)
    if dry_run:
        return None

    # -- run directory -----------------------------------------------------------------------
    topology = plan.topology()
    run = rundir.open_run_dir(cfg, smoke, write=plan.chief, topology=topology)
    if run.previous is not None and run.previous != topology:
        print(f"resuming on a different topology: {rundir.describe_topology(run.previous)} -> "
              f"{rundir.describe_topology(topology)}", flush=True)
    tracker = tracking.open_tracker(cfg, run.path, rundir.dump_config(cfg), plan.chief)
    runner = StageRunner(plan=plan, run=run, stop=stop, profile=profile, tracker=tracker)
    try:
        # -- stages: train -> prune (+ fine-tune) -> QAT, each checkpointed and resumable ----
        net, results, float_net = None, {}, None
        for stage in plan.stages:          # each gets the model the one before finished with
            net, results[stage.name] = runner.run_stage(stage, net)
            float_net = net if not stage.quantization_aware else float_net

        # -- export, verify, report --------------------------------------------------------
        stop.check("after the last stage", runner.agree)
        from tftrain.compress.quantization import clone
        net = plan.parallel.detach(net, clone)      # a model the chief can run alone
        qat = plan.qat
        made = kinds.enabled(cfg, qat)
        if qat and any(kind.runtime == "keras3" for kind in made):   # (every worker joins)
            float_net = plan.parallel.detach(float_net)      # the model before QAT, handed back
        titles = ", ".join(kind.title for kind in made)
        doing = "converting and checking" if smoke else "converting, checking and timing"
        with (console.phase("export", f"{titles}: {doing} each")
              if plan.chief and made else contextlib.nullcontext()) as note, quiet():
            # (quiet: the converters' and LiteRT's notices). A smoke run checks, it does
            # not measure: its accuracy is noise (judged by logits) and it is not timed
            artifacts = exports.export_all(
                net, cfg, run.export, plan.training_source,
                ExportFlags(qat=qat, by_labels=not smoke, timed=not smoke),
                float_model=float_net if qat else None) if plan.chief else {}
            if note is not None:
                note["detail"] = (f"{sum(a.get('verified', True) for a in artifacts.values())} "
                                  f"of {len(artifacts)} verified")
        if plan.chief:    # the export's figures, each int8 artifact's layers as curves
            board.write_export(run.path / "tensorboard" / board.EXPORT, artifacts)
        stop.check("after the export (the rerun exports again and reports)", runner.agree)
    except BaseException:
        tracker.fail()     # (never raises) a restart sets the same tracked run running
        raise
    summary = report.summary(plan, results, artifacts, net)
    summary["seconds"] = time.perf_counter() - began        # this session, from the plan
    summary["phase_seconds"] = {k: round(v, 2) for k, v in console.PHASE_SECONDS.items()}
    summary["run_dir"] = str(run.path)
    if runner.batch_changes:       # resumes that changed the global batch: not exact
        summary["batch_changes"] = runner.batch_changes
    print(f"final weights sha256: {report.weights_digest(net)}")
    if plan.chief:
        summary["report"] = report_page.NAME
        rundir.write_summary(run, summary)
        board.write_hparams(run.path / "tensorboard" / board.HPARAMS,   # compared across runs
                            yaml.safe_load(dump_config(cfg)), summary.get("metrics", {}),
                            run.path.name)
        report_page.write(run.path, summary)      # report.html: the run's charts
    runner.clean_up()
    failed = verification.failures(artifacts)
    tracker.finish(summary, run.export, ok=not failed)      # never raises: a rerun retries
    print(report_table(summary))
    if failed and summary["status"] == exit_codes.BUDGET_MISSED:   # works, loses too much
        raise BudgetMissed(failed, summary)
    if failed:     # the artifacts stay, marked failed; the run is not completed
        raise ExportFailed(failed, summary)
    return summary


class ExportFailed(RuntimeError):
    """The run trained and exported, but an artifact failed its verification: `failed`
    (one line per artifact) and the run's `summary` (written to summary.json, status
    "export verification failed"). The CLI exits 1 with it."""

    def __init__(self, failed: list[str], summary: dict):
        super().__init__(f"export verification failed: {'; '.join(failed)}; the artifact is "
                         "marked failed in summary.json (loosen export.max_logit_diff or "
                         "export.max_accuracy_drop only if the difference is expected)")
        self.failed, self.summary = list(failed), summary


class BudgetMissed(ExportFailed):
    """Every artifact works, but one loses more accuracy than `export.max_accuracy_drop`
    allows (after `export.int8_fallback`): all are kept, `summary["ship"]` names the best
    within the budget (`verification.best_within_budget`). The CLI exits 3."""

    def __init__(self, failed: list[str], summary: dict):
        ship = summary.get("ship")
        RuntimeError.__init__(
            self, f"accuracy budget missed: {'; '.join(failed)}; every artifact is kept, "
            + (f"{ship} ({rundir_path(ship)}) is the best within the budget"
               if ship else "none is within the budget")
            + " (a compression search finds one that is: python -m tftrain.search RUN_DIR)")
        self.failed, self.summary = list(failed), summary


def rundir_path(name: str) -> str:
    from tftrain.export import kinds
    return kinds.named(name).path


if __name__ == "__main__":
    sys.exit(main())
