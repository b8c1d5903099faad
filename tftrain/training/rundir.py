"""The run directory: created only once a run is known to be valid, written atomically.

`<run.dir>/<run.name>/` holds config.yaml, topology.json, metrics.csv, tensorboard/,
checkpoints/, export/ and, only when a run has completed, summary.json. A directory
without a completed summary is an interrupted run: the same command resumes it.

An interrupted run resumes with the same config, or on another topology: the keys that
say where it runs (`TOPOLOGY_KEYS`: the strategy, the devices, the all-reduce's dtype, the
per-replica batch and the accumulation steps) may change as long as the global batch stays, so that every
update takes the same examples (`topology.json` records what the checkpoints were
written under).
"""
from __future__ import annotations

import difflib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from tftrain.config import Config, ConfigError, dump_config


def atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# config keys that say where a run executes, not what it computes: free to change when an
# interrupted run resumes, as long as the global batch stays (checked on the topology)
TOPOLOGY_KEYS = {"distribute": ("strategy", "devices", "virtual_cpus", "all_reduce_dtype"),
                 "data": ("per_replica_batch_size",),
                 "train": ("accumulation_steps",),
                 # (a run directory moved or mounted elsewhere resumes where it is)
                 "run": ("allow_batch_change", "dir")}


@dataclass(frozen=True)
class RunDir:
    path: Path
    resumed: bool
    previous: dict | None = None     # the topology the run's checkpoints were written under

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


def completed(cfg: Config, smoke: bool = False) -> dict | None:
    """The summary of the completed run the config names, if there is one (None: not
    completed). A completed run given another config is a ConfigError naming the keys
    that differ: its results are not what this config asks for. Reads files only (no
    TensorFlow), so it answers before any planning."""
    path = run_path(cfg, smoke)
    done = read_summary(path)
    if done is None:
        return None
    try:
        old = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return done
    differ = [f"{key} ({_short(a)} -> {_short(b)})"
              for key, (a, b) in changed_keys(old, yaml.safe_load(dump_config(cfg))).items()
              if key != "run.dir"]
    if differ:
        raise ConfigError(
            f"run.name: {path} is a completed run with a different config: "
            f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}; its results are not "
            f"this config's. Use another run.name or --run-dir, or delete {path} to train again")
    return done


def changed_keys(old, new, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: (old value, new value)} of the leaves that differ between two configs."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = {}
        for key in list(old) + [k for k in new if k not in old]:
            found.update(changed_keys(old.get(key), new.get(key), f"{prefix}{key}."))
        return found
    return {} if old == new else {prefix.rstrip("."): (old, new)}


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


def open_run_dir(cfg: Config, smoke: bool = False, write: bool = True,
                 topology: dict | None = None) -> RunDir:
    """Create the run directory, or reopen an interrupted one with the same config, or
    with one that differs only in `TOPOLOGY_KEYS` and keeps the global batch (checked
    against the topology recorded when the run last started). `topology`: this run's
    (`RunPlan.topology`), recorded in `topology.json`.

    `write=False` (non-chief workers) checks the same things but writes nothing.
    """
    path = run_path(cfg, smoke)
    text = dump_config(cfg)
    saved = path / "config.yaml"
    if saved.exists():
        old = saved.read_text()
        previous = read_topology(path)
        changed = _changed_lines(old, text)
        # without a recorded topology (a run from before it) every key must be the same
        refused = changed if previous is None or topology is None else \
            _changed_lines(_free(old), _free(text))
        if refused:
            raise ConfigError(
                f"run.name: {path} already holds a run with a different config "
                f"({'; '.join(refused[:4])}); use another run.name or --run-dir, or delete {path}")
        if previous is not None and topology is not None:
            _check_resumable(path, previous, topology, cfg.run.allow_batch_change)
        if write and changed:
            atomic_write(saved, text)        # the config the checkpoints are written under now
        if write and topology is not None and topology != previous:
            write_topology(path, topology)
        return RunDir(path, resumed=True, previous=previous)
    if write:
        atomic_write(saved, text)
        if topology is not None:
            write_topology(path, topology)
    return RunDir(path, resumed=False)


