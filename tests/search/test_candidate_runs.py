"""A candidate's own run directory: seeded with the dense run's finished stages (its
checkpoints linked, not copied), as it is when it exists, and what a refused run's log
ended with."""
from __future__ import annotations

import json
import os

import yaml

from tftrain.config import dump_config, load_config
from tftrain.search import candidate_runs

from helpers import QUICKSTART


def _dense(tmp_path, checkpoints=True):
    dense = tmp_path / "dense"
    (dense / "checkpoints" / "prune").mkdir(parents=True)
    (dense / "checkpoints" / "ckpt-10.index").write_text("index")
    (dense / "checkpoints" / "prune" / "ckpt-3.index").write_text("pruned")
    (dense / "topology.json").write_text(json.dumps({"workers": 1}))
    if not checkpoints:
        for f in sorted((dense / "checkpoints").rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        (dense / "checkpoints").rmdir()
    return dense


def _config():
    return yaml.safe_load(dump_config(load_config(QUICKSTART)))


def test_a_candidate_directory_holds_the_dense_stages_linked_and_is_kept_once_made(tmp_path):
    dense = _dense(tmp_path)
    stages = {"train": {"updates": 10}}
    path = candidate_runs.prepare(tmp_path / "search", dense, stages, "int8", _config())
    assert path == tmp_path / "search" / "runs" / "int8"
    linked = path / "checkpoints" / "ckpt-10.index"
    assert os.path.samefile(linked, dense / "checkpoints" / "ckpt-10.index")
    assert not (path / "checkpoints" / "prune").exists()       # not a dense stage
    assert json.loads((path / "stages.json").read_text()) == stages
    assert yaml.safe_load((path / "config.yaml").read_text())["run"]["name"] == "int8"
    assert (tmp_path / "search" / "configs" / "int8.yaml").exists()
    (path / "marker").write_text("a resumed candidate's own files")
    assert candidate_runs.prepare(tmp_path / "search", dense, stages, "int8", _config()) == path
    assert (path / "marker").exists()
    assert not list((tmp_path / "search" / "runs").glob(".*.new"))


def test_a_dense_run_that_trained_nothing_seeds_no_stage(tmp_path):
    dense = _dense(tmp_path, checkpoints=False)
    path = candidate_runs.prepare(tmp_path / "search", dense, {"train": {}}, "int8", _config())
    assert not (path / "stages.json").exists() and list((path / "checkpoints").iterdir()) == []


def test_the_last_tftrain_line_of_a_log_is_the_reason(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("noise\ntftrain: warning: slow\nmore\ntftrain: config error: no groups\n")
    assert candidate_runs.last_error(log) == "config error: no groups"
    assert candidate_runs.last_error(tmp_path / "missing.log") == "no log"
    assert candidate_runs.summary_of(tmp_path) is None
