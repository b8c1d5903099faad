"""tf.data service: the same batches as the local pipeline, decoded on data workers."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import load_config
from tftrain.data import BatchPlan, load_source, train_dataset
from tftrain.launch import free_ports


@pytest.fixture(scope="module")
def dispatchers():
    """Two dispatchers, each with its worker, in this process."""
    service = tf.data.experimental.service
    servers, addresses = [], []
    for port, worker_port in zip(*[iter(free_ports(4))] * 2):
        d = service.DispatchServer(service.DispatcherConfig(port=port))
        w = service.WorkerServer(service.WorkerConfig(
            dispatcher_address=f"localhost:{port}", worker_address=f"localhost:{worker_port}",
            port=worker_port))
        servers += [d, w]
        addresses.append(f"grpc://localhost:{port}")
    yield addresses
    for s in reversed(servers):
        s._stop()


@pytest.mark.parametrize("parts", [1, 2])
def test_service_batches_equal_local_ones_from_any_update(dispatchers, parts):
    sets = ["data.augment=[{random_crop: {padding: 1}}, random_flip]", "data.remainder=pad",
            "data.per_replica_batch_size=50"]
    local = load_config(None, sets).data
    remote = load_config(None, sets + [f"data.service={{dispatchers: {dispatchers[:parts]}}}"]).data
    source = load_source(local, 0)
    plan = BatchPlan(50, 2, 1)                 # 16 updates per epoch, 32 replica batches
    for start in (0, 13):
        ours = list(train_dataset(source, plan, local, 3, start).take(45).as_numpy_iterator())
        theirs = list(train_dataset(source, plan, remote, 3, start).take(45).as_numpy_iterator())
        for a, b in zip(ours, theirs):
            for u, v in zip(a, b):
                np.testing.assert_array_equal(u, v)
