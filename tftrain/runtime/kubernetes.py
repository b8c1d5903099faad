"""The Kubernetes manifest of a multi-worker run: a JobSet of N indexed pods, each
`python -m tftrain.run` finding its place from what Kubernetes gives (`runtime.jobset`).

`python -m tftrain.launch --kubernetes --workers N --image IMAGE CONFIG [--set ...]`
writes it and applies nothing. The documents, in the order `kubectl apply -f` needs:

- a ConfigMap holding the resolved config (the file with every `--set` applied, its run
  directory on the volume), mounted at /etc/tftrain;
- a PersistentVolumeClaim for the run directory (`--storage CLAIM` names one of yours
  instead): checkpoints outlive pods, so a restarted set resumes;
- a NetworkPolicy: TensorFlow's gRPC servers run whatever graph reaches them, so the
  workers' port admits the set's own pods only, and the pods reach only each other, the
  cluster's DNS and what `--egress CIDR:PORT` names (an MLflow server, say);
- the JobSet (`jobset.x-k8s.io/v1alpha2`): one replicated Job of N pods
  (`completionMode: Indexed`), DNS host names for the pods, `nvidia.com/gpu` limits, CPU
  and memory requests and limits, a grace period for the checkpoint a SIGTERM saves, and
  a failure policy: a lost pod, a crash or an out-of-memory kill restarts the whole set
  (`maxRestarts`), which resumes from the last checkpoint; an evicted or preempted pod
  restarts it without counting; a config error (exit 2) fails it, since no restart would
  mend it. Its pods run hardened: a numeric non-root user (`--uid`), no privilege
  escalation, every capability dropped, the runtime's seccomp profile, a read-only root
  filesystem (an `emptyDir` at /tmp, the run volume writable), no service-account token.

`checkov` (the tests run it on the pod template as a Job) finds nothing; the checks that
cannot apply carry checkov's skip annotation with their reason (`SKIPS`).
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
# bandit's B108 (a shared temporary directory): this is the pod's own emptyDir, no one else's
POD_TMP = "/tmp"  # nosec B108
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
    cpu: str | None = None              # requests and limits per pod (default: `resources`)
    memory: str | None = None
    smoke: bool = False                 # each pod runs tftrain.run --smoke
    uid: int = 10001                    # the pods' user and group (not root, above 10,000)
    egress: tuple[str, ...] = ()        # CIDR:PORT the pods may reach beyond each other

    def resources(self) -> tuple[str, str]:
        """CPU and memory per pod: as given, else 4 CPUs and 16Gi per GPU (a pod without GPUs:
        2 and 8Gi), what the input pipeline and the host's copy of the batches need."""
        per = max(1, self.gpus_per_worker)
        return (self.cpu or str(2 if not self.gpus_per_worker else 4 * per),
                self.memory or f"{8 if not self.gpus_per_worker else 16 * per}Gi")

    @property
    def by_digest(self) -> bool:
        return "@sha256:" in self.image

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
        if self.uid < 1:
            raise ConfigError(f"--uid: {self.uid}; the pods run as a user other than root (>= 1; "
                              "above 10,000 keeps clear of the host's users)")
        for entry in self.egress:
            cidr, _, port = entry.rpartition(":")
            if not re.fullmatch(r"[0-9a-fA-F.:]+/\d{1,3}", cidr) or not port.isdigit() \
                    or not 0 < int(port) < 65536:
                raise ConfigError(f"--egress: {entry!r}; expected CIDR:PORT, e.g. "
                                  "10.0.12.0/24:5000 for an MLflow server")

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
             "metadata": _metadata(f"{cluster.name}-config", cluster, meta),
             "data": {"config.yaml": config_yaml}}]
    if cluster.storage is None:
        docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": _metadata(cluster.claim, cluster, meta),
                     "spec": {"accessModes": ["ReadWriteMany"],
                              **({"storageClassName": cluster.storage_class}
                                 if cluster.storage_class else {}),
                              "resources": {"requests": {"storage": cluster.storage_size}}}})
    docs.append(network_policy(cluster, meta))
    docs.append(_jobset(cluster, meta))
    return docs


INSTANCE = "app.kubernetes.io/instance"


def _set_pods(c: Cluster) -> dict:
    """The set's pods (their template's labels: the policy's selector holds before the
    JobSet controller adds its own)."""
    return {"matchLabels": {**APP_LABEL, INSTANCE: c.name}}


