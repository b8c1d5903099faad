"""Run directory: atomic writes, completed vs interrupted, config changes refused, a
resume on another topology allowed when it keeps the global batch."""
import json

import pytest

from tftrain.config import ConfigError, load_config
from tftrain.training.rundir import (atomic_write, describe_topology, open_run_dir,
                                    read_summary, read_topology, recorded_streams, streams_of)

TOPOLOGY = {"workers": 1, "replicas": 2, "per_replica_batch": 32, "accumulation_steps": 1,
            "global_batch": 64, "shard_policy": "auto", "streams": 1, "precision": "float32",
            "all_reduce": "float32", "loss_scaled": False}


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


def _cfg(tmp_path, *sets):
    return load_config(None, [f"run.dir={tmp_path}", "run.name=a", "distribute.virtual_cpus=2",
                              *sets])


def test_a_resume_on_another_topology_that_keeps_the_global_batch_is_allowed(tmp_path):
    first = open_run_dir(_cfg(tmp_path), topology=TOPOLOGY)
    assert first.previous is None and read_topology(tmp_path / "a") == TOPOLOGY
    # one replica, two accumulation steps: the same 64 examples per update
    one = {**TOPOLOGY, "replicas": 1, "accumulation_steps": 2}
    cfg = _cfg(tmp_path, "distribute.virtual_cpus=1", "train.accumulation_steps=2")
    resumed = open_run_dir(cfg, topology=one)
    assert resumed.resumed and resumed.previous == TOPOLOGY
    assert read_topology(tmp_path / "a") == one                 # what new checkpoints are under
    assert "accumulation_steps: 2" in (tmp_path / "a" / "config.yaml").read_text()
    # the global batch derived from train.global_batch_size on four replicas: also 64
    four = {**TOPOLOGY, "replicas": 4, "per_replica_batch": 16}
    derived = _cfg(tmp_path, "distribute.virtual_cpus=4", "train.global_batch_size=64")
    with pytest.raises(ConfigError, match="different config"):    # not a topology key
        open_run_dir(derived, topology=four)
    assert describe_topology(one) == ("1 worker(s), 1 replica(s) x 32 x 2 accumulation = "
                                      "global batch 64, float32 with a float32 all-reduce")


def test_a_resume_that_changes_the_global_batch_or_the_file_streams_is_refused(tmp_path):
    open_run_dir(_cfg(tmp_path), topology=TOPOLOGY)
    before = sorted(p.name for p in (tmp_path / "a").iterdir())
    # the same config on one device: 32 examples per update instead of 64
    with pytest.raises(ConfigError, match=r"would change the global batch from 64 to 32 "
                                          r"examples per update .* train\.global_batch_size: 64"):
        open_run_dir(_cfg(tmp_path, "distribute.virtual_cpus=1"),
                     topology={**TOPOLOGY, "replicas": 1, "global_batch": 32})
    # the files read as another number of streams than the run began with
    (tmp_path / "a" / "topology.json").write_text(json.dumps({**TOPOLOGY, "workers": 2,
                                                              "streams": 2}))
    with pytest.raises(ConfigError, match=r"would read its files as 1 stream\(s\), not the 2 "
                                          r"it began with"):
        open_run_dir(_cfg(tmp_path), topology=TOPOLOGY)
    (tmp_path / "a" / "topology.json").write_text(json.dumps(TOPOLOGY))
    with pytest.raises(ConfigError, match=r"different config \(-  epochs: 10; \+  epochs: 3\)"):
        open_run_dir(_cfg(tmp_path, "distribute.virtual_cpus=1", "train.epochs=3"),
                     topology={**TOPOLOGY, "replicas": 1, "accumulation_steps": 2})
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == before
    assert read_topology(tmp_path / "a") == TOPOLOGY


@pytest.mark.parametrize("streams", [1, 2])
def test_a_resume_on_another_number_of_workers_is_allowed(tmp_path, streams):
    """One shared stream, or files read as 2 streams (FILE sharding): the streams are
    reassigned to the workers there are (`EpochLayout`), so the worker count is free."""
    two = {**TOPOLOGY, "workers": 2, "streams": streams}
    open_run_dir(_cfg(tmp_path), topology=two)
    one = {**two, "workers": 1}
    assert open_run_dir(_cfg(tmp_path), topology=one).previous == two
    assert read_topology(tmp_path / "a") == one
    assert recorded_streams(tmp_path / "a") == streams
    assert describe_topology(one).endswith(", files read as 2 streams") == (streams == 2)
    old = {k: v for k, v in two.items() if k != "streams"}      # recorded before streams
    assert streams_of({**old, "shared_stream": streams == 1}) == streams


def test_a_run_without_a_recorded_topology_resumes_only_with_the_same_config(tmp_path):
    open_run_dir(_cfg(tmp_path))                     # no topology: a run from before it
    assert read_topology(tmp_path / "a") is None
    with pytest.raises(ConfigError, match="different config"):
        open_run_dir(_cfg(tmp_path, "distribute.virtual_cpus=1"), topology=TOPOLOGY)


def test_a_run_directory_moved_elsewhere_resumes_there(tmp_path):
    """run.dir says where the run is, not what it computes: a run directory copied to
    other storage resumes from its new place (and says so in its config)."""
    import shutil
    open_run_dir(_cfg(tmp_path / "old"), topology=TOPOLOGY)
    shutil.copytree(tmp_path / "old", tmp_path / "new")
    moved = open_run_dir(_cfg(tmp_path / "new"), topology=TOPOLOGY)
    assert moved.resumed and moved.path == tmp_path / "new" / "a"
    assert f"dir: {tmp_path / 'new'}" in (moved.path / "config.yaml").read_text()
