"""`report.html`: one self-contained page of a run, drawn with Plotly (its script inlined,
so the page opens anywhere without a network): the plan, the training curves per update
and per epoch across stages, the accuracy each stage reached, the validation confusion
matrix, the exported artifacts (size, accuracy, latency), the per-layer SQNR of int8
artifacts and, after a compression search, its candidates and Pareto front. Read from
the run directory (summary.json, metrics*.csv, updates*.csv), so `write(run_dir)` draws
it again for any completed run."""
from __future__ import annotations

import csv
import html
import json
from pathlib import Path

NAME = "report.html"


def write(run_dir: Path, summary: dict | None = None) -> Path:
    """Draw `run_dir`'s report; returns its path."""
    import plotly
    import plotly.graph_objects as go  # noqa: F401  (fails early when plotly is missing)

    run_dir = Path(run_dir)
    summary = summary or json.loads((run_dir / "summary.json").read_text())
    searched = run_dir / "search" / "search.json"      # python -m tftrain.search RUN_DIR
    if "search" not in summary and searched.exists():
        summary = {**summary, "search": json.loads(searched.read_text())}
    figures = [("Training, per update", _updates(run_dir, summary)),
               ("Training, per epoch", _epochs(run_dir, summary)),
               ("Accuracy by stage and artifact", _accuracy(summary)),
               ("Validation confusion matrix", _confusion(summary)),
               ("Exported artifacts", _artifacts(summary)),
               ("Int8 artifacts layer by layer", _layers(summary)),
               ("Compression search", _search(summary))]
    body = [f"<h1>{html.escape(run_dir.name)}</h1>", _plan(summary)]
    for i, (title, figure) in enumerate(figures):
        if figure is None:
            continue
        body.append(f"<h2>{html.escape(title)}</h2>")
        body.append(figure.to_html(full_html=False, include_plotlyjs=False,
                                   div_id=f"chart-{i}", config={"displaylogo": False}))
    body.append(_artifact_table(summary))
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{html.escape(run_dir.name)}: tftrain run report</title>"
            "<style>body{font-family:sans-serif;margin:2em;max-width:1100px}"
            "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
            "padding:3px 8px;text-align:left;font-size:13px}h2{margin-top:1.6em}</style>"
            f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script>"
            "</head><body>" + "\n".join(body) + "</body></html>")
    path = run_dir / NAME
    from tftrain.training.rundir import atomic_write
    atomic_write(path, page)
    return path


