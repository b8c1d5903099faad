"""The allocator's peak during a stage: per GPU, one figure for the CPUs' shared
allocator, nothing where the allocator keeps no statistics; the console's line."""
import tensorflow as tf

from tftrain.training import memory


def test_devices_are_named_as_the_allocator_knows_them():
    assert memory.Peaks(["/job:worker/replica:0/task:0/device:GPU:1", "/gpu:0"]).devices == \
        ["GPU:0", "GPU:1"]
    # logical CPU devices share one allocator: read once
    assert memory.Peaks(["/device:CPU:0", "/device:CPU:1"]).devices == ["CPU:0"]


def test_the_peak_counts_what_was_allocated_since_the_start():
    peaks = memory.Peaks(["/device:CPU:0"]).started()
    with tf.device("/cpu:0"):
        big = tf.random.normal((2048, 2048))           # 16 MiB
        float(tf.reduce_sum(big * 2.0))
    found = peaks.read(estimate=64 * 2**20)
    (peak,) = found["peak_bytes"].values()
    assert peak >= 2 * 16 * 2**20                      # the tensor and its double
    assert found["estimate_bytes"] == 64 * 2**20
    assert found["peak_over_estimate"] == round(peak / (64 * 2**20), 3)
    line = memory.describe(found, "training")
    assert line.startswith("allocator peak (training) CPU ") and "peak / estimate" in line


def test_an_allocator_without_statistics_records_nothing(monkeypatch):
    monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                        lambda device: {"current": 0, "peak": 0})
    assert memory.Peaks(["/device:CPU:0"]).read(estimate=1.0) is None
    assert memory.describe(None, "training") is None
