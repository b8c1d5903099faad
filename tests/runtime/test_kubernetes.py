"""The Kubernetes manifest `python -m tftrain.launch --kubernetes` writes, validated
against JobSet's published CRD schema and Kubernetes' own schemas.

The JobSet schema is the CRD of JobSet v0.12.0 (the release of 2026-05-08, commit
f22e565ac3cc3265c7c45ef67ecffdc689af5d77), file
config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml of
https://github.com/kubernetes-sigs/jobset, kept gzipped beside this file
(`schemas/jobset.x-k8s.io_jobsets-v0.12.0.yaml.gz`). Its `openAPIV3Schema` is checked
with jsonschema, and every field must be one the schema declares (the API server drops
unknown fields of a custom resource silently; `kubectl apply --validate=strict` refuses
them, as here). The CEL rules of the CRD (`x-kubernetes-validations`) are not evaluated.
The pod template, the Job it is part of, the ConfigMap and the claim are checked with
`kubernetes-validate`'s strict schemas of Kubernetes 1.34.
"""
import copy
import functools
import gzip
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from helpers import QUICKSTART
from tftrain.config import load_config
from tftrain.launch import main as launch
from tftrain.runtime import kubernetes as k8s
from tftrain.runtime.cluster import current_task

CRD = Path(__file__).parent / "schemas" / "jobset.x-k8s.io_jobsets-v0.12.0.yaml.gz"
KUBERNETES = "1.34"
AUTO = "distribute.strategy=auto"


@functools.cache
def jobset_schema() -> dict:
    crd = yaml.safe_load(gzip.decompress(CRD.read_bytes()))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")
    return version["schema"]["openAPIV3Schema"]


