"""The cluster this process belongs to: TF_CONFIG (Kubeflow's TFJob, `tftrain.launch`), a
pod of a Kubernetes JobSet (`runtime.jobset`) or SLURM, and the GPUs each task may use,
pinned before TensorFlow lists any device. A TF_CONFIG the user sets wins.

SLURM is read here rather than by TensorFlow's `SlurmClusterResolver`, which sets
`CUDA_VISIBLE_DEVICES` only when the strategy is built (after tftrain listed the GPUs, so
every task of a node would hold every GPU), counts GPUs with `nvidia-smi` (absent on CPU
nodes), gives each task `gpus_per_node // tasks_per_node` GPUs (zero, and a crash, when a
node has more tasks than GPUs), numbers GPUs from 0 even when SLURM granted the job other
ones, and orders addresses by sorted host name rather than by task rank. Here: the
addresses follow SLURM's task layout (block or cyclic distribution), a task's GPUs are its
share of the GPUs SLURM granted on its node (or the ones SLURM already bound to it), and
`pin_gpus()` sets them first thing.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass

from tftrain.config import ConfigError
from tftrain.runtime import jobset
from tftrain.core import internals

GRANTED = "TFTRAIN_GRANTED_GPUS"     # the node's GPUs before this task was pinned to its share
PORT_BASE = "TFTRAIN_PORT_BASE"      # sets the first port of a SLURM step's tasks on a node
# Ports of a SLURM step: each job step gets its own block of PORTS_PER_STEP ports (one per
# task on a node), chosen from its job and step ids, so two jobs sharing a node do not
# collide (a fixed base did: every job's rank-0 task listened on the same port).
FIRST_PORT, STEP_BLOCKS, PORTS_PER_STEP = 20000, 1250, 32


@dataclass(frozen=True)
class Task:
    """This process's place in its cluster."""
    source: str                 # "TF_CONFIG", "JobSet", "SLURM" or "local"
    workers: tuple[str, ...]    # host:port of every worker, by rank
    rank: int
    chief: bool
    gpus: str | None = None     # CUDA_VISIBLE_DEVICES for this task (None: leave as is)

    @property
    def num_workers(self) -> int:
        return max(1, len(self.workers))


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list, in order: 'n[1-2],m5,o[07-08]' ->
    ['n1', 'n2', 'm5', 'o07', 'o08']."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            for n in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(low))}{suffix}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """'2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ConfigError(f"SLURM_TASKS_PER_NODE: cannot read {text!r}; expected e.g. 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm(env, name: str) -> str | None:
    """A step's value, else the job's (SLURM_STEP_X, SLURM_JOB_X, SLURM_X)."""
    return env.get(f"SLURM_STEP_{name}") or env.get(f"SLURM_JOB_{name}") or env.get(f"SLURM_{name}")


def slurm_port_base(env) -> int:
    """The first port of this SLURM step's tasks on each node (`TFTRAIN_PORT_BASE` to
    choose it): the same on every task of the step, different for other jobs and steps."""
    if env.get(PORT_BASE, "").isdigit():
        return int(env[PORT_BASE])
    key = int(env.get("SLURM_JOB_ID", "0") or 0) * 7 + int(env.get("SLURM_STEP_ID", "0") or 0)
    return FIRST_PORT + (key % STEP_BLOCKS) * PORTS_PER_STEP


def in_slurm_step(env) -> bool:
    """Whether this process is a task of a SLURM job step (started by srun): a batch
    script or an salloc shell is inside the allocation but is one process, whatever
    SLURM_NTASKS says."""
    return "SLURM_JOB_ID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def slurm_without_srun(env=None) -> str:
    """A warning for a process inside a SLURM allocation of several tasks that srun did
    not start ("": none)."""
    env = os.environ if env is None else env
    tasks = int(env.get("SLURM_NTASKS", "1") or 1)
    if "SLURM_JOB_ID" in env and tasks > 1 and not in_slurm_step(env) and not env.get("TF_CONFIG"):
        return (f"warning: inside a SLURM allocation of {tasks} tasks but not started by srun "
                "(no job step): training as one process; start each task with srun to train "
                f"on all {tasks}")
    return ""


