"""A JobSet simulated on this machine: N local `tftrain.run` processes, each given exactly
what a pod of the manifest `python -m tftrain.launch --kubernetes` writes gets (the
ConfigMap's config, the container's command and environment, the values of the JobSet
labels the downward API reads, Kubernetes' JOB_COMPLETION_INDEX), the pods' DNS names
mapped to localhost ports through the test-only resolver (`TFTRAIN_TEST_HOSTS`), the
volume a run directory here. A lost pod is handled as the manifest's failure policy
makes JobSet handle it: every pod of the attempt stopped (SIGTERM, SIGKILL after the
grace period), then every pod started again with the same environment."""
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import yaml

from helpers import QUICKSTART, model_weights, resumed_at, start_run, wait_for_checkpoint
from test_launch import PLANNED, SETS, finish, launch
from tftrain.launch import free_ports
from tftrain.launch import main as launch_main

NAME = "train"
LABELS = {"jobset.sigs.k8s.io/jobset-name": NAME, "jobset.sigs.k8s.io/replicatedjob-name": "worker",
          "jobset.sigs.k8s.io/job-index": "0"}      # what JobSet puts on its pods


def manifest(tmp_path, workers: int, *sets) -> dict:
    """The JobSet manifest for `workers` pods of the run: its ConfigMap's config written
    to a file, the pod's container."""
    out = tmp_path / "jobset.yaml"
    assert launch_main(["--kubernetes", "--workers", str(workers), "--image", "tftrain:test",
                        "--name", NAME, str(QUICKSTART), "-o", str(out),
                        *[a for s in (*SETS, *sets) for a in ("--set", s)]]) == 0
    config, *_, jobset = yaml.safe_load_all(out.read_text())
    path = tmp_path / "config.yaml"
    path.write_text(config["data"]["config.yaml"])
    spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return {"config": path, "container": spec["containers"][0], "workers": workers}


