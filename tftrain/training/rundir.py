"""The run directory: created only once a run is known to be valid, written atomically.

`<run.dir>/<run.name>/` holds config.yaml, metrics.csv, tensorboard/, checkpoints/,
export/ and, only when a run has completed, summary.json. A directory without a
completed summary is an interrupted run: the same command resumes it.
"""
from __future__ import annotations

import difflib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tftrain.config import Config, ConfigError, dump_config


def atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class RunDir:
    path: Path
    resumed: bool

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def export(self) -> Path:
        return self.path / "export"


def run_path(cfg: Config, smoke: bool = False) -> Path:
    return Path(cfg.run.dir) / (cfg.run.name + ("-smoke" if smoke else ""))


def read_summary(path: Path) -> dict | None:
    """The summary of a completed run at `path`, else None."""
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return summary if summary.get("status") == "completed" else None


def open_run_dir(cfg: Config, smoke: bool = False, write: bool = True) -> RunDir:
    """Create the run directory, or reopen an interrupted one with the same config.

    `write=False` (non-chief workers) checks the same things but writes nothing.
    """
    path = run_path(cfg, smoke)
    text = dump_config(cfg)
    saved = path / "config.yaml"
    if saved.exists():
        old = saved.read_text()
        if old != text:
            diff = [line for line in difflib.unified_diff(old.splitlines(), text.splitlines(), lineterm="", n=0)
                    if line[:1] in "+-" and not line.startswith(("+++", "---"))]
            raise ConfigError(
                f"run.name: {path} already holds a run with a different config "
                f"({'; '.join(diff[:4])}); use another run.name or --run-dir, or delete {path}")
        return RunDir(path, resumed=True)
    if write:
        atomic_write(saved, text)
    return RunDir(path, resumed=False)


def write_summary(run: RunDir, summary: dict) -> None:
    atomic_write(run.summary_path, json.dumps(summary, indent=2, sort_keys=False) + "\n")


def report_table(summary: dict) -> str:
    """The report printed at the end of a run."""
    rows = [("status", summary["status"]), ("strategy", summary["strategy"]),
            ("replicas", summary["replicas"]), ("precision", summary["precision"]),
            ("global batch", summary["global_batch_size"]), ("epochs", summary["epochs"]),
            ("optimizer updates", summary["steps"]),
            ("examples/s", f"{summary['throughput']['examples_per_sec']:.1f}"),
            ("input wait", "not measured (run.deterministic)"
             if summary["throughput"].get("input_wait") is None
             else f"{summary['throughput']['input_wait']:.1%} of step time")]
    host = summary["throughput"].get("host")
    if host:
        per_call = host.get("host_seconds_per_call")
        rows.append(("steps per call", f"{host['steps_per_execution']}"
                     + (f" (host {per_call * 1e3:.2f} ms per call, step "
                        f"{host['step_seconds'] * 1e3:.2f} ms; {host['checks']} checks)"
                        if per_call is not None else f" ({host['checks']} checks)")))
    flops = summary["throughput"].get("model_flops_per_sec")
    if flops:
        rows.append(("model FLOP/s", f"{flops / 1e9:.2f} GFLOP/s, utilisation "
                                     f"{summary['throughput'].get('mfu', 0.0):.1%} of the peak of "
                                     f"{summary['throughput'].get('peak_device', 'the devices')}"))
    placed = summary.get("placement")
    if placed:
        rows.append(("placement", f"{len(placed['devices'])} stages x {placed['microbatches']} "
                                  f"micro-batches, stage costs ({placed['balance']}) "
                                  + ", ".join(f"{c:.3g}" for c in placed["stage_costs"])
                                  + f", bubble (K-1)/(M+K-1) {placed['bubble_formula']:.2f}"
                                  + (f", measured {placed['bubble_measured']:.2f}"
                                     if "bubble_measured" in placed else "")))
    rows += [(k, f"{v:.4f}") for k, v in summary["metrics"].items()]
    rows += [(f"{k} (as trained)", f"{v:.4f}")   # before averaging / batch-norm re-estimation
             for k, v in (summary.get("raw_metrics") or {}).items()]
    stages = summary.get("stages", {})
    if len(stages) > 1:            # what each compression stage cost and gained
        before = None
        for name, stage in stages.items():
            acc = stage["metrics"].get("val_accuracy")
            change = "" if before is None or acc is None else f" ({(acc - before) * 100:+.2f} pt)"
            raw = stage.get("raw_metrics", {}).get("val_accuracy")
            rows.append((f"stage {name}", f"{stage['updates']} updates, {stage['seconds']:.0f} s"
                         + (f", val_accuracy {acc:.4f}{change}" if acc is not None else "")
                         + (f" ({stage.get('settled', 'averaged')}; as trained {raw:.4f})"
                            if raw is not None else "")))
            before = acc
    if summary.get("sparsity"):
        rows.append(("sparsity", ", ".join(f"{k} {v:.3f}" for k, v in summary["sparsity"].items())))
    for name, art in summary.get("artifacts", {}).items():
        acc = art.get("accuracy")
        rows.append((f"export {name}", f"{art['size_bytes']} B, gzip {art['gzip_bytes']} B"
                     + (f", accuracy {acc:.4f}" if acc is not None else "")
                     + (f", {art['latency_ms']:.3f} ms/example" if "latency_ms" in art else "")
                     + (f", variables gzip {art['variables_gzip_bytes']} B, int8 kernels "
                        f"{art['int8_zero_fraction']:.3f} zeros" if "int8_layers" in art else "")
                     + ("" if art.get("verified", True) else f"  FAILED: {art['check']}")))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line] + [f"{k:<{width}}  {v}" for k, v in rows] + [line])
