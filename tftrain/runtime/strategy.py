"""Distribution strategies from config: devices, virtual CPUs, clusters, reductions.

Importable on its own: `build_strategy(cfg)` takes a `Config` or its `distribute`
section. Logical device configuration (virtual CPUs, GPU memory limits) can be applied
only once per process and before any op runs, so `configure_devices` is the first thing
a run does; asking for a different layout later is an error that says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from tftrain.runtime.cluster import (cluster_resolver, cluster_spec, current_task,  # noqa: F401
                                     pin_gpus, resolve_kind)  # (cluster_spec, resolve_kind: re-exported)
from tftrain.config import Config, ConfigError, DistributeConfig
from tftrain.core import internals
from tftrain.core.native_log import quiet

_configured: tuple | None = None


def _section(cfg) -> DistributeConfig:
    return cfg.distribute if isinstance(cfg, Config) else cfg


def configure_devices(cfg) -> None:
    """Pin a cluster task to its GPUs, split the CPU into logical devices and set GPU memory
    options (once per process, before TensorFlow lists devices)."""
    global _configured
    d = _section(cfg)
    pin_gpus(current_task())
    wanted = (d.virtual_cpus, d.gpu_memory_growth, d.gpu_memory_limit)
    if _configured is not None:
        if _configured != wanted and d.virtual_cpus is not None:
            raise RuntimeError(
                f"devices were already configured in this process as {_configured}; logical "
                "devices can be set only once per process. Start a new process (e.g. run the "
                "CLI) to use distribute.virtual_cpus="
                f"{d.virtual_cpus}.")
        return
    with quiet():                        # (no GPU: "failed call to cuInit", held back)
        gpus = tf.config.list_physical_devices("GPU")
    try:
        for gpu in gpus:
            if d.gpu_memory_limit:
                mb = max(1, d.gpu_memory_limit // 2**20)
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=mb)])
            elif d.gpu_memory_growth:
                tf.config.experimental.set_memory_growth(gpu, True)
        if d.virtual_cpus and d.virtual_cpus > 1:
            cpu = tf.config.list_physical_devices("CPU")[0]
            current = tf.config.get_logical_device_configuration(cpu)
            if current is None or len(current) != d.virtual_cpus:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * d.virtual_cpus)
            if not gpus and d.strategy not in ("one_device", "default"):
                share_cores(len(d.devices) if d.devices else d.virtual_cpus)
    except RuntimeError as err:
        raise RuntimeError(
            f"could not configure devices ({err}); TensorFlow was already initialized in this "
            "process. Call tftrain.configure_devices(cfg) before any TensorFlow op, "
            "or run through the CLI.") from None
    _configured = wanted


def share_cores(replicas: int) -> int | None:
    """Replicas training side by side on CPU devices share the cores: each op gets
    cores / replicas threads (its intra-op pool; TensorFlow gives every op all the cores,
    so the replicas' ops oversubscribe them: a mirrored ResNet-20 on 2 logical CPUs of 2
    cores ran 1.16x as fast at one thread an op). Not when the process chose already
    (TF_NUM_INTRAOP_THREADS, or tf.config.threading); returns the threads set, or None."""
    import os

    if os.environ.get("TF_NUM_INTRAOP_THREADS") or \
            tf.config.threading.get_intra_op_parallelism_threads():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(1, replicas))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    return threads


def is_chief() -> bool:
    """True on the worker that writes reports, logs and exports."""
    return current_task().chief


def visible_devices() -> list[str]:
    """Logical devices that replicas can run on: GPUs when present, else CPUs."""
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return [dev.name for dev in devices]


def _canonical(name: str) -> str:
    return tf.DeviceSpec.from_string(name).to_string()


def missing_devices(names) -> list[str]:
    """The named devices TensorFlow does not have (logical devices included)."""
    known = {_canonical(dev.name) for dev in tf.config.list_logical_devices()}
    return [name for name in names if _canonical(name) not in known]


def resolve_devices(d: DistributeConfig) -> list[str]:
    """The devices replicas run on; an explicit list is checked against what exists."""
    visible = visible_devices()
    if d.devices is None:
        return visible
    missing = missing_devices(d.devices)
    if missing:
        raise ConfigError(
            f"distribute.devices: {', '.join(missing)} does not exist; visible devices: "
            f"{', '.join(sorted(n.name for n in tf.config.list_logical_devices()))} "
            "(set distribute.virtual_cpus to split the CPU into more devices)")
    if len(set(map(_canonical, d.devices))) != len(d.devices):
        raise ConfigError(f"distribute.devices: {d.devices} lists a device twice")
    return list(d.devices)


def local_replicas(d: DistributeConfig, devices: list[str]) -> int:
    """Replicas on this machine's `devices`: one per device when mirrored, else one."""
    return len(devices) if resolve_kind(d, devices) == "mirrored" else 1