def undeclared(doc, schema, where="") -> list[str]:
    """Fields of `doc` its structural schema does not declare (what the API server prunes)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(doc, dict) and "properties" in schema:
        for key, value in doc.items():
            if key not in schema["properties"]:
                found.append(f"{where}.{key}")
            else:
                found += undeclared(value, schema["properties"][key], f"{where}.{key}")
    elif isinstance(doc, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in doc.items():
            found += undeclared(value, schema["additionalProperties"], f"{where}.{key}")
    elif isinstance(doc, list) and "items" in schema:
        for i, value in enumerate(doc):
            found += undeclared(value, schema["items"], f"{where}[{i}]")
    return found


def validate_jobset(doc: dict) -> None:
    schema = jobset_schema()
    jsonschema.Draft7Validator(schema).validate(doc)
    assert not undeclared(doc, schema), undeclared(doc, schema)


def validate_core(jobset: dict) -> None:
    """The replicated Job as a batch/v1 Job, its pod template as a v1 Pod."""
    job_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job",
                                  "metadata": {"name": "worker"}, "spec": job_spec},
                                 KUBERNETES, strict=True)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod",
                                  "metadata": {"name": "worker-0", **job_spec["template"]["metadata"]},
                                  "spec": job_spec["template"]["spec"]}, KUBERNETES, strict=True)


def generate(tmp_path, *args, sets=(AUTO,)) -> tuple[int, list[dict]]:
    out = tmp_path / "jobset.yaml"
    code = launch(["--kubernetes", *args, str(QUICKSTART), "-o", str(out),
                   *[a for s in sets for a in ("--set", s)]])
    return code, (list(yaml.safe_load_all(out.read_text())) if out.exists() else [])


def test_the_manifest_for_4_workers_x_2_gpus_validates_against_jobset_and_kubernetes(tmp_path):
    code, docs = generate(tmp_path, "--workers", "4", "--gpus-per-worker", "2",
                          "--image", "registry.example.com/team/tftrain:1.0")
    assert code == 0
    config, claim, policy, jobset = docs
    for doc in (config, claim, policy):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    validate_jobset(jobset)
    validate_core(jobset)
    assert [d["kind"] for d in docs] == ["ConfigMap", "PersistentVolumeClaim", "NetworkPolicy",
                                         "JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    spec = jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": "quickstart",
                               "publishNotReadyAddresses": True}
    assert spec["failurePolicy"]["maxRestarts"] == 3
    assert spec["failurePolicy"]["restartStrategy"] == "BlockingRecreate"
    job = spec["replicatedJobs"][0]["template"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"], job["backoffLimit"]) \
        == ("Indexed", 4, 4, 0)
    pod = job["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {
        "cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 2}}        # 4 CPUs and 16Gi a GPU
    assert container["command"] == ["python", "-m", "tftrain.run", "/etc/tftrain/config.yaml"]
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 300
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert volumes["config"]["configMap"]["name"] == config["metadata"]["name"]
    # the ConfigMap's config is the run's: the file with the --set applied, on the volume
    path = tmp_path / "config.yaml"
    path.write_text(config["data"]["config.yaml"])
    assert load_config(path) == load_config(QUICKSTART, [AUTO, "run.dir=/runs"])


def test_each_pod_of_the_manifest_finds_its_own_place():
    cluster = k8s.Cluster(name="train", workers=3, image="tftrain:1")
    for index in range(3):
        task = current_task(k8s.pod_environment(cluster, index))
        assert task.rank == index and task.chief == (index == 0)
        assert task.workers == tuple(f"train-worker-0-{i}.train:2222" for i in range(3))


@pytest.mark.parametrize("where,change", [
    ("spec.replicatedJobs", lambda d: d["spec"].update(replicatedjobs=d["spec"].pop("replicatedJobs"))),
    ("restartStrategy", lambda d: d["spec"]["failurePolicy"].update(restartStrategy="Immediately")),
    ("action", lambda d: d["spec"]["failurePolicy"]["rules"][0].update(action="Retry")),
    ("completions", lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"].update(completions="4")),
])
def test_the_jobset_schema_refuses_a_broken_manifest(tmp_path, where, change):
    _, docs = generate(tmp_path, "--workers", "2", "--image", "tftrain:1")
    broken = copy.deepcopy(docs[-1])
    change(broken)
    with pytest.raises((jsonschema.ValidationError, AssertionError)):
        validate_jobset(broken)
    validate_jobset(docs[-1])


def test_the_core_schemas_refuse_a_broken_pod_template(tmp_path):
    _, docs = generate(tmp_path, "--workers", "2", "--image", "tftrain:1")
    broken = copy.deepcopy(docs[-1])
    pod = broken["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["imagePullPolicy"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(broken)


def test_kueue_an_existing_claim_and_cpu_and_memory(tmp_path):
    code, docs = generate(tmp_path, "--workers", "2", "--image", "tftrain:1", "--queue", "team-a",
                          "--storage", "shared-runs", "--name", "digits-cnn", "--namespace", "ml",
                          "--cpu", "8", "--memory", "32Gi", "--max-restarts", "5", "--smoke")
    assert code == 0 and [d["kind"] for d in docs] == ["ConfigMap", "NetworkPolicy", "JobSet"]
    jobset = docs[-1]
    validate_jobset(jobset)
    validate_core(jobset)
    assert {k: v for k, v in jobset["metadata"].items() if k != "annotations"} == {
        "name": "digits-cnn", "namespace": "ml", "labels": {
            "app.kubernetes.io/name": "tftrain", "kueue.x-k8s.io/queue-name": "team-a"}}
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["volumes"][1]["persistentVolumeClaim"]["claimName"] == "shared-runs"
    assert pod["containers"][0]["resources"] == {"limits": {"cpu": "8", "memory": "32Gi"},
                                                 "requests": {"cpu": "8", "memory": "32Gi"}}
    assert pod["containers"][0]["command"][-1] == "--smoke"
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 5


@pytest.mark.parametrize("args,sets,message", [
    (["--workers", "2", "--image", "t:1"], [],
     "tftrain.launch: config error: distribute.strategy: 'mirrored' trains on one machine, but "
     "JobSet describes 2 workers; use multi_worker or auto"),
    (["--workers", "2", "--image", "t:1", "--name", "Digits_CNN"], [AUTO],
     "tftrain.launch: config error: --name: 'Digits_CNN' is not a Kubernetes name"),
    (["--workers", "2"], [AUTO], "tftrain.launch: config error: --image: the container image"),
    (["--workers", "2", "--image", "t:1", "--run-dir", "/tmp"], [AUTO],
     "tftrain.launch: config error: --run-dir: not with --kubernetes"),
    (["--workers", "3", "--image", "t:1"], [AUTO, "train.global_batch_size=64"],
     "tftrain.launch: config error: train.global_batch_size: 64 is not divisible"),
])
def test_a_manifest_that_cannot_run_is_refused_with_one_line(tmp_path, capsys, args, sets, message):
    code, docs = generate(tmp_path, *args, sets=sets)
    err = capsys.readouterr().err
    assert code == 2 and not docs and err.startswith(message), err
    assert len(err.strip().splitlines()) == 1


def test_the_dry_run_prints_the_first_pods_plan_then_the_manifest(capsys):
    code = launch(["--kubernetes", "--workers", "4", "--gpus-per-worker", "2", "--image", "t:1",
                   str(QUICKSTART), "--set", AUTO, "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    plan, manifest = out.split("apiVersion: v1", 1)
    assert "# strategy: multi_worker   replicas: 8   workers: 4 (from JobSet)   devices: 2 GPUs " \
           "per worker" in plan
    assert "# batch: 32 per replica x 8 replicas x 1 accumulation steps = global batch 256" in plan
    assert "# run directory: /runs/quickstart" in plan
    assert [d["kind"] for d in yaml.safe_load_all("apiVersion: v1" + manifest)] == \
        ["ConfigMap", "PersistentVolumeClaim", "NetworkPolicy", "JobSet"]


def test_names_from_run_names():
    assert k8s.name_from("Quickstart_v2") == "quickstart-v2"
    assert k8s.name_from("2026 sweep") == "tftrain-2026-sweep"
    assert len(k8s.name_from("x" * 80)) == k8s.MAX_NAME


# --- security ---------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def checkov() -> str:
    """checkov's command: $TFTRAIN_CHECKOV, the tools venv scripts/setup_tests.sh makes, or
    one on PATH (checkov pins packaging below what pytest needs: it lives in a venv of its
    own)."""
    import os
    import shutil
    found = (os.environ.get("TFTRAIN_CHECKOV") or
             next((str(p) for p in [ROOT / ".venv-tools" / "bin" / "checkov"] if p.exists()), None)
             or shutil.which("checkov"))
    assert found, "checkov is not installed: bash scripts/setup_tests.sh installs it"
    return found


def as_checked(docs: list[dict]) -> list[dict]:
    """The documents as checkov reads them: the JobSet (a kind it does not read) as the
    batch/v1 Job of its pod template, with the JobSet's annotations."""
    out = []
    for doc in docs:
        if doc["kind"] == "JobSet":
            doc = {"apiVersion": "batch/v1", "kind": "Job",
                   "metadata": {k: v for k, v in doc["metadata"].items() if k != "labels"},
                   "spec": doc["spec"]["replicatedJobs"][0]["template"]["spec"]}
        out.append(doc)
    return out


