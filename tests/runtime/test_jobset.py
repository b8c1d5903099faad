"""A Kubernetes JobSet pod's place in its cluster, from its environment, and the wait for
its peers before TensorFlow starts."""
import json
import socket
import threading
import time

import pytest

from tftrain.config import ConfigError
from tftrain.launch import free_ports
from tftrain.runtime import jobset
from tftrain.runtime.cluster import await_peers, current_task, describe_source


def pod(index, workers=3, **extra):
    """The variables pod `index` of a JobSet `train` (replicated Job `worker`) gets."""
    return {"JOBSET_NAME": "train", "JOBSET_REPLICATED_JOB": "worker", "JOBSET_JOB_INDEX": "0",
            "JOB_COMPLETION_INDEX": str(index), "TFTRAIN_WORKERS": str(workers), **extra}


def test_a_pod_finds_its_rank_and_its_peers_host_names():
    task = current_task(pod(1))
    assert task.source == "JobSet" and task.rank == 1 and not task.chief
    assert task.workers == ("train-worker-0-0.train:2222", "train-worker-0-1.train:2222",
                            "train-worker-0-2.train:2222")
    assert current_task(pod(0)).chief
    # two Jobs of 2 pods each, another subdomain and port: worker 3 is pod 1 of Job 1
    two_jobs = current_task(pod(1, workers=4, JOBSET_JOB_INDEX="1", TFTRAIN_PODS_PER_JOB="2",
                                TFTRAIN_SUBDOMAIN="net", TFTRAIN_PORT="5000"))
    assert two_jobs.rank == 3
    assert two_jobs.workers == ("train-worker-0-0.net:5000", "train-worker-0-1.net:5000",
                                "train-worker-1-0.net:5000", "train-worker-1-1.net:5000")


def test_a_tf_config_the_user_sets_wins_and_the_plan_says_which_source():
    tf_config = json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                            "task": {"type": "worker", "index": 1}})
    env = pod(0, TF_CONFIG=tf_config)
    task = current_task(env)
    assert task.source == "TF_CONFIG" and task.workers == ("a:1", "b:2") and task.rank == 1
    assert describe_source(env) == ("cluster: 2 workers from TF_CONFIG (set by the user: it "
                                    "wins over the JobSet pod's variables); this process is "
                                    "worker 1")
    assert describe_source(pod(2)) == (
        "cluster: 3 workers from JobSet train (pods train-worker-0-0 ... train-worker-0-2 of "
        "subdomain train, port 2222, JOB_COMPLETION_INDEX=2); this process is worker 2")
    assert describe_source({}) == ""


