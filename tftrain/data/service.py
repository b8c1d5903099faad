"""tf.data service: the input pipeline runs on data workers, batches come back in order.

Each training worker splits its pipeline into one part per data worker before anything
is decoded (part n takes replica batches n, n + N, ... of each epoch), sends part n to
data worker n (its own dispatcher, `parallel_epochs`, one job per iterator), and takes
the batches back round-robin. The batches, their order and the resume guarantees are
exactly those of the local pipeline; the decoding and augmentation happen elsewhere.

`python -m tftrain.data.service --port P --worker-port Q` hosts one dispatcher and its
worker (`python -m tftrain.launch --data-workers N` starts N of them).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Callable

import tensorflow as tf

from tftrain.core import exit_codes, internals


def spread(build: Callable[[int, int], tf.data.Dataset], dispatchers: list[str],
           per_epoch: int, first: int) -> tf.data.Dataset:
    """`build(part, parts)` on each dispatcher, merged back in order: `first` batches
    remain in the current epoch, `per_epoch` in each later one."""
    parts = len(dispatchers)
    remote = [build(n, parts).apply(tf.data.experimental.service.distribute(
        processing_mode="parallel_epochs", service=address))
        for n, address in enumerate(dispatchers)]
    if parts == 1:
        return remote[0]

    def turns(count):
        return tf.data.Dataset.range(count).map(lambda i: i % parts)

    choice = turns(first).concatenate(tf.data.Dataset.range(2**62).flat_map(
        lambda _: turns(per_epoch)))
    return tf.data.Dataset.choose_from_datasets(remote, choice)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tftrain.data.service",
                                description="one tf.data service dispatcher and its worker")
    p.add_argument("--port", type=int, required=True, help="dispatcher port")
    p.add_argument("--worker-port", type=int, required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=args.port))
    worker = service.WorkerServer(service.WorkerConfig(
        dispatcher_address=f"localhost:{args.port}", worker_address=f"localhost:{args.worker_port}",
        port=args.worker_port))
    print(f"tf.data service: dispatcher grpc://localhost:{args.port}, worker "
          f"localhost:{args.worker_port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(exit_codes.OK))
    try:
        while True:                 # serve until signalled (join() would block signals)
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        internals.stop_server(worker)
        internals.stop_server(dispatcher)
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
