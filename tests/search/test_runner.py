"""The search's runner without running candidates: which candidates the record so far
skips (and why, kept in search.json), and how many Optuna proposals a skip frees."""
from __future__ import annotations

import json

import numpy as np

from tftrain.search import candidates as cands
from tftrain.search import timing
from tftrain.search.candidates import Candidate
from tftrain.search.runner import Search

from test_candidates import target


def _search(tmp_path, entries: dict, *sets) -> Search:
    found = object.__new__(Search)          # the record alone: no dense run needed
    found.target = target(*sets)
    found.dir, found.record_path = tmp_path, tmp_path / "search.json"
    found.record = {"candidates": entries, "order": []}
    return found


def _done(candidate, **figures):
    base = {"accuracy": 0.9, "drop": 0.0, "bytes": 50_000, "latency_ms": 0.01,
            "latency_ratio": 0.4, "label": "", "fallback": []}
    return {"candidate": candidate.as_dict(), "origin": candidate.origin, "launches": 1,
            "status": "done", "figures": {**base, **figures}}


def test_a_candidate_ruled_out_is_recorded_skipped_and_its_slot_goes_to_optuna(tmp_path):
    half = Candidate("float", channels=0.5)
    search = _search(tmp_path, {"float": _done(cands.DENSE), half.name: _done(half, drop=0.03)},
                     "max_accuracy_drop=0.01", "candidates=4", "refine=1")
    before = search._refining()
    harsher = Candidate("float", channels=0.35)
    assert search._ruled_out(harsher)
    saved = json.loads((tmp_path / "search.json").read_text())["candidates"][harsher.name]
    assert saved["status"] == "skipped" and "lost 3.00 pt" in saved["reason"]
    assert search._ruled_out(harsher)                       # as recorded, when resumed
    assert not search._ruled_out(Candidate("qat", channels=0.35))
    # one refinement and one freed slot: two Optuna candidates before it stops refining
    assert before
    for k in range(2):
        proposal = Candidate("qat", channels=0.6 + 0.1 * k, origin="optuna")
        search.record["candidates"][proposal.name] = _done(proposal)
    assert not search._refining()


def test_a_skipped_optuna_proposal_frees_no_slot(tmp_path):
    """Only a listed candidate's skip gives Optuna one more proposal: proposals skipped
    in turn do not add more, so the search runs the list and `refine` proposals, as
    its plan and estimate say."""
    search = _search(tmp_path, {"float": _done(cands.DENSE)}, "candidates=12", "refine=2")
    for k in range(4):                      # four proposals ruled out: no slot freed
        proposal = Candidate("float", channels=0.2 + 0.05 * k, origin="optuna")
        search.record["candidates"][proposal.name] = {
            "candidate": proposal.as_dict(), "origin": "optuna", "status": "skipped"}
    for k in range(2):
        assert search._refining()
        proposal = Candidate("qat", channels=0.6 + 0.1 * k, origin="optuna")
        search.record["candidates"][proposal.name] = _done(proposal)
    assert not search._refining()


def test_after_channel_pruning_is_refused_at_its_plan_no_other_level_is_tried(tmp_path):
    refused = Candidate("qat", channels=0.25)
    entry = {"candidate": refused.as_dict(), "origin": "list", "launches": 1,
             "status": "refused", "reason": "config error: compression.pruning.structure: "
                                             "channels found no group of channels the model can lose"}
    search = _search(tmp_path, {"float": _done(cands.DENSE), refused.name: entry})
    assert search._ruled_out(Candidate("float", channels=0.7))
    reason = search.record["candidates"]["channels70-float"]["reason"]
    assert reason.startswith("channels25-qat was refused at its plan")
    assert not search._ruled_out(Candidate("qat"))                # no channel pruning in it


def test_a_narrower_candidate_timed_slower_is_timed_again_and_flagged_if_it_still_is(
        tmp_path, monkeypatch):
    """channels50-qat timed at 0.54x, slower than channels70-qat at 0.50x: both are timed
    again; where the narrower stays slower it is flagged, where the new rounds put it
    ahead it is not, and a pair is re-timed once."""
    c50, c70 = Candidate("qat", channels=0.5), Candidate("qat", channels=0.7)

    def rounds(ratio):
        return {"latency_rounds": [ratio] * 5, "latency_interval": [ratio, ratio],
                "latency_ratio": ratio, "artifact": "tflite_int8"}
    for new50, flagged in ((0.56, True), (0.40, False)):
        search = _search(tmp_path, {"float": _done(cands.DENSE, latency_ms=1.0),
                                    c50.name: _done(c50, **rounds(0.54)),
                                    c70.name: _done(c70, **rounds(0.50))}, "max_latency_ratio=0.6")
        search.record["dense"] = {"latency_ms": 1.0}
        search.run_dir = tmp_path
        timed = []
        monkeypatch.setattr(timing, "retimed", lambda file, ref, latency, n: timed.append(
            file.parts[-3]) or [new50 if "channels50" in str(file) else 0.5] * n)
        search._recheck_order()
        assert timed == [c50.name, c70.name]
        f50 = search.record["candidates"][c50.name]["figures"]
        assert f50["latency_ratio"] == np.median([0.54] * 5 + [new50] * 10)
        assert ("flag" in f50) == flagged
        if flagged:
            assert f50["flag"].startswith("timed slower than the wider channels70-qat")
        search._recheck_order()                      # once a pair
        assert timed == [c50.name, c70.name]
