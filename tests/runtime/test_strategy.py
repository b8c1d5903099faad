"""Strategy helpers: auto choice, devices, reductions, clusters."""
import json

import pytest
import tensorflow as tf

from helpers import ROOT
from tftrain.config import ConfigError, load_config
from tftrain.runtime.strategy import (build_strategy, cluster_spec, communication_options,
                                      configure_devices, describe, device_table, is_chief,
                                      resolve_devices, resolve_kind, _cross_device_ops)


def dist(*sets):
    return load_config(None, list(sets)).distribute


@pytest.fixture
def no_cluster(monkeypatch):
    for var in ("TF_CONFIG", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)


def test_auto_picks_mirrored_over_two_devices(no_cluster):
    assert resolve_kind(dist(), ["/cpu:0", "/cpu:1"]) == "mirrored"
    assert resolve_kind(dist(), ["/cpu:0"]) == "one_device"


def test_auto_picks_multi_worker_from_tf_config(monkeypatch, no_cluster):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}}))
    assert cluster_spec() == ("TF_CONFIG", 2, 1)
    assert resolve_kind(dist(), ["/cpu:0"]) == "multi_worker"
    assert not is_chief()


def test_auto_picks_multi_worker_from_slurm(monkeypatch, no_cluster):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_ID", "0")              # a task srun started
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_JOB_TASKS_PER_NODE", "2(x2)")
    assert cluster_spec() == ("SLURM", 4, 0)
    assert resolve_kind(dist(), ["/cpu:0"]) == "multi_worker"
    assert is_chief()


def test_devices_are_refused_under_multi_worker(monkeypatch, no_cluster):
    with pytest.raises(ConfigError, match=r"distribute\.devices: a multi-worker task trains on "
                                          r"all the GPUs it sees"):
        resolve_kind(dist("distribute.strategy=multi_worker", "distribute.devices=['/cpu:0']"),
                     ["/cpu:0"])


def test_bad_tf_config_is_a_config_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ConfigError, match="TF_CONFIG: not valid JSON"):
        cluster_spec()


def test_explicit_devices_checked():
    assert resolve_devices(dist("distribute.devices=['/cpu:1']")) == ["/cpu:1"]
    with pytest.raises(ConfigError, match=r"distribute\.devices: /gpu:0 does not exist; visible devices: .*CPU:1"):
        resolve_devices(dist("distribute.devices=['/cpu:0', '/gpu:0']"))
    with pytest.raises(ConfigError, match="lists a device twice"):
        resolve_devices(dist("distribute.devices=['/cpu:0', '/device:CPU:0']"))


def test_virtual_cpus_are_visible():
    assert [d.split("/")[-1] for d in resolve_devices(dist())] == ["device:CPU:0", "device:CPU:1"]


def test_reconfiguring_devices_in_process_is_refused():
    with pytest.raises(RuntimeError, match="only once per process"):
        configure_devices(dist("distribute.virtual_cpus=4"))


@pytest.mark.parametrize("choice,cls", [
    ("auto", tf.distribute.ReductionToOneDevice),          # CPUs: no NCCL
    ("nccl", tf.distribute.NcclAllReduce),
    ("hierarchical_copy", tf.distribute.HierarchicalCopyAllReduce),
    ("reduce_to_one_device", tf.distribute.ReductionToOneDevice),
])
def test_cross_device_ops(choice, cls):
    assert isinstance(_cross_device_ops(dist(f"distribute.cross_device_ops={choice}"), ["/cpu:0", "/cpu:1"]), cls)


def test_auto_cross_device_ops_uses_nccl_on_gpus():
    assert isinstance(_cross_device_ops(dist(), ["/gpu:0", "/gpu:1"]), tf.distribute.NcclAllReduce)


@pytest.mark.parametrize("name", ["ring", "nccl"])
def test_communication_options(name):
    opts = communication_options(dist(f"distribute.communication={name}"))
    assert opts.implementation.name == name.upper()


