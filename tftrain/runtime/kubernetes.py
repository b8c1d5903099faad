"""The Kubernetes manifest of a multi-worker run: a JobSet of N indexed pods, each
`python -m tftrain.run` finding its place from what Kubernetes gives (`runtime.jobset`).

`python -m tftrain.launch --kubernetes --workers N --image IMAGE CONFIG [--set ...]`
writes it and applies nothing. The documents, in the order `kubectl apply -f` needs:

- a ConfigMap holding the resolved config (the file with every `--set` applied, its run
  directory on the volume), mounted at /etc/tftrain;
- a PersistentVolumeClaim for the run directory (`--storage CLAIM` names one of yours
  instead): checkpoints outlive pods, so a restarted set resumes;
- the JobSet (`jobset.x-k8s.io/v1alpha2`): one replicated Job of N pods
  (`completionMode: Indexed`), DNS host names for the pods, `nvidia.com/gpu` limits, a
  grace period for the checkpoint a SIGTERM saves, and a failure policy: a lost pod, a
  crash or an out-of-memory kill restarts the whole set (`maxRestarts`), which resumes
  from the last checkpoint; an evicted or preempted pod restarts it without counting; a
  config error (exit 2) fails it, since no restart would mend it.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

from tftrain.config import ConfigError
from tftrain.core import exit_codes
from tftrain.runtime import jobset

API_VERSION = "jobset.x-k8s.io/v1alpha2"
CONTAINER, REPLICATED_JOB = "tftrain", "worker"
CONFIG_DIR, RUNS_DIR = "/etc/tftrain", "/runs"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
APP_LABEL = {"app.kubernetes.io/name": "tftrain"}
# the longest JobSet name whose pods' host names (`<name>-worker-<job>-<pod>`) stay within
# a DNS label's 63 characters for up to 9,999 workers
MAX_NAME = 63 - len(f"-{REPLICATED_JOB}-0-9999")


@dataclass(frozen=True)
class Cluster:
    """What the manifest asks of Kubernetes."""
    name: str
    workers: int
    image: str
    gpus_per_worker: int = 0
    storage: str | None = None          # an existing PersistentVolumeClaim
    storage_size: str = "20Gi"          # the claim made when `storage` is None
    storage_class: str | None = None
    namespace: str | None = None
    queue: str | None = None            # Kueue's LocalQueue
    max_restarts: int = 3
    port: int = jobset.DEFAULT_PORT
    grace_seconds: int = 300            # SIGTERM to SIGKILL: the checkpoint's time
    cpu: str | None = None              # requests and limits per pod
    memory: str | None = None
    smoke: bool = False                 # each pod runs tftrain.run --smoke

    def check(self) -> None:
        if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", self.name) or len(self.name) > MAX_NAME:
            raise ConfigError(f"--name: {self.name!r} is not a Kubernetes name of at most "
                              f"{MAX_NAME} characters (lowercase letters, digits and '-', "
                              "starting with a letter); its pods' host names derive from it")
        if self.workers < 1:
            raise ConfigError("--workers: must be >= 1")
        if self.gpus_per_worker < 0 or self.max_restarts < 0 or self.grace_seconds < 1:
            raise ConfigError("--gpus-per-worker and --max-restarts must be >= 0, --grace >= 1")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port: {self.port} is not a TCP port")
        if not self.image:
            raise ConfigError("--image: the container image with tftrain installed is required, "
                              "e.g. --image registry.example.com/team/tftrain:1.0")

    @property
    def claim(self) -> str:
        return self.storage or f"{self.name}-runs"


def name_from(run_name: str) -> str:
    """A Kubernetes name from a run's name ('Quickstart_v2' -> 'quickstart-v2')."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    name = name if name[:1].isalpha() else f"tftrain-{name}".rstrip("-")
    return name[:MAX_NAME].rstrip("-")


def manifest(cluster: Cluster, config_yaml: str) -> list[dict]:
    """The documents to apply, in order: ConfigMap, PersistentVolumeClaim (unless an
    existing claim is given), JobSet."""
    cluster.check()
    meta = {"namespace": cluster.namespace} if cluster.namespace else {}
    docs = [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": f"{cluster.name}-config", **meta, "labels": dict(APP_LABEL)},
             "data": {"config.yaml": config_yaml}}]
    if cluster.storage is None:
        docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": cluster.claim, **meta, "labels": dict(APP_LABEL)},
                     "spec": {"accessModes": ["ReadWriteMany"],
                              **({"storageClassName": cluster.storage_class}
                                 if cluster.storage_class else {}),
                              "resources": {"requests": {"storage": cluster.storage_size}}}})
    docs.append(_jobset(cluster, meta))
    return docs


