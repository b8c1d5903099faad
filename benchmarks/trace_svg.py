"""A profiler trace's op timeline drawn as SVG: one row per compute thread, each op a box
coloured by the pipeline stage its layer is on, labelled with its micro-batch.

    trace_svg.draw(logdir, stages={"dense_0": 0, ...}, out="docs/pipeline_trace.svg")
"""
import collections
import glob
import json
import re

COLOURS = ("#4878d0", "#ee854a", "#6acc64", "#d65f5f")


def op_events(logdir: str) -> tuple[list[dict], dict]:
    """The op events of the newest trace under `logdir` (TensorBoard's profile plugin
    layout) and the thread names, read with xprof's converter."""
    from xprof.convert import raw_to_tool_data
    paths = sorted(glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb"))[-1:]
    data, _ = raw_to_tool_data.xspace_to_tool_data(paths, "trace_viewer", {})
    events = json.loads(data)["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ops = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("long_name")
           and "tf_Compute" in threads.get((e["pid"], e["tid"]), "")]
    return ops, threads


def micro_batch(name: str) -> int:
    """A micro-batch's index from its op's name (`Relu_2`, `gradients_2/...`: 2)."""
    grad = re.match(r"gradients(?:_(\d+))?/", name)
    if grad:
        return int(grad.group(1) or 0)
    op = re.search(r"/[A-Za-z]+(?:_(\d+))?:", name)
    return int(op.group(1) or 0) if op else 0


def busy(ops: list[dict]) -> dict:
    """Milliseconds of the span with both / one / no compute thread busy."""
    points = sorted([(e["ts"], 1) for e in ops] + [(e["ts"] + e["dur"], -1) for e in ops])
    level, last, out = 0, points[0][0], collections.Counter()
    for t, step in points:
        out[min(level, 2)] += t - last
        level, last = level + step, t
    return {"both": out[2] / 1e3, "one": out[1] / 1e3, "idle": out[0] / 1e3}


def draw(logdir: str, stages: dict, out: str, title: str) -> dict:
    """Write the SVG of the first call's ops (longer than 0.2 ms) and return `busy`."""
    ops, threads = op_events(logdir)
    first = min(e["ts"] for e in ops)
    span = max(e["ts"] + e["dur"] for e in ops) - first
    rows = sorted({threads[(e["pid"], e["tid"])] for e in ops})
    width, row_h, left = 1100, 46, 90
    scale = (width - left - 10) / span
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{70 + row_h * len(rows)}" font-family="sans-serif" font-size="11">',
             f'<text x="10" y="18" font-size="13">{title}</text>']
    for i, row in enumerate(rows):
        parts.append(f'<text x="10" y="{52 + i * row_h}">thread {i + 1}</text>')
    for e in ops:
        if e["dur"] < 200:
            continue
        name = e["args"]["long_name"]
        layer = next((layer for layer in stages if f"/{layer}/" in name), None)
        colour = COLOURS[stages[layer] % len(COLOURS)] if layer else "#999999"
        x = left + (e["ts"] - first) * scale
        y = 30 + rows.index(threads[(e["pid"], e["tid"])]) * row_h
        w = max(1.0, e["dur"] * scale)
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 10}" '
                     f'fill="{colour}" stroke="white" stroke-width="0.5"/>')
        if w > 14:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + row_h / 2}" fill="white" '
                         f'text-anchor="middle">{micro_batch(name)}</text>')
    y = 40 + row_h * len(rows)
    legend = [f"stage {s}" for s in sorted(set(stages.values()))]
    for i, text in enumerate(legend):
        parts.append(f'<rect x="{left + i * 110}" y="{y}" width="12" height="12" '
                     f'fill="{COLOURS[i % len(COLOURS)]}"/><text x="{left + i * 110 + 16}" '
                     f'y="{y + 10}">{text}</text>')
    parts.append(f'<text x="{left + len(legend) * 110}" y="{y + 10}">box label: micro-batch; '
                 f'{span / 1e3:.1f} ms in all</text></svg>')
    with open(out, "w") as f:
        f.write("\n".join(parts) + "\n")
    return busy(ops)