def slurm_task(env=None, port_base: int | None = None) -> Task:
    """This SLURM task: worker addresses in rank order and the GPUs it may use."""
    env = os.environ if env is None else env
    port_base = slurm_port_base(env) if port_base is None else port_base
    nodes = expand_hostlist(_slurm(env, "NODELIST") or "")
    if not nodes:
        raise ConfigError("SLURM: SLURM_JOB_NODELIST is not set; start each task with srun "
                          "inside the allocation")
    per_node = expand_tasks_per_node(_slurm(env, "TASKS_PER_NODE") or "1")
    if len(per_node) != len(nodes):
        raise ConfigError(f"SLURM: {len(nodes)} nodes but tasks per node {per_node}; run "
                          "tftrain.run under srun inside the allocation")
    layout = env.get("SLURM_DISTRIBUTION", "block").split(",")[0].split(":")[0]
    if layout not in ("block", "cyclic"):
        raise ConfigError(f"SLURM_DISTRIBUTION: {layout!r} is not supported; use srun "
                          "--distribution=block (the default) or cyclic")
    slots = [(n, k) for n, count in enumerate(per_node) for k in range(count)]
    if layout == "cyclic":
        slots = sorted(slots, key=lambda s: (s[1], s[0]))
    workers = tuple(f"{nodes[n]}:{port_base + k}" for n, k in slots)
    rank = int(env.get("SLURM_PROCID", "0"))
    node, local = slots[rank]
    return Task("SLURM", workers, rank, rank == 0, _task_gpus(env, per_node[node], local))


def _task_gpus(env, tasks_on_node: int, local: int) -> str | None:
    """This task's share of the GPUs SLURM granted on its node."""
    visible = env.get(GRANTED, env.get("CUDA_VISIBLE_DEVICES"))   # before pin_gpus narrowed it
    granted = (visible or env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or "")
    ids = [g for g in granted.split(",") if g.strip()]
    if not ids and env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        ids = [str(i) for i in range(int(env["SLURM_GPUS_ON_NODE"]))]
    if not ids:
        return None if visible is None else visible      # a CPU node: nothing to pin
    per_task = env.get("SLURM_GPUS_PER_TASK", "").split(":")[-1]
    if per_task.isdigit() and len(ids) == int(per_task):
        return ",".join(ids)                              # SLURM bound them to this task
    if len(ids) < tasks_on_node:
        raise ConfigError(f"SLURM: {tasks_on_node} tasks on this node share {len(ids)} GPUs; "
                          "start one task per GPU (srun --ntasks-per-node=<GPUs per node>) "
                          "or request --gpus-per-task")
    share = len(ids) // tasks_on_node
    return ",".join(ids[local * share:(local + 1) * share])


def tf_config_task(text: str) -> Task:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"TF_CONFIG: not valid JSON ({err}); expected "
                          '{"cluster": {"worker": [...]}, "task": {...}}') from None
    cluster, task = spec.get("cluster", {}), spec.get("task", {})
    chiefs, workers = list(cluster.get("chief", [])), list(cluster.get("worker", []))
    kind, index = task.get("type", "worker"), int(task.get("index", 0))
    rank = index + (len(chiefs) if kind == "worker" else 0)
    chief = kind == "chief" or (not chiefs and kind == "worker" and index == 0)
    return Task("TF_CONFIG", tuple(chiefs + workers), rank, chief)


def jobset_task(env) -> Task:
    """This pod of a JobSet's Indexed Job (`runtime.jobset`)."""
    rank = jobset.rank(env)
    return Task("JobSet", tuple(jobset.addresses(env)), rank, rank == 0)


def current_task(env=None) -> Task:
    """(source, workers, rank, chief, GPUs) from TF_CONFIG, else a JobSet pod's
    environment, else SLURM, else local."""
    env = os.environ if env is None else env
    if env.get("TF_CONFIG"):
        return tf_config_task(env["TF_CONFIG"])
    if jobset.in_jobset(env):
        return jobset_task(env)
    if in_slurm_step(env) and int(_slurm(env, "NUM_TASKS") or env.get("SLURM_NTASKS", "1")) > 1:
        return slurm_task(env)
    return Task("local", (), 0, True)


