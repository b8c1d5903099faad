"""The search: a completed run's dense model compressed to `compression.target`.

Each candidate is a run of its own under `RUN/search/runs/<name>/`, started with the
dense run's config changed by the candidate (`Candidate.config`) and the dense run's
checkpoints of its dense stages (training, a frozen phase, distillation) linked in with
their results: `tftrain.run` then skips those stages as finished and runs only the
candidate's pruning and QAT stages, from the dense weights, and its export. The dense
float file (`float`) runs first: every other file is timed in turn with it
(`export.latency_reference`) and its accuracy is the one the drop is counted from.

`RUN/search/search.json` is written after every candidate: a rerun of the same command
reads it and never fine-tunes a finished candidate again (a candidate cut short resumes
its own checkpoints).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import yaml

from tftrain.config import ConfigError, dump_config, load_config
from tftrain.core import console, exit_codes
from tftrain.export import kinds
from tftrain.search import candidate_runs
from tftrain.search import candidates as cands
from tftrain.search import front, timing

COMPRESSION_STAGES = ("prune", "channels", "qat")
STARTUP_SECONDS = 4.0       # a candidate's own start: imports, devices, data, the plan


def resolved(cfg):
    """`compression.target` with its unset fine-tuning lengths taken from the run's
    config: pruning's epochs when the run pruned (else half its training), QAT's."""
    target, compression = cfg.compression.target, cfg.compression
    tune = target.fine_tune_epochs or (compression.pruning.epochs if compression.pruning.enabled
                                       else max(1, cfg.train.epochs // 2))
    return target.model_copy(update={"fine_tune_epochs": tune, "qat_epochs":
                                     target.qat_epochs or compression.quantization.epochs})


def dense_run(run_dir: Path) -> tuple[dict, dict]:
    """(the dense run's summary, its stage results): a run whose stages all finished."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        stages = json.loads((run_dir / "stages.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise ConfigError(f"RUN_DIR: {run_dir} is not a finished run (no summary.json and "
                          "stages.json); run python -m tftrain.run CONFIG first, then search "
                          "its run directory") from None
    if summary.get("status") not in (exit_codes.COMPLETED, exit_codes.BUDGET_MISSED):
        raise ConfigError(f"RUN_DIR: {run_dir} ended with status {summary.get('status')!r}; "
                          "search a run whose stages finished")
    return summary, stages