def _changed_lines(old: str, new: str) -> list[str]:
    return [line for line in difflib.unified_diff(old.splitlines(), new.splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]


def _free(config_text: str) -> str:
    """A dumped config without the values of `TOPOLOGY_KEYS`."""
    config = yaml.safe_load(config_text)
    for section, keys in TOPOLOGY_KEYS.items():
        for key in keys:
            config.get(section, {}).pop(key, None)
    return yaml.safe_dump(config, sort_keys=False)


def _check_resumable(path: Path, previous: dict, topology: dict, allow_batch_change: bool) -> None:
    """A resume on another topology must keep the examples of every update (or be
    allowed to change them: `run.allow_batch_change`)."""
    if previous.get("global_batch") != topology["global_batch"] and not allow_batch_change:
        raise ConfigError(
            f"resuming {path} would change the global batch from {previous['global_batch']} "
            f"to {topology['global_batch']} examples per update (its checkpoints count updates "
            f"of {previous['global_batch']}); keep it: set train.global_batch_size: "
            f"{previous['global_batch']} (the per-replica batch and accumulation steps are "
            "derived from it) or the old data.per_replica_batch_size and "
            "train.accumulation_steps; or set run.allow_batch_change: true to continue with "
            "the learning rate scaled to the new batch (not the same result)")
    bound = topology.get("micro_batch_bound") or previous.get("micro_batch_bound")
    if bound and previous.get("per_replica_batch") != topology["per_replica_batch"] \
            and not allow_batch_change:
        raise ConfigError(
            f"resuming {path} would compute each update over micro-batches of "
            f"{topology['per_replica_batch']} examples, not {previous['per_replica_batch']}, and "
            f"{', '.join(bound)} computes over a micro-batch (not the same result); keep "
            f"data.per_replica_batch_size: {previous['per_replica_batch']} (with replicas x "
            "accumulation steps making the global batch), or set run.allow_batch_change: true")
    if streams_of(previous) != topology["streams"]:
        raise ConfigError(
            f"resuming {path} would read its files as {topology['streams']} stream(s), not "
            f"the {streams_of(previous)} it began with (data.cache or data.shard_policy "
            "decides the sharding); keep them as they were")


def streams_of(topology: dict) -> int:
    """The file streams of a recorded topology (older records: one per worker with FILE
    sharding, else one)."""
    if "streams" in topology:
        return topology["streams"]
    return 1 if topology.get("shared_stream", True) else topology.get("workers", 1)


def recorded_streams(path: Path) -> int | None:
    """The file streams an interrupted run at `path` began with, if it recorded them."""
    previous = read_topology(path)
    return None if previous is None else streams_of(previous)


def read_topology(path: Path) -> dict | None:
    """The topology an interrupted run's checkpoints were written under, if recorded."""
    try:
        return json.loads((Path(path) / "topology.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_topology(path: Path, topology: dict) -> None:
    atomic_write(Path(path) / "topology.json", json.dumps(topology, indent=2) + "\n")


def describe_topology(t: dict) -> str:
    """One line: workers, replicas, batch arithmetic, precision wire."""
    return (f"{t['workers']} worker(s), {t['replicas']} replica(s) x {t['per_replica_batch']} "
            f"x {t['accumulation_steps']} accumulation = global batch {t['global_batch']}, "
            f"{t['precision']} with a {t['all_reduce']} all-reduce"
            + (", loss scaled" if t.get("loss_scaled") else "")
            + (f", files read as {streams_of(t)} streams" if streams_of(t) > 1 else ""))


def write_summary(run: RunDir, summary: dict) -> None:
    atomic_write(run.summary_path, json.dumps(summary, indent=2, sort_keys=False) + "\n")


# where each artifact is written, relative to the run directory
ARTIFACT_PATHS = {"saved_model": "export/saved_model/", "saved_model_int8": "export/saved_model_int8/",
                  "tflite_sparse": "export/model_sparse.tflite", "onnx": "export/model.onnx",
                  "onnx_int8": "export/model_int8.onnx", "keras3_file": "export/model.keras"}


def artifact_path(name: str) -> str:
    return ARTIFACT_PATHS.get(name, "export/model.tflite" if name.startswith("tflite") else name)


def report_table(summary: dict) -> str:
    """The report printed at the end of a run: what ran, how well, how fast, each
    artifact with its path and size, and where everything is (rows within 120 columns;
    a long value continues on the next row)."""
    from tftrain.core import console

    t = summary["throughput"]
    rows = [("status", summary["status"] + (f" in {console.seconds(summary['seconds'])}"
                                            if summary.get("seconds") else "")
             + f": {summary['epochs']} epochs, {summary['steps']} optimizer updates"),
            ("layout", f"{summary['strategy']}, {summary['replicas']} replicas"
             + (f" on {summary['workers']} workers" if summary.get("workers", 1) > 1 else "")
             + f", global batch {summary['global_batch_size']}, {summary['precision']}"),
            *[("batch changed", f"{c['from_global_batch']} -> {c['to_global_batch']} at update "
               f"{c['to_update']} of stage {c['stage']}, learning rate x "
               f"{c['learning_rate_scale']:g} (run.allow_batch_change)")
              for c in summary.get("batch_changes", [])]]
    if summary["steps"]:
        speed = console.rate(t["examples_per_sec"], "ex/s")
        if t.get("model_flops_per_sec"):
            speed += (f", {console.rate(t['model_flops_per_sec'], 'FLOP/s')} "
                      f"({t.get('mfu', 0.0):.1%} of the peak of {t.get('peak_device', 'the devices')})")
        rows.append(("throughput", speed))
        rows.append(("input", _input_row(t)))
    headline = summary.get("accuracy")
    if headline:
        rows.append(("accuracy (as deployed)",
                     f"{headline['value']:.4f} ({headline['artifact']}; stage "
                     f"{headline['stage']} evaluated {headline['stage_value']:.4f}"
                     + (f"; the artifact {abs(headline['gap_pt']):.2f} pt "
                        f"{'below' if headline['gap_pt'] > 0 else 'above'} it: "
                        f"{headline['explanation']}" if "explanation" in headline else "")
                     + ")"))
    rows += [(k, f"{v:.4f}") for k, v in summary["metrics"].items()]
    rows += [(f"{k} (as trained)", f"{v:.4f}")   # before averaging / batch-norm re-estimation
             for k, v in (summary.get("raw_metrics") or {}).items()]
    rows += _stage_rows(summary)
    if summary.get("sparsity"):
        rows.append(("sparsity", ", ".join(f"{k} {v:.3f}" for k, v in summary["sparsity"].items())))
    for name, art in summary.get("artifacts", {}).items():
        rows += _artifact_rows(name, art)
    if "ship" in summary:       # an artifact missed its accuracy budget
        ship = summary["ship"]
        rows.append(("ship", f"{ship} ({artifact_path(ship)}): the best artifact within "
                             "export.max_accuracy_drop" if ship else
                             "no artifact is within export.max_accuracy_drop"))
    if summary.get("run_dir"):
        where = summary["run_dir"]
        rows += [("run directory", f"{where} (summary.json, metrics.csv, updates.csv, "
                                   "checkpoints/)"),
                 ("tensorboard", f"tensorboard --logdir {where}/tensorboard")]
        if summary.get("report"):
            rows.append(("report", f"{where}/{summary['report']}"))
    width = max(len(k) for k, _ in rows)
    lines = []
    for key, value in rows:
        lines += _wrapped(key, str(value), width)
    rule = "-" * min(console.WIDTH, max(len(line) for line in lines))
    return "\n".join([rule, *lines, rule])


def _wrapped(key: str, value: str, width: int) -> list[str]:
    """`key  value` within 120 columns, a long value continued on indented rows."""
    import textwrap

    from tftrain.core import console
    room = console.WIDTH - width - 2
    parts = textwrap.wrap(value, room, break_long_words=True, break_on_hyphens=False) or [""]
    return [f"{key if i == 0 else '':<{width}}  {part}" for i, part in enumerate(parts)]


def _input_row(t: dict) -> str:
    if t.get("input_wait") is None:
        return "not measured (run.deterministic, or one step per call)"
    host = t.get("host") or {}
    per_batch, per_call = t.get("input_wait_ms_per_batch"), t.get("host_ms_per_call")
    return (f"waits {per_batch:.2f} ms per batch ({t['input_wait']:.1%} of the time)"
            if per_batch is not None else f"waits {t['input_wait']:.1%} of the time") + \
        (f"; host {per_call:.1f} ms per call of {host.get('steps_per_execution', '?')} steps "
         f"({host.get('checks', 0)} checks)" if per_call is not None else "")


def _stage_rows(summary: dict) -> list[tuple[str, str]]:
    stages, rows, before = summary.get("stages", {}), [], None
    if len(stages) <= 1 and not any(not s.get("updates") for s in stages.values()):
        return rows
    for name, stage in stages.items():        # what each compression stage cost and gained
        acc = stage["metrics"].get("val_accuracy")
        change = "" if before is None or acc is None else f" ({(acc - before) * 100:+.2f} pt)"
        raw = stage.get("raw_metrics", {}).get("val_accuracy")
        rows.append((f"stage {name}", ("the starting model, not trained" if not stage["updates"]
                                       and name == "train" else
                                       f"{stage['updates']} updates, {stage['seconds']:.0f} s")
                     + (f", val_accuracy {acc:.4f}{change}" if acc is not None else "")
                     + (f" ({stage.get('settled', 'averaged')}; as trained {raw:.4f})"
                        if raw is not None else "")))
        before = acc
    return rows


def _artifact_rows(name: str, art: dict) -> list[tuple[str, str]]:
    from tftrain.core import console

    acc = art.get("accuracy")
    rows = [(f"export {name}", f"{artifact_path(name)} {console.size(art['size_bytes'])} (gzip "
             f"{console.size(art['gzip_bytes'])})"
             + (f", accuracy {acc:.4f}" if acc is not None else "")
             + (f", {art['latency_ms']:.3f} ms/example" if "latency_ms" in art else "")
             + (f", variables gzip {console.size(art['variables_gzip_bytes'])}, int8 kernels "
                f"{art['int8_zero_fraction']:.3f} zeros" if "int8_layers" in art else "")
             + (f", {art['label']}" if "label" in art else "")
             + ("" if art.get("verified", True) else f"  FAILED: {art['check']}"))]
    if art.get("latency_grid"):
        grid = art["latency_grid"]
        rows.append((f"  {name} latency", "ms/example at batch 1 / 32: 1 thread "
                     f"{grid['batch1_threads1']:.3f} / {grid['batch32_threads1']:.3f}, "
                     f"every core {grid['batch1_threadsall']:.3f} / "
                     f"{grid['batch32_threadsall']:.3f}"
                     + (f"; XNNPack runs {art['xnnpack']['delegated']} ops"
                        + (f", not {_ops(art['xnnpack']['fallback'])}"
                           if art['xnnpack']['fallback'] else " (all)")
                        if "xnnpack" in art else "")
                     + (f"; CPU int8: {art['cpu_int8']}" if "cpu_int8" in art else "")))
    if art.get("float_latency_grid"):
        # a summary written before `speedup_vs_float` existed (a rerun of a completed
        # run reports the summary it finds) has the two grids only
        beside, fast = art["float_latency_grid"], art.get("speedup_vs_float")
        rows.append((f"  {name} vs float", "the float TFLite file of the same model, "
                     f"ms/example at batch 1 / 32: 1 thread {beside['batch1_threads1']:.3f}"
                     f" / {beside['batch32_threads1']:.3f}, every core "
                     f"{beside['batch1_threadsall']:.3f} / {beside['batch32_threadsall']:.3f}"
                     + (f"; {name} runs {fast['batch1_threads1']:.2f}x / "
                        f"{fast['batch32_threads1']:.2f}x as fast on 1 thread (the median "
                        "of rounds timed in turn)" if fast else "")))
    if art.get("speedup_vs_reference"):
        fast = art["speedup_vs_reference"]
        rows.append((f"  {name} vs reference", f"{art['reference']}: {name} runs "
                     f"{fast['batch1_threads1']:.2f}x / {fast['batch32_threads1']:.2f}x as fast at "
                     "batch 1 / 32 on 1 thread (the median of rounds timed in turn)"))
    if "sparse_path" in art:
        rows.append((f"  {name} sparse", f"{art['sparse_tensors']} weight tensors stored "
                     f"sparse; XNNPack's sparse path {'runs' if art['sparse_path'] else 'does not run'}"
                     f" ({art['sparse_path_reason']})"))
    if art.get("layers"):
        by_name = {row["layer"]: row for row in art["layers"]}
        rows.append((f"  {name} layers", "most noise added (added / accumulated SQNR): "
                     + ", ".join(f"{n} {by_name[n]['local_sqnr_db']:.1f}/"
                                 f"{by_name[n]['sqnr_db']:.1f} dB" for n in art["worst_layers"])))
    return rows


def _ops(names: list[str]) -> str:
    """Op names counted by kind: `LOG x2, MUL x9` rather than 55 names in a row."""
    from collections import Counter
    counts = Counter(name.split(":")[0] for name in names)
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.most_common())
