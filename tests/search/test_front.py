"""A candidate's figures, the target, the Pareto front and the candidate to ship."""
from __future__ import annotations

import pytest

from tftrain.config import load_config
from tftrain.search import front


def target(*sets):
    return load_config(None, [f"compression.target.{s}" for s in sets]).compression.target


def summary(accuracy, size, gzip, ms, speedup=None):
    entry = {"accuracy": accuracy, "size_bytes": size, "gzip_bytes": gzip,
             "latency_grid": {"batch1_threads1": ms, "batch32_threads1": ms / 4}}
    if speedup is not None:
        entry.update(latency_grid_beside_reference={"batch1_threads1": ms * 0.9,
                                                    "batch32_threads1": ms / 5},
                     speedup_vs_reference={"batch1_threads1": speedup, "batch32_threads1": 3.0},
                     speedup_rounds_vs_reference={
                         "batch1_threads1": [speedup, speedup * 1.25, speedup * 0.8],
                         "batch32_threads1": [3.0, 2.0, 4.0]})
    return {"artifacts": {"tflite_int8": entry}}


def test_figures_of_the_deployed_file_against_the_dense_one():
    t = target()
    dense = front.figures(summary(0.95, 1000, 900, 0.2), "tflite_int8", t, None)
    assert dense == {"artifact": "tflite_int8", "accuracy": 0.95, "drop": 0.0, "bytes": 1000,
                     "latency_ms": 0.2, "latency_ratio": 1.0, "latency_rounds": [1.0],
                     "latency_interval": [0.97, 1.03], "borderline": False, "label": "",
                     "fallback": []}
    found = front.figures(summary(0.94, 300, 200, 0.1, speedup=2.5), "tflite_int8", t, dense)
    # the latency timed in turn with the dense file, the ratio the median of the rounds',
    # each round's ratio kept, and the interval they give the median (3 rounds: the range)
    assert found["latency_ms"] == pytest.approx(0.09) and found["latency_ratio"] == pytest.approx(0.4)
    assert found["latency_rounds"] == pytest.approx([0.4, 0.32, 0.5])
    assert found["latency_interval"] == pytest.approx([0.32, 0.5]) and not found["borderline"]
    assert found["drop"] == pytest.approx(0.01) and found["bytes"] == 300
    gz = front.figures(summary(0.94, 300, 200, 0.1, speedup=2.5), "tflite_int8",
                       target("size=gzip", "latency={batch: 32}"), dense)
    assert gz["bytes"] == 200 and gz["latency_ratio"] == pytest.approx(1 / 3)


def row(name, accuracy, ms, size, drop=0.0, ratio=1.0):
    return {"name": name, "accuracy": accuracy, "latency_ms": ms, "bytes": size, "drop": drop,
            "latency_ratio": ratio}


def test_the_front_keeps_only_what_nothing_beats_on_all_three():
    rows = [row("a", 0.95, 1.0, 100), row("b", 0.94, 0.5, 100), row("c", 0.93, 0.6, 120),
            row("d", 0.95, 1.0, 100), row("e", 0.90, 0.4, 30)]
    assert [r["name"] for r in front.pareto(rows)] == ["a", "b", "d", "e"]   # c: b beats it


def test_the_objective_chooses_among_those_meeting_the_target_else_the_closest():
    t = target("max_accuracy_drop=0.01", "max_bytes=100")
    rows = [row("small", 0.90, 0.4, 30, drop=0.05), row("fast", 0.945, 0.5, 100, drop=0.005),
            row("accurate", 0.95, 0.9, 90, drop=0.0), row("big", 0.95, 0.3, 400)]
    chosen, met = front.choose(rows, t)
    assert met and chosen["name"] == "fast"
    assert front.choose(rows, target("max_accuracy_drop=0.01", "max_bytes=100",
                                     "objective=bytes"))[0]["name"] == "accurate"
    assert front.choose(rows, target("max_accuracy_drop=0.01", "max_bytes=100",
                                     "objective=accuracy"))[0]["name"] == "accurate"
    # 20 bytes: nothing meets it; the closest misses it by the least share (small: 0.5 +
    # 4 for its drop; accurate: 3.5)
    chosen, met = front.choose(rows, target("max_accuracy_drop=0.01", "max_bytes=20"))
    assert not met and chosen["name"] == "accurate"
    assert front.choose([], t) == (None, False)
    assert front.meets(rows[1], t) and not front.meets(rows[3], t)