def network_policy(c: Cluster, meta: dict) -> dict:
    """The set's pods admit the workers' port from each other only, and reach each other,
    the cluster's DNS (the peers' host names) and the `--egress` destinations only."""
    port = [{"protocol": "TCP", "port": c.port}]
    dns = {"to": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "kube-system"}}}],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    extra = [{"to": [{"ipBlock": {"cidr": entry.rpartition(":")[0]}}],
              "ports": [{"protocol": "TCP", "port": int(entry.rpartition(":")[2])}]}
             for entry in c.egress]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _metadata(f"{c.name}-workers", c, meta),
            "spec": {"podSelector": _set_pods(c), "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"from": [{"podSelector": _set_pods(c)}], "ports": port}],
                     "egress": [{"to": [{"podSelector": _set_pods(c)}], "ports": port},
                                dns, *extra]}}


# checkov's checks that cannot apply to this manifest, and why (annotated in it)
NAMESPACE = {"CKV_K8S_21": "the namespace is the one kubectl applies to (-n), or --namespace"}
BY_TAG = {
    "CKV_K8S_14": "the image is --image's reference as given (tftrain warns); give "
                  "IMAGE@sha256:DIGEST to pin it and drop this skip",
    "CKV_K8S_43": "the image is --image's reference as given (tftrain warns); give "
                  "IMAGE@sha256:DIGEST to pin it and drop this skip"}


def annotations(c: Cluster, pods: bool = False) -> dict:
    """checkov's skip annotations of the checks that cannot apply to a document (`pods`:
    the JobSet and its pod template), each with its reason."""
    skips = {**({} if c.namespace else NAMESPACE),
             **({} if c.by_digest or not pods else BY_TAG)}
    return {f"checkov.io/skip{i}": f"{check}={reason}"
            for i, (check, reason) in enumerate(skips.items(), 1)}


def _metadata(name: str, c: Cluster, meta: dict) -> dict:
    return {"name": name, **meta, "labels": {**APP_LABEL, INSTANCE: c.name},
            **({"annotations": annotations(c)} if annotations(c) else {})}


def _jobset(c: Cluster, meta: dict) -> dict:
    labels = {**APP_LABEL, **({QUEUE_LABEL: c.queue} if c.queue else {})}
    return {
        "apiVersion": API_VERSION, "kind": "JobSet",
        "metadata": {"name": c.name, **meta, "labels": labels,
                     "annotations": annotations(c, pods=True)},
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
        "template": {"metadata": {"labels": {**APP_LABEL, INSTANCE: c.name},
                                  "annotations": annotations(c, pods=True)},
                     "spec": _pod(c)}}


def _pod(c: Cluster) -> dict:
    cpu, memory = c.resources()
    compute = {"cpu": cpu, "memory": memory}
    container = {
        "name": CONTAINER, "image": c.image,
        "imagePullPolicy": "IfNotPresent" if c.by_digest else "Always",
        "command": ["python", "-m", "tftrain.run", f"{CONFIG_DIR}/config.yaml",
                    *(["--smoke"] if c.smoke else [])],
        "env": [*jobset.environment(c.name, c.workers, c.port, c.name),
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                # the root filesystem is read-only: caches and temporary files under /tmp
                {"name": "HOME", "value": POD_TMP}, {"name": "TMPDIR", "value": POD_TMP}],
        "ports": [{"name": "grpc", "containerPort": c.port}],
        "resources": {"requests": dict(compute), "limits": {
            **compute, **({"nvidia.com/gpu": c.gpus_per_worker} if c.gpus_per_worker else {})}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": c.uid, "runAsGroup": c.uid,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]},
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "runs", "mountPath": RUNS_DIR},
                         {"name": "tmp", "mountPath": POD_TMP}]}
    return {"restartPolicy": "Never", "terminationGracePeriodSeconds": c.grace_seconds,
            "automountServiceAccountToken": False,
            # the run volume writable by the pods' group
            "securityContext": {"runAsNonRoot": True, "runAsUser": c.uid, "runAsGroup": c.uid,
                                "fsGroup": c.uid, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": f"{c.name}-config"}},
                        {"name": "runs", "persistentVolumeClaim": {"claimName": c.claim}},
                        {"name": "tmp", "emptyDir": {}}]}


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
