"""What a search leaves: the chosen candidate's file in `search/chosen/` with the config
that makes it, `candidates.csv`, the table printed, the chart in the run's report.html."""
from __future__ import annotations

import csv
import shutil

from tftrain.core import console, exit_codes
from tftrain.export import kinds

COLUMNS = ("candidate", "status", "accuracy", "drop_pt", "bytes", "latency_ms",
           "latency_ratio", "latency_low", "latency_high", "rounds", "borderline", "meets",
           "front", "seconds", "estimate", "launches", "label", "reason", "flag")


def ship(search, chosen: dict) -> None:
    """The chosen candidate's deployed file and its config, in `search/chosen/`."""
    out = search.dir / "chosen"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    source = search.dir / "runs" / chosen["name"] / kinds.named(chosen["artifact"]).path
    shutil.copy2(source, out / source.name)
    shutil.copy2(search.dir / "configs" / f"{chosen['name']}.yaml", out / "config.yaml")
    search.record["chosen_file"] = str(out / source.name)


def rows(search) -> list[dict]:
    from tftrain.search import front

    found = []
    for name, entry in search.record["candidates"].items():
        f = entry.get("figures") or {}
        found.append({
            "candidate": name, "status": entry.get("status", exit_codes.NOT_RUN),
            "accuracy": f"{f['accuracy']:.4f}" if f else "",
            "drop_pt": f"{f['drop'] * 100:.2f}" if f else "",
            "bytes": f.get("bytes", ""), "latency_ms": f"{f['latency_ms']:.4f}" if f else "",
            "latency_ratio": f"{f['latency_ratio']:.3f}" if f else "",
            "latency_low": f"{f['latency_interval'][0]:.3f}" if f else "",
            "latency_high": f"{f['latency_interval'][1]:.3f}" if f else "",
            "rounds": len(f["latency_rounds"]) if f else "",
            "borderline": f.get("borderline", "") if f else "",
            "meets": front.meets(f, search.target) if f else "",
            "front": name in search.record.get("front", []),
            "seconds": f"{entry.get('seconds', 0.0):.0f}", "estimate": entry.get("estimate", ""),
            "launches": entry.get("launches", 0), "label": f.get("label", ""),
            "reason": entry.get("reason", ""), "flag": f.get("flag", "")})
    return found


def show(search) -> None:
    """candidates.csv, the table, the chosen candidate and where things are, and the
    report page with the search's chart."""
    from tftrain.training import report_page

    table = rows(search)
    with open(search.dir / "candidates.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    lines = _aligned([("candidate", "accuracy", "change", "size", "ms", "vs dense",
                       "interval", "status")]
                     + [_cells(r) for r in table])
    rule = "-" * min(console.WIDTH, max(len(line) for line in lines))
    record = search.record
    chosen = record.get("chosen")
    verdict = (f"chosen: {chosen} meets the target ({search.target.objective} first): "
               f"{record.get('chosen_file')}" if record.get("met") else
               f"no candidate meets the target; the closest, {chosen}, is exported: "
               f"{record.get('chosen_file')}" if chosen else "no candidate finished")
    for line in [rule, *lines, rule, verdict,
                 f"front: {', '.join(record.get('front', []))}",
                 f"search: {search.record_path}, {search.dir / 'candidates.csv'}; "
                 f"{console.seconds(record.get('seconds', 0.0))} in all"]:
        console.say(line)
    try:
        page = report_page.write(search.run_dir)
        console.say(f"report: {page}")
    except (OSError, ValueError, KeyError) as err:      # the run's own files are missing
        console.say(f"report: not written ({type(err).__name__}: {err})")


def _cells(r: dict) -> tuple:
    """A candidate's printed cells: its accuracy change said as a gain or a loss
    (`+5.56 pt` for a file better than the dense model), its size, latency and ratio."""
    mark = ("reference" if r["candidate"] == "float" else "meets" if r["meets"] is True
            else "misses" if r["meets"] is False else r["status"])
    change = f"{-float(r['drop_pt']):+.2f} pt" if r["drop_pt"] else ""
    interval = (f"{float(r['latency_low']):.2f}-{float(r['latency_high']):.2f}x, {r['rounds']} rounds"
                if r["latency_ratio"] and r["candidate"] != "float" else "")
    return (r["candidate"], r["accuracy"], change,
            console.size(r["bytes"]) if r["bytes"] != "" else "",
            r["latency_ms"][:6] if r["latency_ms"] else "",
            f"{float(r['latency_ratio']):.2f}x" if r["latency_ratio"] else "", interval,
            mark + (" (borderline)" if r["borderline"] is True else "")
            + (" (front)" if r["front"] else "") + (f"; {r['flag']}" if r["flag"] else ""))


def _aligned(rows: list[tuple]) -> list[str]:
    """Rows of cells as lines, each column as wide as its widest cell: the first left-
    aligned, the last as it is, the figures between right-aligned."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join([f"{row[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in
                                                   zip(row[1:-1], widths[1:-1])), row[-1]])
            for row in rows]
