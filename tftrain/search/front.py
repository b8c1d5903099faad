"""A candidate's figures (from its run's summary), whether they meet the target, the
Pareto front of accuracy, latency and bytes, and the candidate to ship."""
from __future__ import annotations

from tftrain.search.candidates import violations
from tftrain.search.timing import ratio_interval


def figures(summary: dict, artifact: str, target, dense: dict | None) -> dict:
    """The deployed file's figures: validation accuracy and its drop against the dense
    file's (`dense`; None: this is the dense file), bytes (the file, or gzipped, as the
    target counts), ms per example in the target's setting (timed in turn with the dense
    file) and the ratio to the dense file's."""
    entry = summary["artifacts"][artifact]
    setting = f"batch{target.latency.batch}_threads{target.latency.threads or 'all'}"
    if dense is None:
        latency, ratio, rounds = entry["latency_grid"][setting], 1.0, [1.0]
    else:
        latency = entry["latency_grid_beside_reference"][setting]
        ratio = 1.0 / entry["speedup_vs_reference"][setting]
        rounds = [1.0 / s for s in entry.get("speedup_rounds_vs_reference", {}).get(setting, [])]
    accuracy = entry["accuracy"]
    return {"artifact": artifact, "accuracy": accuracy,
            "drop": 0.0 if dense is None else dense["accuracy"] - accuracy,
            "bytes": entry["gzip_bytes" if target.size == "gzip" else "size_bytes"],
            "latency_ms": latency, "latency_ratio": ratio, "latency_rounds": rounds or [ratio],
            "latency_interval": list(ratio_interval(rounds or [ratio])), "borderline": False,
            "label": entry.get("label", ""), "fallback": (entry.get("fallback") or {}).get("layers", [])}


def meets(found: dict, target) -> bool:
    return all(v <= 1e-9 for v in violations(found, target))


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on accuracy, latency and bytes at once."""
    def beats(a, b):
        no_worse = (a["accuracy"] >= b["accuracy"] and a["latency_ms"] <= b["latency_ms"]
                    and a["bytes"] <= b["bytes"])
        better = (a["accuracy"] > b["accuracy"] or a["latency_ms"] < b["latency_ms"]
                  or a["bytes"] < b["bytes"])
        return no_worse and better
    return [r for r in rows if not any(beats(o, r) for o in rows if o is not r)]


def choose(rows: list[dict], target) -> tuple[dict | None, bool]:
    """(the candidate to ship, whether it meets the target): the best by
    `target.objective` of those meeting it, else the closest (the least summed excess
    over the limits, as shares of them)."""
    if not rows:
        return None, False
    meeting = [r for r in rows if meets(r, target)]
    if meeting:
        key = {"latency": lambda r: (r["latency_ms"], r["bytes"], -r["accuracy"]),
               "bytes": lambda r: (r["bytes"], r["latency_ms"], -r["accuracy"]),
               "accuracy": lambda r: (-r["accuracy"], r["latency_ms"], r["bytes"])}
        return min(meeting, key=key[target.objective]), True
    return min(rows, key=lambda r: sum(max(0.0, v) for v in violations(r, target))), False
