"""The report printed at the end of a run (`report_table`): what ran, how well, how fast,
each artifact with its path, size, accuracy and latency, and where everything is, in rows
within 120 columns."""
from __future__ import annotations

import textwrap
from collections import Counter

from tftrain.core import console
from tftrain.training import memory


def grouped(values: dict[str, float]) -> str:
    """Per-layer values for the console, layers of equal value (to 3 decimals) as one
    entry: "dense 0.800" alone, "0.500 x 42 layers (Conv ... logits)" for a group, so a
    pruned MobileNetV2's 36 layers at 0.500 take one line (summary.json keeps each)."""
    groups: dict[str, list[str]] = {}
    for name, value in values.items():
        groups.setdefault(f"{value:.3f}", []).append(name)
    return ", ".join(f"{names[0]} {value}" if len(names) == 1 else
                     f"{value} x {len(names)} layers ({names[0]} ... {names[-1]})"
                     for value, names in sorted(groups.items(), key=lambda kv: -float(kv[0])))


def report_table(summary: dict) -> str:
    """The report printed at the end of a run: what ran, how well, how fast, each
    artifact with its path and size, and where everything is (rows within 120 columns;
    a long value continues on the next row)."""
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
        # where a device's memory bounds the plan (a GPU, distribute.device_memory) or
        # activations are recomputed; summary.json holds it always
        bounded = not (summary.get("memory_plan") or {}).get("host", True)
        peak = memory.describe(summary.get("memory"), "training")
        if peak and (bounded or summary.get("recompute", "none") != "none"):
            rows.append(("memory", peak + ("" if summary.get("recompute", "none") == "none"
                                           else f"; recompute: {summary['recompute']}")))
    headline = summary.get("accuracy")
    if headline:
        rows.append(("accuracy (as deployed)",
                     f"{headline['value']:.4f} ({headline['artifact']}; stage "
                     f"{headline['stage']} evaluated {headline['stage_value']:.4f}"
                     + (f"; the artifact {abs(headline['gap_pt']):.2f} pt "
                        f"{'below' if headline['gap_pt'] > 0 else 'above'} it: "
                        f"{headline['explanation']}" if "explanation" in headline else "")
                     + ")"))
    if summary["metrics"]:
        rows.append(("metrics", ", ".join(f"{k} {v:.4f}" for k, v in summary["metrics"].items())))
    if summary.get("raw_metrics"):        # before averaging / batch-norm re-estimation
        rows.append(("as trained", ", ".join(f"{k} {v:.4f}"
                                             for k, v in summary["raw_metrics"].items())))
    rows += _stage_rows(summary)
    if summary.get("sparsity"):
        rows.append(("sparsity", grouped(summary["sparsity"])))
    for name, art in summary.get("artifacts", {}).items():
        rows += _artifact_rows(name, art)
    if "ship" in summary:       # an artifact missed its accuracy budget
        ship = summary["ship"]
        rows.append(("ship", f"{ship} ({summary['artifacts'][ship].get('path', ship)}): the best artifact within "
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
    room = console.WIDTH - width - 2
    parts = textwrap.wrap(value, room, break_long_words=True, break_on_hyphens=False) or [""]
    return [f"{key if i == 0 else '':<{width}}  {part}" for i, part in enumerate(parts)]


def _input_row(t: dict) -> str:
    if t.get("input_wait") is None:
        return "not measured (run.deterministic, or one step per call)"
    host, others = t.get("host") or {}, t.get("others_cores") or 0
    per_batch, per_call = t.get("input_wait_ms_per_batch"), t.get("host_ms_per_call")
    return (f"waits {per_batch:.2f} ms per batch ({t['input_wait']:.1%} of the time)"
            if per_batch is not None else f"waits {t['input_wait']:.1%} of the time") + \
        (f"; host {per_call:.1f} ms per call of {host.get('steps_per_execution', '?')} steps "
         f"({host.get('checks', 0)} checks)" if per_call is not None else "") + \
        (f"; other processes kept {others:.1f} cores busy meanwhile" if others >= 0.1 else "")


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

    acc = art.get("accuracy")
    rows = [(f"export {name}", f"{art.get('path', name)} {console.size(art['size_bytes'])} (gzip "
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
    if "arena_bytes" in art:
        weights = art["weight_bytes"]
        rows.append((f"  {name} memory", "constants "
                     + (f"{console.size(weights['front_end'])} front end + "
                        if weights["front_end"] else "")
                     + f"{console.size(weights['network'])} network; tensor arena estimate "
                     f"{console.size(art['arena_bytes'])} (activations live at once, batch 1)"))
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
    """Op names counted by kind: `LOG x2, MUL x9` rather than 55 names in a row (each
    name `OP`, `OP:detail` or `OP (its output tensor)`; summary.json keeps them whole)."""
    counts = Counter(name.split(" (")[0].split(":")[0] for name in names)
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.most_common())