def _num(value) -> float | None:
    """A CSV cell as a number (Keras writes `NA` for a value it did not log)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _rows(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as f:
            return list(csv.DictReader(f))
    except OSError:
        return []


def _stage_files(run_dir: Path, summary: dict, kind: str) -> list[tuple[str, list[dict]]]:
    """(stage, rows of its metrics or updates CSV) in the order the stages ran."""
    found = []
    for stage in summary.get("stages", {}) or {"train": None}:
        name = f"{kind}.csv" if stage == "train" else f"{kind}-{stage}.csv"
        rows = _rows(run_dir / name)
        if rows:
            found.append((stage, rows))
    return found


def _updates(run_dir: Path, summary: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    stages = _stage_files(run_dir, summary, "updates")
    if not stages:
        return None
    keys = [k for k in stages[0][1][0] if k not in ("update", "lr")]
    fig = make_subplots(rows=len(keys) + 1, cols=1, shared_xaxes=True,
                        subplot_titles=[*keys, "learning rate"])
    offset = 0
    for stage, rows in stages:
        x = [offset + int(r["update"]) for r in rows]
        for i, key in enumerate(keys):
            fig.add_trace(go.Scatter(x=x, y=[_num(r.get(key)) for r in rows],
                                     name=f"{stage} {key}", mode="lines"), row=i + 1, col=1)
        fig.add_trace(go.Scatter(x=x, y=[_num(r.get("lr")) for r in rows], name=f"{stage} lr",
                                 mode="lines"), row=len(keys) + 1, col=1)
        offset = x[-1]
    fig.update_layout(height=240 * (len(keys) + 1), xaxis_title="optimizer update")
    return fig


def _epochs(run_dir: Path, summary: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    stages = _stage_files(run_dir, summary, "metrics")
    if not stages:
        return None
    fig = make_subplots(rows=1, cols=2, subplot_titles=["loss", "accuracy"])
    offset = 0
    for stage, rows in stages:
        x = [offset + int(r["epoch"]) + 1 for r in rows]
        for col, base in ((1, "loss"), (2, "accuracy")):
            for key in (base, f"val_{base}"):
                if key in rows[0]:
                    fig.add_trace(go.Scatter(x=x, y=[_num(r.get(key)) for r in rows],
                                             name=f"{stage} {key}", mode="lines+markers"),
                                  row=1, col=col)
        offset = x[-1]
    fig.update_layout(height=380, xaxis_title="epoch", xaxis2_title="epoch")
    return fig


def _accuracy(summary: dict):
    import plotly.graph_objects as go

    names, values = [], []
    for stage, result in (summary.get("stages") or {}).items():
        acc = result.get("metrics", {}).get("val_accuracy")
        if acc is not None:
            names.append(f"stage {stage}")
            values.append(acc)
    for name, art in (summary.get("artifacts") or {}).items():
        if art.get("accuracy") is not None:
            names.append(name)
            values.append(art["accuracy"])
    if not values:
        return None
    fig = go.Figure(go.Bar(x=names, y=values, text=[f"{v:.4f}" for v in values],
                           textposition="outside"))
    low = min(values)
    fig.update_layout(height=380, yaxis=dict(range=[max(0.0, low - 0.05), 1.0],
                                             title="validation accuracy"))
    return fig


def _confusion(summary: dict):
    import plotly.graph_objects as go

    matrix = summary.get("confusion")
    if not matrix:
        return None
    labels = [str(i) for i in range(len(matrix))]
    fig = go.Figure(go.Heatmap(z=matrix, x=labels, y=labels, colorscale="Blues",
                               text=matrix, texttemplate="%{text}"))
    fig.update_layout(height=520, width=560, xaxis_title="predicted", yaxis_title="true",
                      yaxis_autorange="reversed")
    return fig


def _artifacts(summary: dict):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    arts = {n: a for n, a in (summary.get("artifacts") or {}).items() if "size_bytes" in a}
    if not arts:
        return None
    names = list(arts)
    fig = make_subplots(rows=1, cols=3, subplot_titles=["size (KiB)", "accuracy",
                                                        "ms per example, batch 1, 1 thread"])
    fig.add_trace(go.Bar(x=names, y=[a["size_bytes"] / 1024 for a in arts.values()],
                         name="size"), row=1, col=1)
    fig.add_trace(go.Bar(x=names, y=[a.get("accuracy") or 0 for a in arts.values()],
                         name="accuracy"), row=1, col=2)
    fig.add_trace(go.Bar(x=names, y=[(a.get("latency_grid") or {}).get("batch1_threads1",
                                                                         a.get("latency_ms", 0))
                                     for a in arts.values()], name="latency"), row=1, col=3)
    fig.update_layout(height=380, showlegend=False)
    return fig


def _layers(summary: dict):
    import plotly.graph_objects as go

    arts = {n: a for n, a in (summary.get("artifacts") or {}).items() if a.get("layers")}
    if not arts:
        return None
    fig = go.Figure()
    for name, art in arts.items():
        layers = [r["layer"] for r in art["layers"]]
        fig.add_trace(go.Scatter(x=layers, y=[r["sqnr_db"] for r in art["layers"]],
                                 name=f"{name}: accumulated", mode="lines+markers"))
        fig.add_trace(go.Scatter(x=layers, y=[r["local_sqnr_db"] for r in art["layers"]],
                                 name=f"{name}: added by the layer", mode="markers"))
    fig.update_layout(height=420, yaxis_title="SQNR (dB)", xaxis_title="layer, in model order")
    return fig


def _search(summary: dict):
    """The compression search's candidates (`search/search.json`): accuracy against
    latency, marker size by bytes, the Pareto front in red, the chosen one ringed, the
    target's limits as lines."""
    import plotly.graph_objects as go

    search = summary.get("search")
    if not search or not search.get("candidates"):
        return None
    done = [dict(figures, name=name) for name, c in search["candidates"].items()
            if (figures := c.get("figures"))]
    if not done:
        return None
    front = set(search.get("front", []))
    largest = max(d["bytes"] for d in done)
    fig = go.Figure(go.Scatter(
        x=[c["latency_ms"] for c in done], y=[c["accuracy"] for c in done], mode="markers+text",
        marker=dict(size=[10 + 24 * c["bytes"] / largest for c in done],
                    color=["#d62728" if c["name"] in front else "#1f77b4" for c in done],
                    line=dict(width=[4 if c["name"] == search.get("chosen") else 0
                                     for c in done], color="black")),
        text=[c["name"] for c in done], textposition="top center",
        customdata=[f"{c['bytes'] / 1024:.1f} KiB, {c['latency_ratio']:.2f}x dense"
                    for c in done],
        hovertemplate="%{text}: %{customdata}<br>%{x:.3f} ms, accuracy %{y:.4f}"))
    target, dense = search.get("target", {}), search.get("dense")
    if dense and "max_accuracy_drop" in target:
        fig.add_hline(y=dense["accuracy"] - target["max_accuracy_drop"], line_dash="dot",
                      annotation_text="accuracy floor")
    limits = [target.get("max_latency_ms")] + (
        [target["max_latency_ratio"] * dense["latency_ms"]]
        if dense and target.get("max_latency_ratio") else [])
    for limit in [x for x in limits if x]:
        fig.add_vline(x=limit, line_dash="dot", annotation_text="latency limit")
    setting = target.get("latency", {})
    fig.update_layout(height=460, showlegend=False,
                      xaxis_title=f"ms per example ({setting.get('runtime', 'tflite')}, batch "
                                  f"{setting.get('batch', 1)}, {setting.get('threads', 1) or 'every'}"
                                  " thread)",
                      yaxis_title="validation accuracy (deployed)")
    return fig


