"""`python -m tftrain.launch --workers N [--data-workers M] CONFIG [--set ...]`: N local
workers (and M tf.data service workers), or with `--kubernetes --image IMAGE` the
manifest of N pods on Kubernetes.

Starts N `python -m tftrain.run` processes with TF_CONFIG describing a cluster on free
localhost ports (TensorFlow's collective runtime over gRPC, as on a real cluster),
gives each worker its own share of the machine's GPUs (CUDA_VISIBLE_DEVICES, set before
the worker starts TensorFlow), prefixes their output with the worker index, forwards
SIGINT/SIGTERM, and when one
worker fails stops the others and exits with its code (42 when preempted). With
`--data-workers M` it first starts M tf.data service data workers (each with its
dispatcher) and points `data.service` at them; they are stopped when training ends.

`--kubernetes` starts nothing: it writes a JobSet manifest (the config as a ConfigMap, the
run directory on a PersistentVolumeClaim, N indexed pods that find their places without a
TF_CONFIG; `tftrain.runtime.kubernetes`) to stdout or `--output`, after planning the run
as its first pod would; `kubectl apply -f` it.

Where no GPU is visible the launcher imports TensorFlow once and forks its workers from
itself (`tftrain.runtime.forking`: about 5 s of CPU saved per worker); workers with GPUs,
or `--start fresh`, are fresh interpreters.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from tftrain.core import console
from tftrain.core import exit_codes
from tftrain.runtime import forking
from tftrain.runtime.forking import local_gpus, worker_setup  # noqa: F401  (the sweep's too)

EXIT_CONFIG, EXIT_PREEMPTED = exit_codes.CONFIG, exit_codes.PREEMPTED


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on localhost."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_env(index: int, ports: list[int], gpus: str | None = None) -> dict:
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
    return {**os.environ, "TF_CONFIG": json.dumps(tf_config),
            **({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {})}


def gpu_sets(workers: int, gpus: list[str]) -> list[str | None]:
    """Each worker's CUDA_VISIBLE_DEVICES: an equal, disjoint share of the GPUs (every
    worker would otherwise see, and allocate on, every GPU). None without GPUs."""
    if not gpus:
        return [None] * workers
    if len(gpus) < workers:
        raise ValueError(f"{workers} workers for {len(gpus)} GPUs; start at most one worker "
                         "per GPU (--workers)")
    share = len(gpus) // workers
    return [",".join(gpus[w * share:(w + 1) * share]) for w in range(workers)]


def cpu_sets(workers: int, per_worker: int | None) -> list[set[int] | None]:
    """CPUs to pin each worker to (round-robin over the machine's CPUs)."""
    if not per_worker:
        return [None] * workers
    cpus = sorted(os.sched_getaffinity(0))
    return [{cpus[(w * per_worker + k) % len(cpus)] for k in range(per_worker)}
            for w in range(workers)]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def parse_args(argv):
    paragraphs = __doc__.split("\n\n")
    first = paragraphs[0].split(": ", 1)[1].replace("\n", " ")
    about = "\n\n".join([first[0].upper() + first[1:], *paragraphs[1:3]])
    p = argparse.ArgumentParser(
        prog="python -m tftrain.launch", description=about,
        epilog="example: python -m tftrain.launch --workers 2 configs/quickstart.yaml "
               "--set distribute.virtual_cpus=1\n\nexit codes: as tftrain.run's (the failing "
               "worker's; 42 when the workers stopped on a signal after saving)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, required=True, help="number of local workers")
    p.add_argument("--cpus-per-worker", type=int, default=None,
                   help="pin each worker to this many CPUs")
    p.add_argument("--data-workers", type=int, default=0,
                   help="tf.data service workers to run the input pipelines on")
    p.add_argument("--start", choices=forking.MODES, default="auto",
                   help="how workers start: forked from the launcher after it imported "
                        "TensorFlow (auto: where no GPU is visible) or fresh interpreters")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--run-dir")
    p.add_argument("--smoke", action="store_true",
                   help="each worker runs tftrain.run --smoke (a few batches per stage)")
    p.add_argument("--dry-run", action="store_true",
                   help="each worker prints the plan and exits (--kubernetes: the plan of "
                        "the first pod, then the manifest)")
    k = p.add_argument_group("Kubernetes (--kubernetes: write a JobSet manifest, apply nothing)")
    k.add_argument("--kubernetes", action="store_true", help="write the manifest of --workers pods")
    k.add_argument("--image", help="container image with tftrain and the run's data or code")
    k.add_argument("--gpus-per-worker", type=int, default=0, help="nvidia.com/gpu per pod")
    k.add_argument("--storage", metavar="CLAIM",
                   help="an existing PersistentVolumeClaim for the run directory (default: "
                        "the manifest makes one, ReadWriteMany)")
    k.add_argument("--storage-size", default="20Gi", help="size of the claim it makes")
    k.add_argument("--storage-class", help="storage class of the claim it makes")
    k.add_argument("--name", help="JobSet name (default: from run.name)")
    k.add_argument("--namespace")
    k.add_argument("--queue", help="Kueue LocalQueue (label kueue.x-k8s.io/queue-name)")
    k.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of the whole set after a lost pod or a crash")
    k.add_argument("--port", type=int, default=2222, help="the workers' port")
    k.add_argument("--grace", type=int, default=300,
                   help="seconds from SIGTERM to SIGKILL (the checkpoint a SIGTERM saves)")
    k.add_argument("--cpu", help="CPU request and limit per pod, e.g. 8 (default: 4 per GPU, "
                                 "2 without)")
    k.add_argument("--memory", help="memory request and limit per pod, e.g. 64Gi (default: "
                                    "16Gi per GPU, 8Gi without)")
    k.add_argument("--uid", type=int, default=10001, help="the pods' numeric user and group")
    k.add_argument("--egress", action="append", default=[], metavar="CIDR:PORT",
                   help="a destination the pods may reach beyond each other and DNS (an "
                        "MLflow server); repeatable")
    k.add_argument("--output", "-o", help="write the manifest here (default: stdout)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.kubernetes:
        return kubernetes(args)
    if args.workers < 1:
        print("tftrain.launch: --workers must be >= 1", file=sys.stderr)
        return EXIT_CONFIG
    try:
        gpus = local_gpus()
        gpu_sets(args.workers, gpus)
        fork = forking.forks(args.start, gpus)
    except ValueError as err:
        print(f"tftrain.launch: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if fork:                       # once, before any thread: every worker is forked from here
        forking.preload("tftrain.run")
    services, sets = start_data_workers(args.data_workers, fork), list(args.set)
    if services:
        sets.append("data.service={dispatchers: [%s]}" % ", ".join(a for a, _ in services))
    command = [args.config, *[a for s in sets for a in ("--set", s)],
               *(["--run-dir", args.run_dir] if args.run_dir else []),
               *(["--smoke"] if args.smoke else []), *(["--dry-run"] if args.dry_run else [])]
    try:
        return _train(command, args, gpus, fork, services)
    finally:
        for _, proc in services:
            proc.terminate()
        _join([p for _, p in services], 10, kill=True)


def kubernetes(args) -> int:
    """Write the JobSet manifest of `args` (exit 2 with one line on a config error)."""
    import yaml

    from tftrain.config import ConfigError, apply_overrides, load_config, read_yaml
    from tftrain.plan import sketch
    from tftrain.runtime import kubernetes as k8s

    try:
        for flag, given in (("--run-dir", args.run_dir), ("--data-workers", args.data_workers),
                            ("--cpus-per-worker", args.cpus_per_worker)):
            if given:
                raise ConfigError(f"{flag}: not with --kubernetes (the run directory is the "
                                  "volume at /runs; pods get their CPUs from --cpu)")
        sets = [*args.set, f"run.dir={k8s.RUNS_DIR}"]
        cfg = load_config(args.config, sets)
        # the config as the user wrote it, every --set applied (the defaults left implicit)
        given = yaml.safe_dump(apply_overrides(read_yaml(args.config), sets), sort_keys=False)
        cluster = k8s.Cluster(
            name=args.name or k8s.name_from(cfg.run.name), workers=args.workers,
            image=args.image or "", gpus_per_worker=args.gpus_per_worker, storage=args.storage,
            storage_size=args.storage_size, storage_class=args.storage_class,
            namespace=args.namespace, queue=args.queue, max_restarts=args.max_restarts,
            port=args.port, grace_seconds=args.grace, cpu=args.cpu, memory=args.memory,
            smoke=args.smoke, uid=args.uid, egress=tuple(args.egress))
        cluster.check()
        with k8s.as_pod(cluster):      # the plan its first pod makes: refusals surface here
            plan = sketch(cfg, args.smoke)
        docs = k8s.manifest(cluster, given)
    except ConfigError as err:
        for problem in err.problems:
            print(console.problem("tftrain.launch: config error: ", problem), file=sys.stderr)
        return EXIT_CONFIG
    text = k8s.to_yaml(docs)
    if not cluster.by_digest:
        print(console.wrap(f"tftrain.launch: warning: --image {cluster.image} is a tag, which can "
                           "be moved to another image; give IMAGE@sha256:DIGEST to run exactly "
                           "the image you checked"), file=sys.stderr)   # stdout: the manifest
    if args.dry_run:
        print("\n".join(f"# {line}" for line in plan.splitlines()))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}: {len(docs)} documents, JobSet {cluster.name} of "
              f"{cluster.workers} pods; apply with: kubectl apply -f {args.output}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return exit_codes.OK


def start_data_workers(n: int, fork: bool = False) -> list[tuple[str, object]]:
    """n tf.data service data workers, each with its dispatcher: (address, process); their
    output is printed once the training workers have started (`_train`)."""
    started = []
    for k in range(n):
        port, worker_port = free_ports(2)
        proc = forking.start("tftrain.data.service", ["--port", str(port), "--worker-port",
                                                      str(worker_port)],
                             fork=fork, stdout=subprocess.PIPE,
                             setup=lambda: worker_setup(None))
        started.append((f"grpc://localhost:{port}", proc))
    return started


def _train(command, args, gpus: list[str], fork: bool = False, services=()) -> int:
    ports = free_ports(args.workers)
    procs = []
    shares = gpu_sets(args.workers, gpus)
    for index, cpus in enumerate(cpu_sets(args.workers, args.cpus_per_worker)):
        # Each worker in a session of its own: a Ctrl-C at the terminal reaches the
        # launcher alone, which forwards it once (a worker that got the terminal's SIGINT
        # and the forwarded one would take the second as "stop now", with no checkpoint).
        procs.append(forking.start("tftrain.run", command, fork=fork,
                                   env=worker_env(index, ports, shares[index]),
                                   stdout=subprocess.PIPE,
                                   setup=lambda c=cpus: worker_setup(c)))
    # output threads only now: a fork copies the calling thread alone
    labelled = [(f"[data {k}] ", p) for k, (_, p) in enumerate(services)] + \
               [(f"[worker {i}] ", p) for i, p in enumerate(procs)]
    pumps = [threading.Thread(target=_pump, args=(p.stdout, prefix, sys.stdout), daemon=True)
             for prefix, p in labelled]
    for pump in pumps:
        pump.start()

    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    code = _wait(procs)
    for pump in pumps[len(services):]:    # every worker's last lines before we exit
        pump.join(timeout=10)
    return code


def _wait(procs, grace: float = 10.0) -> int:
    """Wait for all workers; when one fails, stop the rest and return its code.

    A worker that exits 42 was preempted: the others agreed to stop at the same update and
    are saving too, so they get `grace` seconds to finish on their own before being
    signalled (a second SIGTERM during their shutdown would kill them mid-way)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            if all(c == EXIT_PREEMPTED for c in failed):
                _join(procs, grace)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            _join(procs, grace, kill=True)
            code = failed[0]
            return code if code > 0 else exit_codes.RUNTIME
        if all(c == exit_codes.OK for c in codes):
            return exit_codes.OK
        time.sleep(0.1)


def _join(procs, timeout: float, kill: bool = False) -> None:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            if kill:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
