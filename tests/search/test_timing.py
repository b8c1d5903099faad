"""A candidate's latency ratio with its interval: re-timed while it straddles the limit,
borderline when it still does, and a narrower model timed slower than a wider one found."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tftrain.core.keras import keras
from tftrain.search import timing
from tftrain.search.candidates import DENSE, Candidate

from test_candidates import target


def test_the_interval_of_the_median_is_of_order_statistics_with_its_coverage():
    """5 rounds: the range (93.75% of the time it holds the median); 20 rounds: the 6th
    and 15th values (95.9%; the 7th and 14th would hold it 88.5% of the time)."""
    assert timing.median_interval([0.5, 0.3, 0.9, 0.4, 0.6]) == (0.3, 0.9)
    assert timing._coverage(5, 1) == pytest.approx(0.9375)
    assert timing.median_interval(list(range(20, 0, -1))) == (6, 15)
    assert timing._coverage(20, 6) == pytest.approx(1 - 2 * sum(math.comb(20, i) for i in range(6)) / 2 ** 20)
    assert timing._coverage(20, 6) >= 0.9 > timing._coverage(20, 7)
    # drawn from a known distribution, the interval holds its median about as often
    rng = np.random.default_rng(0)
    held = np.mean([lo <= 1.0 <= hi for lo, hi in
                    (timing.median_interval(list(rng.lognormal(0.0, 0.3, 15))) for _ in range(2000))])
    assert held >= 0.9 - 0.02


def test_the_limit_is_the_tighter_of_the_ratio_and_the_milliseconds():
    assert timing.ratio_limit(target("max_latency_ratio=0.5"), {"latency_ms": 1.0}) == 0.5
    assert timing.ratio_limit(target("max_latency_ratio=0.5", "max_latency_ms=0.4"),
                              {"latency_ms": 1.0}) == pytest.approx(0.4)
    assert timing.ratio_limit(target(), {"latency_ms": 1.0}) is None
    assert timing.straddles((0.45, 0.55), 0.5) and not timing.straddles((0.41, 0.49), 0.5)
    assert not timing.straddles((0.51, 0.6), 0.5) and not timing.straddles((0.4, 0.6), None)


def _figures(rounds):
    return {"latency_rounds": list(rounds), "latency_ratio": float(np.median(rounds)),
            "latency_interval": list(timing.ratio_interval(rounds)), "latency_ms": 0.5}


def test_an_interval_is_at_least_min_spread_either_side_of_the_median():
    """Five rounds within 0.4% of 0.496 (as channels67-qat's in one search, 0.503 in the
    next) straddle 0.5 once widened to 3%: borderline, not a decision."""
    low, high = timing.ratio_interval([0.495, 0.496, 0.497, 0.496, 0.4965])
    assert (low, high) == (pytest.approx(0.496 * 0.97), pytest.approx(0.496 * 1.03))
    assert timing.straddles((low, high), 0.5)
    assert timing.ratio_interval([0.3, 0.6, 0.45]) == (0.3, 0.6)        # wider already


def test_a_ratio_straddling_the_limit_is_timed_again_until_it_clears_it(monkeypatch):
    """Five rounds 0.44-0.56 straddle 0.5: ten more at 0.45-0.47 clear it (meets, not
    borderline). Rounds that keep straddling it stop at MAX_ROUNDS: borderline."""
    calls = []
    monkeypatch.setattr(timing, "retimed", lambda file, ref, latency, rounds: calls.append(rounds)
                        or list(np.linspace(0.45, 0.47, rounds)))
    t, dense = target("max_latency_ratio=0.5"), {"latency_ms": 1.0}
    f = _figures([0.44, 0.56, 0.46, 0.47, 0.48])
    timing.settle(f, "c.tflite", "d.tflite", t, dense)
    assert calls == [timing.MORE_ROUNDS] and len(f["latency_rounds"]) == 15
    assert f["latency_interval"][1] < 0.5 and not f["borderline"]
    assert f["latency_ratio"] == pytest.approx(np.median(f["latency_rounds"]))
    assert f["latency_ms"] == pytest.approx(f["latency_ratio"] * 1.0)
    calls.clear()
    monkeypatch.setattr(timing, "retimed", lambda file, ref, latency, rounds: calls.append(rounds)
                        or [0.4, 0.6] * (rounds // 2))
    g = _figures([0.44, 0.56, 0.46, 0.47, 0.58])
    timing.settle(g, "c.tflite", "d.tflite", t, dense)
    assert len(g["latency_rounds"]) == timing.MAX_ROUNDS and len(calls) == 4
    assert g["borderline"] and timing.straddles(tuple(g["latency_interval"]), 0.5)
    h = _figures([0.3, 0.31, 0.29, 0.3, 0.32])                  # clear at once: not timed
    calls.clear()
    timing.settle(h, "c.tflite", "d.tflite", t, dense)
    assert calls == [] and not h["borderline"]


def test_a_file_is_timed_again_against_the_dense_one_in_the_target_setting(tmp_path):
    """Two real TFLite files, one with about 60 times the other's multiply-adds: each
    round's ratio (the big file's time over the small one's) well above 1."""
    import tensorflow as tf

    paths = []
    for width in (8, 512):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        h = keras.layers.Dense(width, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dense(width)(h)))
        path = tmp_path / f"w{width}.tflite"
        path.write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
        paths.append(path)
    ratios = timing.retimed(paths[1], paths[0], target("latency={batch: 32}").latency, 4)
    assert len(ratios) == 4 and np.median(ratios) > 1.5, ratios
    assert timing.examples(paths[0].read_bytes(), "tflite").shape == (32, 64)


def test_a_narrower_candidate_timed_slower_than_a_wider_one_of_its_kind_is_found():
    c50, c70 = Candidate("qat", channels=0.5), Candidate("qat", channels=0.7)
    f70 = Candidate("float", channels=0.7)
    measured = [(DENSE, {"latency_ratio": 1.0}), (c50, {"latency_ratio": 0.54}),
                (c70, {"latency_ratio": 0.50}), (f70, {"latency_ratio": 0.9}),
                (Candidate("int8"), {"latency_ratio": 0.52})]
    # int8 after training and after QAT are files of one kind; a float file is another
    assert timing.narrower_slower(measured) == [(c50, c70), (c50, Candidate("int8"))]