def _jobset(c: Cluster, meta: dict) -> dict:
    labels = {**APP_LABEL, **({QUEUE_LABEL: c.queue} if c.queue else {})}
    return {
        "apiVersion": API_VERSION, "kind": "JobSet",
        "metadata": {"name": c.name, **meta, "labels": labels},
        "spec": {
            # every pod a stable name <name>-worker-0-<index>.<name>, resolvable before it
            # is ready (the peers wait for each other before TensorFlow starts)
            "network": {"enableDNSHostnames": True, "subdomain": c.name,
                        "publishNotReadyAddresses": True},
            "failurePolicy": {
                "maxRestarts": c.max_restarts,
                # all pods of the last attempt gone before the next starts: no old worker
                # left holding its port or writing a checkpoint
                "restartStrategy": "BlockingRecreate",
                "rules": [
                    {"name": "configError", "action": "FailJobSet",
                     "onJobFailureReasons": ["PodFailurePolicy"],
                     "onJobFailureMessagePatterns": [
                         f"exit code {exit_codes.CONFIG} matching FailJob rule at index 0"]},
                    {"name": "disruption", "action": "RestartJobSetAndIgnoreMaxRestarts",
                     "onJobFailureReasons": ["PodFailurePolicy"]}]},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                                "template": {"spec": _job(c)}}]}}


def _job(c: Cluster) -> dict:
    return {
        "completionMode": "Indexed", "completions": c.workers, "parallelism": c.workers,
        "backoffLimit": 0,         # a failed pod fails the Job: the set restarts as a whole
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                  "values": [exit_codes.CONFIG]}},
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
        "template": {"metadata": {"labels": dict(APP_LABEL)}, "spec": _pod(c)}}


def _pod(c: Cluster) -> dict:
    limits = {**({"nvidia.com/gpu": c.gpus_per_worker} if c.gpus_per_worker else {}),
              **({"cpu": c.cpu} if c.cpu else {}), **({"memory": c.memory} if c.memory else {})}
    container = {
        "name": CONTAINER, "image": c.image,
        "command": ["python", "-m", "tftrain.run", f"{CONFIG_DIR}/config.yaml",
                    *(["--smoke"] if c.smoke else [])],
        "env": [*jobset.environment(c.name, c.workers, c.port, c.name),
                {"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": "grpc", "containerPort": c.port}],
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "runs", "mountPath": RUNS_DIR}]}
    if limits:
        container["resources"] = {"limits": limits,
                                  **({"requests": {k: v for k, v in limits.items()
                                                   if k != "nvidia.com/gpu"}}
                                     if c.cpu or c.memory else {})}
    return {"restartPolicy": "Never", "terminationGracePeriodSeconds": c.grace_seconds,
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": f"{c.name}-config"}},
                        {"name": "runs", "persistentVolumeClaim": {"claimName": c.claim}}]}


def pod_environment(cluster: Cluster, index: int) -> dict:
    """The variables pod `index` of the set gets (what the downward API and Kubernetes
    put in its environment), for planning it here and for tests."""
    found = {jobset.NAME: cluster.name, jobset.REPLICATED_JOB: REPLICATED_JOB,
             jobset.JOB_INDEX: "0", jobset.COMPLETION_INDEX: str(index)}
    for entry in jobset.environment(cluster.name, cluster.workers, cluster.port, cluster.name):
        if "value" in entry:
            found[entry["name"]] = entry["value"]
    return found


@contextmanager
def as_pod(cluster: Cluster, index: int = 0):
    """This process's environment as pod `index` sees its own (its GPUs, no TF_CONFIG or
    SLURM), restored afterwards: the plan `--dry-run` prints is a pod's."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if k == "TF_CONFIG" or k.startswith("SLURM_")
                or k in jobset.LABELS]:
        del os.environ[key]
    os.environ.update(pod_environment(cluster, index))
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(cluster.gpus_per_worker)))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def to_yaml(docs: list[dict]) -> str:
    import yaml

    class Block(yaml.SafeDumper):
        pass

    def text(dumper, value):          # the config as a block, readable in the manifest
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)
    Block.add_representer(str, text)
    return "---\n".join(yaml.dump(d, Dumper=Block, sort_keys=False) for d in docs)
