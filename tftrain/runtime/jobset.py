"""A pod of a Kubernetes JobSet: its place in the cluster from what Kubernetes gives, and
its peers checked before TensorFlow starts.

A JobSet's replicated Job is an Indexed Job: Kubernetes gives each pod its index
(`JOB_COMPLETION_INDEX`), and with `network.enableDNSHostnames` each pod a stable name,
`<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>`. The pod learns the rest from
its environment, which `python -m tftrain.launch --kubernetes` writes into the manifest
(the downward API for the labels JobSet sets, the manifest's own numbers for the others):

    JOBSET_NAME            label jobset.sigs.k8s.io/jobset-name
    JOBSET_REPLICATED_JOB  label jobset.sigs.k8s.io/replicatedjob-name
    JOBSET_JOB_INDEX       label jobset.sigs.k8s.io/job-index (0 with one Job)
    JOB_COMPLETION_INDEX   set by Kubernetes in every pod of an Indexed Job
    TFTRAIN_WORKERS        the number of pods of the set (workers)
    TFTRAIN_PODS_PER_JOB   pods of each Job (default: all of them, one Job)
    TFTRAIN_PORT           the port every worker listens on (default 2222)
    TFTRAIN_SUBDOMAIN      the set's subdomain (default: the JobSet's name, as JobSet's)

Worker `r` is pod `r % pods_per_job` of Job `r // pods_per_job`; worker 0 is the chief.
A TF_CONFIG in the environment wins over all of this (`cluster.current_task`).

`wait_for_peers` runs before TensorFlow is imported: it listens on this pod's port (so its
peers find it answering while they check) and waits until every peer's name resolves
and its port accepts a connection, or exits 2 naming the first peer that did not, after
`distribute.peer_wait` seconds (a TF_CONFIG written too early, or a pod that never
started, otherwise hangs at strategy creation).

Test-only: `TFTRAIN_TEST_HOSTS`, a JSON mapping of peer names to `host:port` addresses,
replaces Kubernetes' DNS (N local processes, each on its own localhost port, stand in for
N pods). Nothing outside tests sets it.
"""
from __future__ import annotations

import json
import socket
import threading
import time

from tftrain.config import ConfigError

NAME, REPLICATED_JOB, JOB_INDEX = "JOBSET_NAME", "JOBSET_REPLICATED_JOB", "JOBSET_JOB_INDEX"
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
WORKERS, PODS_PER_JOB = "TFTRAIN_WORKERS", "TFTRAIN_PODS_PER_JOB"
PORT, SUBDOMAIN, TEST_HOSTS = "TFTRAIN_PORT", "TFTRAIN_SUBDOMAIN", "TFTRAIN_TEST_HOSTS"
DEFAULT_PORT = 2222
# the JobSet labels the downward API reads into the variables above
LABELS = {NAME: "jobset.sigs.k8s.io/jobset-name",
          REPLICATED_JOB: "jobset.sigs.k8s.io/replicatedjob-name",
          JOB_INDEX: "jobset.sigs.k8s.io/job-index"}


def in_jobset(env) -> bool:
    return bool(env.get(NAME))


def _number(env, name: str, default: int | None = None, low: int = 0) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is not None:
            return default
        raise ConfigError(f"JobSet pod: {name} is not set; {_why(name)}")
    if not text.strip().isdigit() or int(text) < low:
        raise ConfigError(f"JobSet pod: {name}={text!r} is not a whole number >= {low}; "
                          f"{_why(name)}")
    return int(text)


def _why(name: str) -> str:
    if name == COMPLETION_INDEX:
        return ("Kubernetes sets it in every pod of an Indexed Job: the replicated Job needs "
                "completionMode: Indexed")
    if name in LABELS:
        return (f"set it from the pod's label {LABELS[name]} (env valueFrom.fieldRef "
                f"metadata.labels['{LABELS[name]}'])")
    return ("the manifest gives it (python -m tftrain.launch --kubernetes writes it); set it "
            "in the pod template's env")


def _shape(env) -> tuple[int, int]:
    """(workers, pods per Job) of the set."""
    workers = _number(env, WORKERS, low=1)
    per_job = _number(env, PODS_PER_JOB, default=workers, low=1)
    if workers % per_job:
        raise ConfigError(f"JobSet pod: {WORKERS}={workers} is not a whole number of Jobs of "
                          f"{PODS_PER_JOB}={per_job} pods")
    return workers, per_job


def hosts(env) -> list[str]:
    """Every worker's stable host name, by rank."""
    name = env[NAME]
    job = env.get(REPLICATED_JOB) or ""
    if not job:
        raise ConfigError(f"JobSet pod: {REPLICATED_JOB} is not set; {_why(REPLICATED_JOB)}")
    workers, per_job = _shape(env)
    subdomain = env.get(SUBDOMAIN) or name
    return [f"{name}-{job}-{r // per_job}-{r % per_job}.{subdomain}" for r in range(workers)]