def _plan(summary: dict) -> str:
    rows = [("status", summary.get("status")), ("strategy", summary.get("strategy")),
            ("replicas x workers", f"{summary.get('replicas')} x {summary.get('workers', 1)}"),
            ("devices", ", ".join(summary.get("devices", []))),
            ("precision", summary.get("precision")),
            ("batch", f"{summary.get('per_replica_batch_size')} per replica x "
                      f"{summary.get('replicas')} replicas x {summary.get('accumulation_steps')}"
                      f" accumulation = global batch {summary.get('global_batch_size')}"),
            ("updates", f"{summary.get('steps')} in {summary.get('epochs')} epochs"),
            ("throughput", f"{summary.get('throughput', {}).get('examples_per_sec', 0):,.0f} "
                           "examples/s"),
            ("memory plan", _memory(summary.get("memory_plan"))),
            *[(k, f"{v:.4f}") for k, v in (summary.get("metrics") or {}).items()]]
    return "<table>" + "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                               for k, v in rows) + "</table>"


def _memory(plan: dict | None) -> str:
    """The planner's estimate in words: `data parallel: 1.9 MiB per device of 22.3 GiB`."""
    from tftrain.core import console

    if not plan:
        return "not planned"
    per_device = plan.get("bytes_per_device") or []
    kind = {"data": "data parallel"}.get(plan.get("kind"), plan.get("kind", "?"))
    return (f"{kind}, {plan.get('stages', 1)} stage(s): "
            + ", ".join(console.size(b) for b in per_device) + " per device"
            + (f" of {console.size(plan['device_memory'])}" if plan.get("device_memory") else ""))


def _artifact_table(summary: dict) -> str:
    arts = summary.get("artifacts") or {}
    if not arts:
        return ""
    head = "<h2>Artifacts</h2><table><tr><th>artifact</th><th>path</th><th>KiB</th>" \
           "<th>accuracy</th><th>ms/example (batch 1, 1 thread)</th><th>check</th></tr>"
    rows = []
    for name, a in arts.items():
        latency = (a.get("latency_grid") or {}).get("batch1_threads1", a.get("latency_ms"))
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            name, a.get("path", ""), f"{a.get('size_bytes', 0) / 1024:,.1f}",
            "" if a.get("accuracy") is None else f"{a['accuracy']:.4f}",
            "" if latency is None else f"{latency:.3f}", a.get("check", ""))) + "</tr>")
    return head + "".join(rows) + "</table>"