def _cross_device_ops(d: DistributeConfig, devices: list[str]):
    choice = d.cross_device_ops
    if choice == "auto":
        # NCCL needs GPUs; on CPUs TensorFlow's default is reduction to one device.
        on_gpu = all("GPU" in dev.upper() for dev in devices)
        choice = "nccl" if on_gpu and len(devices) > 1 else "reduce_to_one_device"
    if choice == "nccl":
        return tf.distribute.NcclAllReduce()
    if choice == "hierarchical_copy":
        return tf.distribute.HierarchicalCopyAllReduce()
    return tf.distribute.ReductionToOneDevice()


def communication_options(d: DistributeConfig):
    """Multi-worker collectives: the implementation and the pack size of the gradient
    all-reduce (`distribute.pack_bytes`). `auto` is decided here, NCCL when this task sees
    GPUs, else RING: TensorFlow's own AUTO is only a hint that its collective runtime
    resolves to RingReduce over gRPC, GPUs or not."""
    impls = tf.distribute.experimental.CommunicationImplementation
    choice = d.communication
    if choice == "auto":          # (devices are configured first: the task's GPUs only)
        choice = "nccl" if tf.config.list_physical_devices("GPU") else "ring"
    impl = {"ring": impls.RING, "nccl": impls.NCCL}[choice]
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=d.pack_bytes or 0, implementation=impl)


@dataclass(frozen=True)
class StrategyInfo:
    kind: str
    devices: tuple[str, ...]
    replicas: int
    workers: int


def build_strategy(cfg, *, force_one_device: bool = False) -> tf.distribute.Strategy:
    """The strategy the config asks for. `force_one_device` is used by `--smoke`."""
    d = _section(cfg)
    configure_devices(d)
    if not force_one_device and resolve_kind(d, devices=[]) == "multi_worker":
        # Decided from the environment alone and created before anything initializes
        # TensorFlow's runtime: collectives can only be configured at start-up.
        return multi_worker_strategy(d, cluster_resolver(current_task()))
    devices = resolve_devices(d)
    kind = "one_device" if force_one_device else resolve_kind(d, devices)
    if kind == "default":
        return tf.distribute.get_strategy()
    if kind == "one_device":
        return tf.distribute.OneDeviceStrategy(devices[0])
    return tf.distribute.MirroredStrategy(
        devices=devices, cross_device_ops=_cross_device_ops(d, devices))