def rank(env) -> int:
    workers, per_job = _shape(env)
    index = _number(env, COMPLETION_INDEX)
    job = _number(env, JOB_INDEX, default=0)
    if index >= per_job:
        raise ConfigError(f"JobSet pod: {COMPLETION_INDEX}={index} is not below the "
                          f"{per_job} pods of a Job ({PODS_PER_JOB}); the Job's completions "
                          "and parallelism must equal it")
    if job * per_job + index >= workers:
        raise ConfigError(f"JobSet pod: {JOB_INDEX}={job} with {per_job} pods a Job is "
                          f"worker {job * per_job + index}, not below {WORKERS}={workers}; "
                          "the replicated Job's replicas must be workers / pods per Job")
    return job * per_job + index


def addresses(env) -> list[str]:
    """Every worker's `host:port`, by rank (through the test resolver when it is set)."""
    port = _number(env, PORT, default=DEFAULT_PORT, low=1)
    found = [f"{host}:{port}" for host in hosts(env)]
    if env.get(TEST_HOSTS):
        table = json.loads(env[TEST_HOSTS])
        found = [table.get(a.rsplit(":", 1)[0], a) for a in found]
    return found


def describe(env) -> str:
    """Where this pod's place came from, for the plan."""
    names = [h.split(".", 1)[0] for h in hosts(env)]
    pods = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
    return (f"JobSet {env[NAME]} (pods {pods} of subdomain {env.get(SUBDOMAIN) or env[NAME]}, "
            f"port {_number(env, PORT, default=DEFAULT_PORT, low=1)}, "
            f"{COMPLETION_INDEX}={env.get(COMPLETION_INDEX)})")


_held: list = []       # this process's listener, until TensorFlow's server


def wait_for_peers(workers: tuple[str, ...], me: int, seconds: float,
                   names: list[str] | None = None, poll: float = 0.5
                   ) -> tuple[float, Listener | None]:
    """Wait until every other worker's name resolves and its port accepts a connection,
    answering on this worker's own port meanwhile; (the seconds waited, the listener, still
    answering: a peer that starts checking after this one finished must find it too, so
    it stays open until TensorFlow's server takes the port, `release`). ConfigError (exit
    2) naming the first peer that did not (by `names`, its pod's host name), after
    `seconds`."""
    names = names or [a.rsplit(":", 1)[0] for a in workers]
    listener = _listen(int(workers[me].rsplit(":", 1)[1]))
    began, problems = time.monotonic(), {}
    pending = [r for r in range(len(workers)) if r != me]
    try:
        while True:
            for r in list(pending):
                problem = _reach(workers[r])
                if problem is None:
                    pending.remove(r)
                    problems.pop(r, None)
                else:
                    problems[r] = problem
            waited = time.monotonic() - began
            if not pending:
                listener, found = None, listener
                return waited, found
            if waited >= seconds:
                r = pending[0]
                shown = names[r] + (f" at {workers[r]}" if not workers[r].startswith(names[r])
                                    else "")
                raise ConfigError(
                    f"distribute.peer_wait: worker {r} ({shown}) {problems[r]} after "
                    f"{seconds:g} s ({len(pending)} of {len(workers) - 1} peers missing); "
                    "check that its pod is running (kubectl get pods -l "
                    "jobset.sigs.k8s.io/jobset-name=...) and that the JobSet sets "
                    "network.enableDNSHostnames, or raise distribute.peer_wait")
            time.sleep(poll)
    finally:
        if listener is not None:
            listener.close()


def hold(listener: Listener | None) -> None:
    """Keep this process's listener answering until `release`."""
    release()
    if listener is not None:
        _held.append(listener)


def release() -> None:
    """Free this process's port for TensorFlow's server (before the strategy is built)."""
    while _held:
        _held.pop().close()


def _reach(address: str) -> str | None:
    """None when `address` accepts a connection, else what is wrong with it."""
    host, port = address.rsplit(":", 1)
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror:
        return "does not resolve"
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return None
    except OSError:
        return f"does not answer on port {port}"


class Listener:
    """A socket accepting (and closing) connections on a port until closed, so peers see
    this pod before TensorFlow's server takes the port."""

    def __init__(self, server: socket.socket):
        self.server = server
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:          # shut down
                return
            conn.close()

    def close(self) -> None:
        try:
            self.server.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept: the port is free
        except OSError:
            pass
        self.server.close()


def _listen(port: int) -> Listener | None:
    """A Listener on `port`; None when the port is taken (TensorFlow's server of an
    earlier attempt in this process: it answers instead)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", port))
    except OSError:
        server.close()
        return None
    server.listen(64)
    return Listener(server)


def environment(name: str, workers: int, port: int = DEFAULT_PORT,
                subdomain: str | None = None) -> list[dict]:
    """The pod template's `env` entries that give a pod this module's variables."""
    found = [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}
             for var, label in LABELS.items()]
    found += [{"name": WORKERS, "value": str(workers)}, {"name": PODS_PER_JOB, "value": str(workers)},
              {"name": PORT, "value": str(port)}, {"name": SUBDOMAIN, "value": subdomain or name}]
    return found