def checkov_findings(docs: list[dict], tmp_path) -> tuple[list[str], dict[str, str]]:
    """(failed check ids, {skipped check id: the reason annotated})."""
    import json
    import subprocess
    folder = tmp_path / "checked"
    folder.mkdir(exist_ok=True)
    (folder / "manifest.yaml").write_text(yaml.safe_dump_all(as_checked(docs)))
    out = subprocess.run([checkov(), "-d", str(folder), "--framework", "kubernetes", "-o", "json",
                          "--skip-download"], capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout)
    results = report["results"] if isinstance(report, dict) else report[0]["results"]
    failed = sorted({c["check_id"] for c in results.get("failed_checks", [])})
    skipped = {c["check_id"]: c["check_result"].get("suppress_comment", "")
               for c in results.get("skipped_checks", [])}
    return failed, skipped


@pytest.mark.slow
def test_checkov_finds_nothing_in_the_4_x_2_gpu_manifest_and_each_skip_says_why(tmp_path, capsys):
    code, docs = generate(tmp_path, "--workers", "4", "--gpus-per-worker", "2", "--image", "IMG")
    assert code == 0
    assert "warning: --image IMG is a tag" in capsys.readouterr().err
    failed, skipped = checkov_findings(docs, tmp_path)
    assert failed == []
    assert set(skipped) == {"CKV_K8S_14", "CKV_K8S_21", "CKV_K8S_43"}
    reasons = {**k8s.NAMESPACE, **k8s.BY_TAG}
    assert all(skipped[check] == reasons[check] for check in skipped), skipped
    # what it checks can fail: without the NetworkPolicy and with a root pod
    bare = [d for d in docs if d["kind"] != "NetworkPolicy"]
    pod = bare[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod.pop("securityContext")
    pod["containers"][0].pop("securityContext")
    failed, _ = checkov_findings(bare, tmp_path)
    assert {"CKV2_K8S_6", "CKV_K8S_20", "CKV_K8S_23", "CKV_K8S_40"} <= set(failed), failed


def test_a_pinned_image_in_a_namespace_needs_no_image_or_namespace_skip(tmp_path, capsys):
    image = "registry.example.com/tftrain@sha256:" + "a" * 64
    code, docs = generate(tmp_path, "--workers", "2", "--image", image, "--namespace", "ml")
    assert code == 0 and "warning" not in capsys.readouterr().err
    failed, skipped = checkov_findings(docs, tmp_path)
    assert failed == [] and skipped == {}


def test_the_worker_port_admits_the_sets_own_pods_only(tmp_path):
    code, docs = generate(tmp_path, "--workers", "4", "--image", "t:1", "--port", "2345",
                          "--egress", "10.0.12.0/24:5000")
    policy, jobset = docs[-2], docs[-1]
    kubernetes_validate.validate(policy, KUBERNETES, strict=True)
    pods = {"matchLabels": {"app.kubernetes.io/name": "tftrain",
                            "app.kubernetes.io/instance": "quickstart"}}
    template = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pods["matchLabels"].items() <= template["metadata"]["labels"].items()
    spec = policy["spec"]
    assert spec["podSelector"] == pods and spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"from": [{"podSelector": pods}],
                                "ports": [{"protocol": "TCP", "port": 2345}]}]
    assert spec["egress"] == [
        {"to": [{"podSelector": pods}], "ports": [{"protocol": "TCP", "port": 2345}]},
        {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                        "kube-system"}}}],
         "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        {"to": [{"ipBlock": {"cidr": "10.0.12.0/24"}}], "ports": [{"protocol": "TCP", "port": 5000}]}]


def test_pods_run_as_a_numeric_non_root_user_on_a_read_only_root(tmp_path):
    code, docs = generate(tmp_path, "--workers", "2", "--image", "t:1", "--uid", "20000")
    pod = docs[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 20000, "runAsGroup": 20000,
                                      "fsGroup": 20000, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 20000, "runAsGroup": 20000,
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/tmp"]["name"] == "tmp" and not mounts["/runs"].get("readOnly")
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert {"name": "HOME", "value": "/tmp"} in container["env"]


@pytest.mark.parametrize("args,message", [
    (["--uid", "0"], "--uid: 0; the pods run as a user other than root"),
    (["--egress", "mlflow:5000"], "--egress: 'mlflow:5000'; expected CIDR:PORT")])
def test_a_root_uid_or_a_bad_egress_is_refused(tmp_path, capsys, args, message):
    code, docs = generate(tmp_path, "--workers", "2", "--image", "t:1", *args)
    assert code == 2 and not docs and message in capsys.readouterr().err