@pytest.mark.parametrize("change,message", [
    ({"TFTRAIN_WORKERS": None}, "JobSet pod: TFTRAIN_WORKERS is not set; the manifest gives it"),
    ({"JOB_COMPLETION_INDEX": None},
     "JobSet pod: JOB_COMPLETION_INDEX is not set; Kubernetes sets it in every pod of an "
     "Indexed Job: the replicated Job needs completionMode: Indexed"),
    ({"JOBSET_REPLICATED_JOB": None},
     "JobSet pod: JOBSET_REPLICATED_JOB is not set; set it from the pod's label "
     "jobset.sigs.k8s.io/replicatedjob-name"),
    ({"JOB_COMPLETION_INDEX": "3"},
     "JobSet pod: JOB_COMPLETION_INDEX=3 is not below the 3 pods of a Job"),
    ({"JOB_COMPLETION_INDEX": "one"},
     "JobSet pod: JOB_COMPLETION_INDEX='one' is not a whole number >= 0"),
    ({"JOBSET_JOB_INDEX": "1"},
     "JobSet pod: JOBSET_JOB_INDEX=1 with 3 pods a Job is worker 4, not below TFTRAIN_WORKERS=3"),
    ({"TFTRAIN_WORKERS": "0"}, "JobSet pod: TFTRAIN_WORKERS='0' is not a whole number >= 1"),
    ({"TFTRAIN_PODS_PER_JOB": "2"},
     "JobSet pod: TFTRAIN_WORKERS=3 is not a whole number of Jobs of TFTRAIN_PODS_PER_JOB=2"),
])
def test_a_wrong_index_or_a_missing_variable_is_named(change, message):
    env = {k: v for k, v in {**pod(1), **change}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        current_task(env)
    assert str(err.value).startswith(message), str(err.value)


def test_the_test_resolver_maps_host_names_to_local_addresses():
    hosts = {"train-worker-0-0.train": "localhost:7001", "train-worker-0-2.train": "localhost:7003"}
    task = current_task(pod(0, TFTRAIN_TEST_HOSTS=json.dumps(hosts)))
    assert task.workers == ("localhost:7001", "train-worker-0-1.train:2222", "localhost:7003")


def test_peers_that_start_at_different_times_find_each_other():
    """Three pods of one set, the last starting 1.5 s after the first: each waits while
    answering on its own port, and all three go on once every peer answers."""
    ports = free_ports(3)
    workers = tuple(f"localhost:{p}" for p in ports)
    waited, listeners, errors = {}, [], []

    def start(rank, delay):
        time.sleep(delay)
        try:
            waited[rank], listener = jobset.wait_for_peers(workers, rank, seconds=30, poll=0.1)
            listeners.append(listener)
        except Exception as err:       # noqa: BLE001
            errors.append(err)
    threads = [threading.Thread(target=start, args=(r, d)) for r, d in ((0, 0), (1, 0.5), (2, 1.5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(waited) == [0, 1, 2]
    assert waited[0] >= 1.4 and waited[2] < 1.0       # the first waited for the last
    for listener in listeners:          # what the strategy's build does (jobset.release)
        listener.close()
    for port in ports:                  # every port free again for TensorFlow's server
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))


def test_a_peer_that_never_answers_is_named_after_the_configured_wait():
    ports = free_ports(2)
    began = time.monotonic()
    with pytest.raises(ConfigError) as err:
        jobset.wait_for_peers((f"localhost:{ports[0]}", f"localhost:{ports[1]}"), 0, seconds=1.0,
                              names=["train-worker-0-0.train", "train-worker-0-1.train"], poll=0.1)
    took = time.monotonic() - began
    assert 1.0 <= took < 4.0, took
    assert str(err.value).startswith(
        f"distribute.peer_wait: worker 1 (train-worker-0-1.train at localhost:{ports[1]}) does "
        f"not answer on port {ports[1]} after 1 s (1 of 1 peers missing)"), str(err.value)


def test_a_peer_whose_name_does_not_resolve_is_named():
    """Through the environment, as a pod sees it: no DNS record for pod 1 (the JobSet
    without enableDNSHostnames, or the pod not yet created)."""
    port = free_ports(1)[0]
    env = pod(0, workers=2, TFTRAIN_PORT=str(port), TFTRAIN_SUBDOMAIN="invalid",
              TFTRAIN_TEST_HOSTS=json.dumps({"train-worker-0-0.invalid": f"localhost:{port}"}))
    with pytest.raises(ConfigError, match=r"worker 1 \(train-worker-0-1.invalid\) does not "
                                          r"resolve after 0.5 s"):
        await_peers(0.5, env)
    assert await_peers(0.5, pod(0, workers=1)) == ""      # a set of one waits for nobody
    assert await_peers(0.5, {}) == ""                      # not a pod


def test_the_pod_template_gives_the_variables_a_pod_reads():
    entries = {e["name"]: e for e in jobset.environment("train", 4, 2222)}
    assert entries["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    assert entries["JOBSET_JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/job-index']"
    assert {k: e["value"] for k, e in entries.items() if "value" in e} == {
        "TFTRAIN_WORKERS": "4", "TFTRAIN_PODS_PER_JOB": "4", "TFTRAIN_PORT": "2222",
        "TFTRAIN_SUBDOMAIN": "train"}