def multi_worker_strategy(d: DistributeConfig, resolver) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy over the task's GPUs, or its CPU: one replica, or with
    `distribute.virtual_cpus` one per virtual CPU (TensorFlow gives a CPU task one
    replica; this gives a CPU cluster a GPU cluster's arithmetic of several replicas per
    worker, which an elastic resume from 2 x 2 replicas to 1 x 2 needs)."""
    options = communication_options(d)
    if d.virtual_cpus and d.virtual_cpus > 1 and not tf.config.list_physical_devices("GPU"):
        return _VirtualCPUMultiWorker(resolver, options, d.virtual_cpus)
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver,
                                                     communication_options=options)


class _VirtualCPUMultiWorker(tf.distribute.MultiWorkerMirroredStrategy):
    """A multi-worker strategy whose tasks replicate over their virtual CPUs."""

    def __init__(self, resolver, options, cpus: int):
        class Extended(internals.collective_extended()):
            def _initialize_local_devices(self, cluster_resolver, worker_device):
                devices, kind = super()._initialize_local_devices(cluster_resolver, worker_device)
                if kind != "CPU":
                    return devices, kind
                return tuple(f"{worker_device}/device:CPU:{i}" for i in range(cpus)), "CPU"

        tf.distribute.Strategy.__init__(
            self, Extended(self, cluster_resolver=resolver, communication_options=options))


def describe(strategy: tf.distribute.Strategy) -> StrategyInfo:
    """Kind, devices, replicas and workers of a strategy (for plans and summaries)."""
    kinds = [(tf.distribute.MultiWorkerMirroredStrategy, "multi_worker"),
             (tf.distribute.MirroredStrategy, "mirrored"),
             (tf.distribute.OneDeviceStrategy, "one_device")]
    kind = next((name for cls, name in kinds if isinstance(strategy, cls)), "default")
    try:
        devices = tuple(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: TensorFlow's own placement
        devices = ("default placement",)
    workers = cluster_spec()[1] if kind == "multi_worker" else 1
    return StrategyInfo(kind, devices, strategy.num_replicas_in_sync, workers)


def local_devices(strategy: tf.distribute.Strategy) -> list[str]:
    """The devices this process trains on (the default strategy: TensorFlow's first)."""
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:
        return visible_devices()[:1]


def device_table(strategy: tf.distribute.Strategy) -> str:
    """One line: the strategy, its replicas and workers, and the devices they run on."""
    info = describe(strategy)
    short = [d.split("/")[-1].replace("device:", "") if d.startswith("/job:") else d
             for d in info.devices]
    return (f"strategy: {info.kind}   replicas: {info.replicas}   workers: {info.workers}   "
            f"devices: {', '.join(short)}")


class CountingReduction(tf.distribute.ReductionToOneDevice):
    """ReductionToOneDevice that counts, as it runs, the reductions it executes and the
    bytes each replica sends. A diagnostic for tests and benchmarks: pass it as
    `MirroredStrategy(devices, cross_device_ops=CountingReduction())`."""

    def __init__(self):
        super().__init__()
        with tf.init_scope():
            self.calls = tf.Variable(0, dtype=tf.int64, trainable=False, name="reductions")
            self.bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="reduced_bytes")

    def _count(self, values):
        per_replica = sum(v.dtype.size * v.shape.num_elements()
                          for v in (tf.nest.flatten(value.values)[0] for value in values))
        # Stateful ops run each time this part of the graph runs (in a loop, every time).
        self.calls.assign_add(1)
        self.bytes.assign_add(per_replica)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        self._count([per_replica_value])
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self._count([value for value, _ in value_destination_pairs])
        return [super(CountingReduction, self).reduce_implementation(reduce_op, v, d, options)
                for v, d in value_destination_pairs]


def any_worker(strategy: tf.distribute.Strategy):
    """A function of local flags that returns, on every worker alike, whether any worker
    raised each flag (one small all-reduce for all of them): `agree(flag) -> bool`,
    `agree(a, b) -> (bool, bool)`. Workers call it at the same step to agree on stopping,
    since a worker that stops alone leaves the others waiting in a collective."""
    mean = worker_mean(strategy)

    def agree(*flags):
        answers = tuple(v > 0 for v in mean([float(f) for f in flags]))
        return answers if len(answers) > 1 else answers[0]
    return agree


def worker_mean(strategy: tf.distribute.Strategy):
    """A function of a list of local numbers that returns their element-wise mean over the
    replicas of the cluster (one small all-reduce), the same on every worker."""
    @tf.function(reduce_retracing=True)
    def reduce_mean(values):
        per_replica = strategy.run(tf.identity, args=(values,))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

    return lambda values: reduce_mean(tf.constant(values, tf.float64)).numpy().tolist()


COLLECTIVE_OPS = ("CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3",
                  "CollectiveGather", "CollectiveGatherV2", "CollectiveBcastSend",
                  "CollectiveBcastRecv", "CollectiveBcastSendV2", "CollectiveBcastRecvV2",
                  "CollectiveAllToAllV2", "CollectiveAllToAllV3", "NcclAllReduce")


def graph_collectives(function) -> list[dict]:
    """The collective ops a traced `tf.function` runs per call, nested functions and loop
    bodies included: one entry per op with its kind, dtype and elements sent (a diagnostic:
    a training step should hold only its gradient all-reduce)."""
    found, seen = [], set()

    def walk(graph):
        for op in graph.get_operations():
            if op.type in COLLECTIVE_OPS:
                shape = op.inputs[0].shape if op.inputs else None
                found.append({"op": op.type, "dtype": op.inputs[0].dtype.name if op.inputs else "",
                              "elements": shape.num_elements() if shape is not None else None})
            for name, value in op.node_def.attr.items():
                if value.HasField("func"):
                    nested(graph, value.func.name)

    def nested(graph, name):
        if name in seen:
            return
        seen.add(name)
        while graph is not None:
            fn = internals.graph_function(graph, name)
            if fn is not None and getattr(fn, "graph", None) is not None:
                walk(fn.graph)
                return
            graph = getattr(graph, "outer_graph", None)

    for concrete in internals.concrete_functions(function):
        walk(concrete.graph)
    return found
