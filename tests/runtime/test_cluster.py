"""Cluster environments: TF_CONFIG and SLURM, worker addresses and per-task GPUs."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from tftrain.runtime.cluster import (Task, current_task, expand_hostlist, expand_tasks_per_node,
                                     slurm_task, tf_config_task)
from tftrain.config import ConfigError


def test_slurm_host_and_task_lists_expand_in_order():
    assert expand_hostlist("n[1-2],m5,o[07-08,10]") == ["n1", "n2", "m5", "o07", "o08", "o10"]
    assert expand_hostlist("gpu-a,gpu-b") == ["gpu-a", "gpu-b"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE: cannot read 'two'"):
        expand_tasks_per_node("two")


def slurm(rank, nodes="gpu[07-08]", tasks="2(x2)", **extra):
    """The environment srun gives task `rank` of a 4-task step (job 7, step 0)."""
    return {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": str(rank),
            "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "TFTRAIN_PORT_BASE": "8888",
            "SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": tasks, **extra}


def test_slurm_addresses_follow_ranks_not_sorted_host_names():
    # node names out of order: rank 0 is on zeta (TensorFlow's resolver sorts by name)
    task = slurm_task(slurm(0, nodes="zeta,alpha"))
    assert task.workers == ("zeta:8888", "zeta:8889", "alpha:8888", "alpha:8889")
    assert task.rank == 0 and task.chief
    cyclic = slurm_task(slurm(1, nodes="zeta,alpha", SLURM_DISTRIBUTION="cyclic"))
    assert cyclic.workers == ("zeta:8888", "alpha:8888", "zeta:8889", "alpha:8889")


def test_two_slurm_jobs_on_one_node_listen_on_different_ports():
    """Ports follow the job and step: two jobs sharing a node do not collide (a fixed
    base made every job's first task listen on the same port); every task of one step
    computes the same addresses."""
    def ports(job, step="0", rank=0):
        env = {k: v for k, v in slurm(rank, SLURM_JOB_ID=job, SLURM_STEP_ID=step).items()
               if k != "TFTRAIN_PORT_BASE"}
        return [int(w.split(":")[1]) for w in slurm_task(env).workers]
    first, second, next_step = ports("1001"), ports("1002"), ports("1001", step="1")
    assert not set(first) & set(second) and not set(first) & set(next_step)
    assert ports("1001", rank=3) == first and all(1024 < p < 65536 for p in first + second)
    assert first[:2] == [first[0], first[0] + 1]                 # tasks of a node: consecutive


def test_an_allocation_not_started_by_srun_is_one_process_and_says_so():
    """A batch script or salloc shell sees SLURM_NTASKS of the allocation but is not one of
    its tasks: it must not wait as rank 0 of N for workers that never start."""
    from tftrain.runtime.cluster import slurm_without_srun
    from tftrain.doctor import cluster_environment
    batch = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    assert current_task(batch).source == "local" and current_task(batch).num_workers == 1
    assert slurm_without_srun(batch).startswith(
        "warning: inside a SLURM allocation of 4 tasks but not started by srun")
    assert "start each task with srun" in cluster_environment(batch)[0]
    assert current_task(slurm(2)).source == "SLURM" and not slurm_without_srun(slurm(2))
    with pytest.raises(ConfigError, match="SLURM_DISTRIBUTION: 'plane=2' is not supported"):
        slurm_task(slurm(0, SLURM_DISTRIBUTION="plane=2"))


@pytest.mark.parametrize("env,rank,gpus", [
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, 1, "1"),              # 2 GPUs, 2 tasks per node
    ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 3, "6,7"),        # SLURM granted GPUs 4-7
    ({"SLURM_STEP_GPUS": "2,3"}, 2, "2"),                   # granted, not yet visible-set
    ({"SLURM_GPUS_ON_NODE": "2"}, 1, "1"),                  # only a count
    ({"CUDA_VISIBLE_DEVICES": "3", "SLURM_GPUS_PER_TASK": "1"}, 1, "3"),   # bound by SLURM
    ({}, 1, None),                                          # a CPU node
])
def test_each_slurm_task_gets_its_share_of_the_node_gpus(env, rank, gpus):
    assert slurm_task(slurm(rank, **env)).gpus == gpus


def test_more_tasks_than_gpus_is_a_clear_error():
    with pytest.raises(ConfigError, match="SLURM: 2 tasks on this node share 1 GPUs"):
        slurm_task(slurm(0, CUDA_VISIBLE_DEVICES="0"))


def test_pinning_again_keeps_the_task_share():
    env = slurm(1, CUDA_VISIBLE_DEVICES="0,1")
    first = slurm_task(env).gpus
    env.update({"TFTRAIN_GRANTED_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": first})   # after pin_gpus
    assert slurm_task(env).gpus == first == "1"


def test_tf_config_ranks_and_chief():
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"]}
    worker = tf_config_task(json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    assert worker == Task("TF_CONFIG", ("c:1", "w:1", "w:2"), 2, False)
    plain = tf_config_task(json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                       "task": {"type": "worker", "index": 0}}))
    assert plain.chief and plain.num_workers == 2
    with pytest.raises(ConfigError, match="TF_CONFIG: not valid JSON"):
        tf_config_task("{nope")
    assert current_task({}).source == "local"


PROBE = """
import json, os
import tftrain
from tftrain.runtime import cluster
from tftrain.runtime import strategy
from tftrain.config import load_config
strategy.configure_devices(load_config(None, []))      # pins before any device is listed
import tensorflow as tf
task = cluster.current_task()
resolver = cluster.cluster_resolver(task)
print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "cluster": resolver.cluster_spec().as_dict(),
                  "task": [resolver.task_type, resolver.task_id],
                  "gpus": resolver.num_accelerators().get("GPU"),
                  "chief": strategy.is_chief(), "workers": strategy.cluster_spec()[1]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 2])
def test_a_faked_slurm_job_pins_each_task_without_nvidia_smi(tmp_path, rank):
    marker = tmp_path / "nvidia-smi-called"
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    fake.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "TF_CONFIG"))},
           **slurm(rank, nodes="node[1-2]", SLURM_GPUS_ON_NODE="2"),
           "PATH": f"{fake.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cluster"] == {"worker": ["node1:8888", "node1:8889", "node2:8888", "node2:8889"]}
    assert got["task"] == ["worker", rank] and got["workers"] == 4 and not got["chief"]
    assert got["visible"] == str(rank % 2) and got["gpus"] == 1     # GPU 0 or 1 of its node
    assert not marker.exists()