def pin_gpus(task: Task) -> None:
    """Restrict this process to its task's GPUs; must run before TensorFlow lists devices
    (`strategy.configure_devices` calls it first)."""
    if task.gpus is None or os.environ.get("CUDA_VISIBLE_DEVICES") == task.gpus:
        return
    if "tensorflow" in sys.modules and internals.runtime_started(devices_listed=False):
        raise RuntimeError(f"this {task.source} task must use GPUs {task.gpus}, but TensorFlow "
                           "already listed the devices; let tftrain configure devices first "
                           "(tftrain.configure_devices) or set CUDA_VISIBLE_DEVICES")
    os.environ.setdefault(GRANTED, os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    os.environ["CUDA_VISIBLE_DEVICES"] = task.gpus


def describe_source(env=None) -> str:
    """Where this process's place in its cluster came from, for the plan ("" alone)."""
    env = os.environ if env is None else env
    task = current_task(env)
    if task.source == "local":
        return ""
    if task.source == "JobSet":
        where = jobset.describe(env)
    elif task.source == "SLURM":
        where = f"SLURM job {env.get('SLURM_JOB_ID')}, step {env.get('SLURM_STEP_ID', env.get('SLURM_STEPID'))}"
    else:
        where = "TF_CONFIG" + (" (set by the user: it wins over the JobSet pod's variables)"
                               if jobset.in_jobset(env) else "")
    return (f"cluster: {task.num_workers} workers from {where}; this process is worker "
            f"{task.rank}" + (" (chief)" if task.chief else ""))


def await_peers(seconds: float, env=None) -> str:
    """A JobSet pod waits for its peers to answer before TensorFlow starts (exit 2 naming
    one that does not within `seconds`); the line saying so ("" elsewhere)."""
    env = os.environ if env is None else env
    task = current_task(env)
    if task.source != "JobSet" or task.num_workers < 2:
        return ""
    waited, listener = jobset.wait_for_peers(task.workers, task.rank, seconds, jobset.hosts(env))
    jobset.hold(listener)            # answering still, until the strategy takes the port
    return f"cluster: {task.num_workers - 1} peers of worker {task.rank} answered in {waited:.1f} s"


def cluster_resolver(task: Task):
    """A resolver for MultiWorkerMirroredStrategy describing `task`'s cluster."""
    import tensorflow as tf

    if task.source in ("TF_CONFIG", "local"):      # a cluster of TF_CONFIG, or of one worker
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if task.source == "JobSet":
        jobset.release()             # the port the peer check answered on, for the server
    # SLURM: the task's share of the node's GPUs (none granted: none); a JobSet pod: the
    # GPUs Kubernetes gave its container (nvidia.com/gpu), all it sees
    gpus = len(task.gpus.split(",")) if task.gpus else \
        len(tf.config.list_physical_devices("GPU")) if task.source == "JobSet" else 0
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": list(task.workers)}), task_type="worker",
        task_id=task.rank, num_accelerators={"GPU": gpus}, rpc_layer="grpc")


def cluster_spec() -> tuple[str, int, int]:
    """(source, number of workers, this worker's index) from TF_CONFIG or SLURM."""
    task = current_task()
    return task.source, task.num_workers, task.rank


def resolve_kind(d, devices: list[str]) -> str:
    """`auto`: multi_worker when the cluster has >1 worker, mirrored over >1 device, else one."""
    source, workers, _ = cluster_spec()
    if workers > 1 and d.strategy not in ("auto", "multi_worker"):
        raise ConfigError(
            f"distribute.strategy: '{d.strategy}' trains on one machine, but {source} describes "
            f"{workers} workers; use multi_worker or auto (e.g. --set distribute.strategy=auto)")
    if (workers > 1 or d.strategy == "multi_worker") and d.devices is not None:
        raise ConfigError(
            "distribute.devices: a multi-worker task trains on all the GPUs it sees (or its CPU); "
            "choose them per task with CUDA_VISIBLE_DEVICES or SLURM (--gpus-per-task), and "
            "remove distribute.devices")
    if d.strategy != "auto":
        return d.strategy
    if workers > 1:
        return "multi_worker"
    return "mirrored" if len(devices) > 1 else "one_device"
