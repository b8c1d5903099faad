"""Run directory: atomic writes, completed vs interrupted, config changes refused."""
import json

import pytest

from tftrain.config import ConfigError, load_config
from tftrain.training.rundir import atomic_write, open_run_dir, read_summary, report_table


def test_new_then_resumed_then_changed(tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=a"])
    first = open_run_dir(cfg)
    assert not first.resumed and (tmp_path / "a" / "config.yaml").exists()
    assert open_run_dir(cfg).resumed
    with pytest.raises(ConfigError, match=r"run\.name: .* different config \(-  epochs: 10; \+  epochs: 3\)"):
        open_run_dir(load_config(None, [f"run.dir={tmp_path}", "run.name=a", "train.epochs=3"]))


def test_non_chief_writes_nothing(tmp_path):
    open_run_dir(load_config(None, [f"run.dir={tmp_path}"]), write=False)
    assert list(tmp_path.iterdir()) == []


def test_only_completed_summaries_count(tmp_path):
    assert read_summary(tmp_path) is None
    (tmp_path / "summary.json").write_text('{"status": "comp')           # torn write
    assert read_summary(tmp_path) is None
    atomic_write(tmp_path / "summary.json", json.dumps({"status": "completed"}))
    assert read_summary(tmp_path) == {"status": "completed"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]      # no temp file left


def test_report_table_lists_metrics_and_artifacts():
    table = report_table({"status": "completed", "strategy": "mirrored", "replicas": 2,
                          "precision": "float32", "global_batch_size": 64, "epochs": 1, "steps": 3,
                          "throughput": {"examples_per_sec": 10.0}, "metrics": {"val_accuracy": 0.5},
                          "artifacts": {"saved_model": {"size_bytes": 10, "gzip_bytes": 5, "accuracy": 0.5}}})
    assert "val_accuracy" in table and "0.5000" in table and "export saved_model" in table


def test_report_table_shows_what_each_stage_cost_and_gained():
    stage = lambda updates, seconds, acc: {"updates": updates, "seconds": seconds,  # noqa: E731
                                           "metrics": {"val_accuracy": acc}}
    table = report_table({"status": "completed", "strategy": "mirrored", "replicas": 2,
                          "precision": "float32", "global_batch_size": 64, "epochs": 1, "steps": 3,
                          "throughput": {"examples_per_sec": 10.0}, "metrics": {"val_accuracy": 0.97},
                          "stages": {"train": stage(3, 12.2, 0.99), "prune": stage(4, 5.0, 0.9725),
                                     "qat": stage(2, 3.0, 0.97)},
                          "sparsity": {"dense": 0.8},
                          "artifacts": {"tflite_int8": {"size_bytes": 10, "gzip_bytes": 5,
                                                        "accuracy": 0.97, "latency_ms": 0.0123}}})
    lines = table.splitlines()
    assert any(l.split() == ["stage", "train", "3", "updates,", "12", "s,", "val_accuracy", "0.9900"] for l in lines)
    assert any("stage prune" in l and "0.9725 (-1.75 pt)" in l for l in lines)
    assert any("stage qat" in l and "(-0.25 pt)" in l for l in lines)
    assert any(l.split() == ["sparsity", "dense", "0.800"] for l in lines)
    assert "0.012 ms/example" in table