class JobSet:
    """The pods of one manifest, started and stopped as JobSet's controller would."""

    def __init__(self, pods: dict, run_dir, peer_wait: float | None = None):
        self.pods, self.run_dir, self.procs = pods, run_dir, []
        self.ports = free_ports(pods["workers"])     # each pod's own port, on localhost
        self.peer_wait = peer_wait

    def environment(self, index: int) -> dict:
        """Pod `index`'s environment: the container's env, the downward API's values,
        Kubernetes' index, and the test resolver in place of the cluster's DNS."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM", "TF_CONFIG", "JOBSET_", "TFTRAIN_"))}
        for entry in self.pods["container"]["env"]:
            if "value" in entry:
                env[entry["name"]] = entry["value"]
            else:
                field = entry["valueFrom"]["fieldRef"]["fieldPath"]
                env[entry["name"]] = LABELS[field.split("'")[1]]
        env["JOB_COMPLETION_INDEX"] = str(index)
        subdomain = env["TFTRAIN_SUBDOMAIN"]
        env["TFTRAIN_TEST_HOSTS"] = json.dumps({f"{NAME}-worker-0-{i}.{subdomain}": f"localhost:{p}"
                                                for i, p in enumerate(self.ports)})
        return env

    def start(self, indices=None):
        """Pods `indices` (all), each running the container's command."""
        command = self.pods["container"]["command"]
        assert command[:3] == ["python", "-m", "tftrain.run"]
        args = [str(self.pods["config"]), *command[4:], "--run-dir", str(self.run_dir)]
        if self.peer_wait is not None:
            args += ["--set", f"distribute.peer_wait={self.peer_wait}"]
        self.procs = [start_run(*args, env=self.environment(i), session=True,
                                stderr=subprocess.STDOUT)
                      for i in (range(self.pods["workers"]) if indices is None else indices)]
        return self.procs

    def finish(self, timeout=300) -> tuple[list[int], str]:
        outs = []
        for proc in self.procs:
            code, out = finish(proc, timeout)
            outs.append(out)
        return [p.returncode for p in self.procs], "\n".join(outs)

    def delete(self, grace: float = 30.0) -> None:
        """Every pod stopped as Kubernetes deletes a pod: SIGTERM, SIGKILL after `grace`."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.time() + grace
        for proc in self.procs:
            try:
                proc.communicate(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=60)


def assert_same_weights(ours_dir, theirs_dir):
    ours, theirs = model_weights(ours_dir), model_weights(theirs_dir)
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_two_pods_train_to_the_weights_of_tftrain_launch(two_workers, tmp_path):
    """The `two_workers` run of test_launch.py (`tftrain.launch --workers 2`, TF_CONFIG)
    is the reference."""
    pods = JobSet(manifest(tmp_path, 2), tmp_path / "runs")
    pods.start()
    codes, out = pods.finish()
    assert codes == [0, 0], out[-4000:]
    assert out.count("cluster: 1 peers of worker") == 2
    summary = json.loads((tmp_path / "runs" / "quickstart" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["steps"] == PLANNED
    assert "cluster: 2 workers from JobSet train" in out
    assert_same_weights(tmp_path / "runs" / "quickstart", two_workers[0])


@pytest.mark.slow
def test_three_pods_train_to_the_weights_of_a_three_worker_launch(tmp_path):
    sets = ("train.epochs=1",)
    code, out = finish(launch(tmp_path / "launch", *sets, workers=3))
    assert code == 0, out[-3000:]
    pods = JobSet(manifest(tmp_path, 3, *sets), tmp_path / "runs")
    pods.start()
    codes, out = pods.finish()
    assert codes == [0, 0, 0], out[-4000:]
    summary = json.loads((tmp_path / "runs" / "quickstart" / "summary.json").read_text())
    assert summary["workers"] == 3 and summary["replicas"] == 3
    assert_same_weights(tmp_path / "runs" / "quickstart", tmp_path / "launch" / "quickstart")


@pytest.mark.slow
def test_a_killed_pod_restarts_the_set_which_resumes_to_the_uninterrupted_weights(two_workers,
                                                                                   tmp_path):
    pods = JobSet(manifest(tmp_path, 2), tmp_path / "runs")
    first = pods.start()
    saved = wait_for_checkpoint(tmp_path / "runs" / "quickstart" / "checkpoints", first[0],
                                at_least=20)
    os.killpg(first[1].pid, signal.SIGKILL)           # pod 1 lost (its node, an OOM kill)
    first[1].communicate(timeout=60)
    pods.delete()                                     # the Job failed: the set is recreated
    assert not (tmp_path / "runs" / "quickstart" / "summary.json").exists()
    pods.start()                                      # every pod, the same environment
    codes, out = pods.finish()
    assert codes == [0, 0], out[-4000:]
    assert resumed_at(out) >= saved and "resuming from" in out
    summary = json.loads((tmp_path / "runs" / "quickstart" / "summary.json").read_text())
    assert summary["steps"] == PLANNED
    assert_same_weights(tmp_path / "runs" / "quickstart", two_workers[0])


@pytest.mark.slow
def test_a_peer_that_never_comes_up_exits_2_within_the_wait_naming_it(tmp_path):
    pods = JobSet(manifest(tmp_path, 2), tmp_path / "runs", peer_wait=4)
    began = time.monotonic()
    pods.start(indices=[0])                           # pod 1 never scheduled
    codes, out = pods.finish(timeout=120)
    took = time.monotonic() - began
    assert codes == [2], out[-3000:]
    assert (f"tftrain: config error: distribute.peer_wait: worker 1 (train-worker-0-1.train at "
            f"localhost:{pods.ports[1]}) does not answer on port {pods.ports[1]} after 4 s") in out
    assert 4 <= took < 30, took
    assert not (tmp_path / "runs" / "quickstart").exists() and "Traceback" not in out


@pytest.mark.slow
def test_a_pod_with_a_wrong_index_exits_2_naming_it(tmp_path):
    pods = JobSet(manifest(tmp_path, 2), tmp_path / "runs")
    env = {**pods.environment(0), "JOB_COMPLETION_INDEX": "2"}
    proc = start_run(str(pods.pods["config"]), "--run-dir", str(tmp_path / "runs"), env=env,
                     session=True, stderr=subprocess.STDOUT)
    code, out = finish(proc, 120)
    assert code == 2 and out.strip().splitlines()[-1].startswith(
        "tftrain: config error: JobSet pod: JOB_COMPLETION_INDEX=2 is not below the 2 pods of a Job")
    assert not (tmp_path / "runs" / "quickstart").exists()