class Search:
    def __init__(self, run_dir, target: list[str] = (), sets: list[str] = ()):
        """`target`: `KEY=VALUE` settings of `compression.target`; `sets`: other config
        overrides for every candidate (`--set`)."""
        self.run_dir = Path(run_dir)
        self.summary, stages = dense_run(self.run_dir)
        overrides = [*sets, *(f"compression.target.{t}" for t in target)]
        cfg = load_config(self.run_dir / "config.yaml", overrides)
        self.target = resolved(cfg)
        self.base = yaml.safe_load(dump_config(cfg))
        # the candidates run in this machine's one process: a dense run trained by several
        # workers resumes in them on another topology, keeping its examples per update
        if self.summary.get("workers", 1) > 1:
            self.base["train"]["global_batch_size"] = self.summary["global_batch_size"]
        self.dense_stages = {k: v for k, v in stages.items() if k not in COMPRESSION_STAGES}
        self.dir = self.run_dir / "search"
        self.record_path = self.dir / "search.json"
        try:
            self.record = json.loads(self.record_path.read_text())
        except (OSError, json.JSONDecodeError):
            self.record = {"candidates": {}, "order": []}
        before, now = self.record.get("target"), self.target.model_dump()
        if before is not None and before != now:
            changed = sorted(k for k in now if before.get(k) != now[k])
            raise ConfigError(f"RUN_DIR: {self.dir} holds a search for another target "
                              f"({', '.join(changed)} differ); rerun it with the same target to "
                              f"resume it, or delete {self.dir} to search for this one")
        self.record["target"] = now
        train = stages.get("train", {})
        self.steps_per_epoch = self.summary.get("steps_per_epoch") or 1
        self.per_update = (train["seconds"] / train["updates"] if train.get("updates")
                           else self._per_update_from_flops())
        self.overhead = self._overhead(stages)
        dense = self.record["candidates"].get(cands.DENSE.name, {})
        if dense.get("status") == exit_codes.DONE:            # resumed: what was learned
            self.overhead = dense["seconds"]
        if self.record.get("per_update_seen"):
            self.per_update = statistics.median_high(self.record["per_update_seen"])

    def _overhead(self, stages: dict) -> float:
        """Seconds a candidate spends outside its fine-tuning: its start, its plan and
        the export of one file, from the dense run's phases (`phase_seconds`: the plan
        without its export preflight, the export over its files); a run from before
        they were kept: what its session spent outside its stages."""
        phases = self.summary.get("phase_seconds")
        if phases:
            files = max(1, len(self.summary.get("artifacts", {})))
            own = (phases.get("plan", 0.0) - phases.get("preflight", 0.0)
                   + phases.get("export", 0.0) / files)
        else:
            own = self.summary.get("seconds", 0.0) - sum(s.get("seconds", 0.0)
                                                          for s in stages.values())
        return max(5.0, own) + STARTUP_SECONDS

    def _per_update_from_flops(self) -> float:
        """Seconds per update of a dense run that trained none (`train.epochs: 0`): its
        FLOPs per example at a fifth of the measured peak."""
        t = self.summary.get("throughput", {})
        flops = 3 * t.get("flops_per_example", 0.0) * self.summary["global_batch_size"]
        peak = t.get("peak_flops_measured") or t.get("peak_flops_per_sec")
        return flops / max(0.2 * peak or 1e10, 1.0)

    # -- the plan ---------------------------------------------------------------------------
    def estimate(self, candidate) -> float:
        return candidate.updates(self.steps_per_epoch, self.target) * self.per_update + self.overhead

    def plan(self) -> list:
        """The ordered list (after the dense reference): as recorded when resumed."""
        from tftrain.core.cpu import int8_instructions
        if self.record["order"]:
            return [cands.from_dict(c) for c in self.record["order"]]
        dense = {"bytes": self._dense_bytes()}
        listed = cands.ordered(self.target, dense, self.steps_per_epoch,
                               bool(int8_instructions()))
        self.record["order"] = [c.as_dict() for c in [cands.DENSE, *listed]]
        return [cands.DENSE, *listed]

    def _dense_bytes(self) -> float:
        """The float file's bytes, for predictions: the dense run's float artifact, else
        4 bytes a parameter."""
        floats = [name for name in kinds.headline_order() if kinds.named(name).precision == "float"]
        for name in floats:
            if name in self.summary.get("artifacts", {}):
                return self.summary["artifacts"][name]["size_bytes"]
        return 4.0 * self.summary.get("parameters", 1e6)

    def describe(self, listed: list) -> str:
        t = self.target
        limits = [f"accuracy drop <= {t.max_accuracy_drop * 100:g} pt"] + \
            ([f"{'gzipped ' if t.size == 'gzip' else ''}size <= {t.max_bytes:,} B "
              f"({console.size(t.max_bytes)})"]
             if t.max_bytes else []) + \
            ([f"latency <= {t.max_latency_ms:g} ms"] if t.max_latency_ms else []) + \
            ([f"latency <= {t.max_latency_ratio:g}x the dense float file's"]
             if t.max_latency_ratio else [])
        total = sum(self.estimate(c) for c in listed) + t.refine * max(
            self.estimate(c) for c in listed)
        self.record.setdefault("estimate_seconds", round(total, 1))     # the first printed
        return "\n".join([
            f"target: {', '.join(limits)} ({t.latency.runtime}, batch {t.latency.batch}, "
            f"{t.latency.threads or 'every'} thread{'s' if t.latency.threads != 1 else ''}); "
            f"objective: {t.objective}",
            f"candidates: {len(listed) - 1} and the dense reference, then {t.refine} proposed "
            f"by Optuna: {', '.join(c.name for c in listed[1:])}",
            f"estimate: about {console.seconds(total)} ({self.per_update * 1e3:.1f} ms per "
            f"update measured by the dense run, {self.overhead:.0f} s to start and export "
            "each candidate)"
            + (f"; time budget {console.seconds(t.time_budget)}" if t.time_budget else "")])

    # -- running -------------------------------------------------------------------------
    def run(self) -> dict:
        from tftrain.runtime import forking

        listed = self.plan()
        for line in self.describe(listed).splitlines():
            console.say(line)
        self.fork = forking.forks("auto", forking.local_gpus())
        if self.fork:
            forking.preload("tftrain.run")
        began = time.monotonic()
        queue = list(listed)
        while queue or self._refining():
            candidate = queue.pop(0) if queue else self._propose()
            if candidate is None:
                break
            if self._ruled_out(candidate):
                continue
            estimate = self.estimate(candidate)
            budget = self.target.time_budget
            if budget and not candidate.reference and \
                    time.monotonic() - began + estimate > budget:
                console.say(f"time budget: {console.seconds(budget)} would be passed by "
                            f"{candidate.name} (about {console.seconds(estimate)}); "
                            "the search stops here")
                self.record["stopped"] = "time budget"
                break
            took = self._candidate(candidate, estimate)
            if took is not None:
                self._learn(candidate, took)
        self.record["seconds"] = self.record.get("seconds", 0.0) + time.monotonic() - began
        return self.finish()

    def _learn(self, candidate, took: float) -> None:
        """The estimates from what candidates took: the dense reference (no fine-tuning)
        is a candidate's overhead; a fine-tuned one's time past it, per update."""
        updates = candidate.updates(self.steps_per_epoch, self.target)
        if not updates:
            self.overhead = took if candidate.reference else 0.5 * (self.overhead + took)
        elif took > self.overhead:
            seen = self.record.setdefault("per_update_seen", [])
            seen.append((took - self.overhead) / updates)
            self.per_update = statistics.median_high(seen)

    def _ruled_out(self, candidate) -> bool:
        """Skip (and record why) a candidate the measured ones say misses the target
        (`candidates.ruled_out`): its slot goes to one more Optuna proposal."""
        entry = self.record["candidates"].get(candidate.name)
        if entry:                            # judged before (a resumed search): as then
            return entry.get("status") == exit_codes.SKIPPED
        refused = [(cands.from_dict(c["candidate"]), c.get("reason", ""))
                   for c in self.record["candidates"].values() if c.get("status") == exit_codes.REFUSED]
        why = cands.ruled_out(candidate, self._measured(), self.target, refused)
        if why:
            self.record["candidates"][candidate.name] = _entry(candidate, status=exit_codes.SKIPPED,
                                                               reason=why)
            console.say(f"[skipped] {candidate.name}: {why}")
            self._save()
        return bool(why)

    def _refining(self) -> bool:
        entries = self.record["candidates"].values()
        done = [c for c in entries if c.get("origin") == "optuna" and c.get("status") != exit_codes.SKIPPED]
        skipped = [c for c in entries if c.get("status") == exit_codes.SKIPPED]
        proposed_skipped = sum(c.get("origin") == "optuna" for c in skipped)
        # a skipped listed candidate's slot goes to Optuna, within the candidates' number
        # (and as many skipped proposals): the search runs what its plan printed, the list
        # and `refine` proposals. A skipped proposal held no slot and frees none (it did:
        # each gave one more, and an image search planned as 9 and 3 ran 7 and 6, over
        # three times its estimate)
        freed = len(skipped) - proposed_skipped
        return (len(done) < min(self.target.refine + freed, self.target.candidates)
                and proposed_skipped < self.target.candidates)

    def _measured(self) -> list:
        """(candidate, figures) of every candidate measured so far."""
        return [(cands.from_dict(c["candidate"]), c["figures"])
                for c in self.record["candidates"].values() if c.get("figures")]

    def _propose(self):
        history = self._measured()
        candidate = cands.proposed(history, self.target, self.target.seed + len(history),
                                   set(self.record["candidates"]))
        if candidate is not None:
            self.record["order"].append(candidate.as_dict())
        return candidate

    def _candidate(self, candidate, estimate: float) -> float | None:
        """Run one candidate (unless finished before); its seconds, None when not run."""
        entry = self.record["candidates"].setdefault(candidate.name, _entry(candidate))
        if entry.get("status") in (exit_codes.DONE, exit_codes.REFUSED, exit_codes.FAILED):
            return None
        number = list(self.record["candidates"]).index(candidate.name)
        entry["estimate"] = round(estimate, 1)
        console.say(f"[candidate {number}] {candidate.name}: about {console.seconds(estimate)}...")
        began = time.monotonic()
        try:
            config = candidate.config(self.base, self.target, self._reference())
            path = candidate_runs.prepare(self.dir, self.run_dir, self.dense_stages,
                                          candidate.name, config)
        except ConfigError as err:
            entry.update(status=exit_codes.REFUSED, reason=err.problems[0])
            console.say(f"[candidate {number}] refused: {err.problems[0]}")
            self._save()
            return None
        code = candidate_runs.launch(self.dir, candidate.name, entry, path, self.fork,
                                     self._save)
        took = time.monotonic() - began
        entry["seconds"] = entry.get("seconds", 0.0) + took
        summary = candidate_runs.summary_of(path)
        if code in (exit_codes.OK, exit_codes.TARGET_MISSED) and summary is not None:
            dense = None if candidate.reference else self.record["dense"]
            artifact = candidate.artifact(self.target.latency.runtime)
            entry["figures"] = f = front.figures(summary, artifact, self.target, dense)
            if candidate.reference:
                self.record["dense"] = f
            else:
                timing.settle(f, path / kinds.named(artifact).path, Path(self._reference()),
                              self.target, dense)
            entry["status"] = exit_codes.DONE
            met = front.meets(f, self.target)
            low, high = f["latency_interval"]
            console.say(f"[candidate {number}] done in {console.seconds(took)}: accuracy "
                        f"{f['accuracy']:.4f} ({-f['drop'] * 100:+.2f} pt), "
                        f"{console.size(f['bytes'])}, {f['latency_ms']:.3f} ms "
                        f"({f['latency_ratio']:.2f}x dense"
                        + ("" if candidate.reference else
                           f", {low:.2f}-{high:.2f} over {len(f['latency_rounds'])} rounds") + ")"
                        + ("" if candidate.reference else
                           "; meets the target" if met else "; misses the target")
                        + ("" if candidate.reference or not f["borderline"] else
                           ", borderline: the interval straddles the latency limit"))
        else:
            reason = candidate_runs.last_error(path.parent / f"{candidate.name}.log")
            status = exit_codes.REFUSED if code == exit_codes.CONFIG else exit_codes.FAILED
            entry.update(status=status, reason=reason, exit_code=code)
            console.say(f"[candidate {number}] {status} (exit {code}): {reason}")
            if candidate.reference:
                self._save()
                raise RuntimeError(f"the dense reference could not be exported: {reason}")
        self._save()
        return took

    def _reference(self) -> str | None:
        """The dense float file every candidate is timed against (None: the dense one)."""
        if "dense" not in self.record:
            return None
        name = "model.onnx" if self.target.latency.runtime == "onnx" else "model.tflite"
        return str(self.dir / "runs" / cands.DENSE.name / "export" / name)

    def _save(self) -> None:
        from tftrain.training.rundir import atomic_write
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.record_path, json.dumps(self.record, indent=2) + "\n")

    # -- the end -----------------------------------------------------------------------------
    def finish(self) -> dict:
        """The front, the candidate to ship (its file copied to `search/chosen/`), the
        table, the chart in the run's report.html."""
        from tftrain.search import report

        self._recheck_order()
        rows = [{"name": n, **c["figures"]} for n, c in self.record["candidates"].items()
                if c.get("figures")]
        chosen, met = front.choose(rows, self.target)
        self.record.update(front=[r["name"] for r in front.pareto(rows)], met=met,
                           chosen=chosen["name"] if chosen else None)
        if chosen is not None:
            report.ship(self, chosen)
        self._save()
        report.show(self)
        return self.record


    def _recheck_order(self) -> None:
        """A narrower candidate timed slower than a wider one of the same kind: both
        timed again (`timing.MORE_ROUNDS` rounds each), and flagged where it still is."""
        dense = self.record.get("dense", {})
        for narrow, wide in timing.narrower_slower(self._measured()):
            entries = [self.record["candidates"][c.name] for c in (narrow, wide)]
            if any(e["figures"].get("rechecked") for e in entries):
                continue
            for c, e in zip((narrow, wide), entries):
                file = self.dir / "runs" / c.name / kinds.named(e["figures"]["artifact"]).path
                timing.add_rounds(e["figures"], file, Path(self._reference()), self.target,
                                  dense)
                timing.settle(e["figures"], file, Path(self._reference()), self.target, dense)
                e["figures"]["rechecked"] = True
            slow, fast = (e["figures"] for e in entries)
            if slow["latency_ratio"] > fast["latency_ratio"]:
                slow["flag"] = (f"timed slower than the wider {wide.name} "
                                f"({slow['latency_ratio']:.2f}x against {fast['latency_ratio']:.2f}x)")
            console.say(f"timed again: {narrow.name} {slow['latency_ratio']:.2f}x, {wide.name} "
                        f"{fast['latency_ratio']:.2f}x (the narrower was timed slower)")
        self._save()


def _entry(candidate, **more) -> dict:
    """A candidate's record in search.json, before it runs."""
    return {"candidate": candidate.as_dict(), "origin": candidate.origin, "launches": 0, **more}