def test_auto_communication_is_nccl_on_gpus_and_reported_as_what_runs(monkeypatch):
    """TensorFlow's AUTO is a hint its collective runtime resolves to RingReduce, GPUs or
    not: tftrain decides `auto` itself, and reports NCCL only when NCCL runs."""
    from types import SimpleNamespace

    from tftrain.runtime.precision import all_reduce_plan, reduces_with_nccl
    impl = tf.distribute.experimental.CommunicationImplementation
    assert communication_options(dist()).implementation == impl.RING          # CPUs here
    real = tf.config.list_physical_devices
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: ["GPU:0"] if kind == "GPU" else real(kind))
    assert communication_options(dist()).implementation == impl.NCCL

    def strategy(implementation):
        options = tf.distribute.experimental.CommunicationOptions(implementation=implementation)
        ext = SimpleNamespace(_communication_options=options, worker_devices=("/job:worker/gpu:0",))
        return SimpleNamespace(extended=ext, num_replicas_in_sync=4)
    assert not reduces_with_nccl(strategy(impl.AUTO)) and not reduces_with_nccl(strategy(impl.RING))
    assert reduces_with_nccl(strategy(impl.NCCL))
    bf16 = dist("distribute.all_reduce_dtype=bfloat16")
    assert all_reduce_plan(bf16, strategy(impl.RING), "mixed_bfloat16").dtype == "bfloat16"
    assert all_reduce_plan(bf16, strategy(impl.NCCL), "mixed_bfloat16").dtype == "float16"


@pytest.mark.parametrize("kind,replicas", [("one_device", 1), ("mirrored", 2), ("default", 1)])
def test_build_strategy(no_cluster, kind, replicas):
    strategy = build_strategy(dist(f"distribute.strategy={kind}"))
    info = describe(strategy)
    assert (info.kind, info.replicas) == (kind, replicas)
    assert f"strategy: {kind}" in device_table(strategy)


def test_smoke_forces_one_device(no_cluster):
    assert describe(build_strategy(dist("distribute.strategy=mirrored"), force_one_device=True)).kind == "one_device"


def test_chief_task_when_the_cluster_names_one(monkeypatch, no_cluster):
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    assert is_chief() and cluster_spec() == ("TF_CONFIG", 2, 0)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    assert not is_chief() and cluster_spec() == ("TF_CONFIG", 2, 1)


def test_single_machine_strategy_inside_a_cluster_is_refused(monkeypatch, no_cluster):
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ConfigError, match=r"distribute\.strategy: 'mirrored' trains on one machine, but TF_CONFIG describes 2 workers"):
        resolve_kind(dist("distribute.strategy=mirrored"), ["/cpu:0", "/cpu:1"])


def test_any_worker_agreement_in_process():
    from tftrain.runtime.strategy import any_worker
    agree = any_worker(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    assert agree(False) is False and agree(True) is True


@pytest.mark.parametrize("sets,env,expected", [
    ([], {}, "cores // 2"),                                      # mirrored over 2 CPU devices
    (["distribute.strategy=one_device"], {}, "0"),               # one replica: every core an op
    ([], {"TF_NUM_INTRAOP_THREADS": "3"}, "0"),   # the process chose already: left to it
])
def test_replicas_on_cpu_devices_share_the_cores(sets, env, expected):
    """Each replica's ops get cores / replicas intra-op threads (a new process: threads
    are set once, before the runtime starts)."""
    import os
    import subprocess
    import sys
    code = ("import os, tftrain, tensorflow as tf; from tftrain.config import load_config; "
            "from tftrain.runtime import strategy; "
            f"strategy.configure_devices(load_config('configs/quickstart.yaml', {sets!r})); "
            "print(tf.config.threading.get_intra_op_parallelism_threads(), "
            "len(os.sched_getaffinity(0)))")
    environ = {k: v for k, v in os.environ.items() if k != "TF_NUM_INTRAOP_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**environ, **env}, cwd=ROOT, timeout=300)
    threads, cores = map(int, out.stdout.split()[-2:])
    assert threads == (max(1, cores // 2) if expected == "cores // 2" else int(expected)), out.stdout
