"""Callbacks Keras hands their batch logs as tensors (`tftrain.training.device_logs`)."""


def test_every_callback_with_a_batch_hook_a_stage_fits_with_leaves_the_logs_on_the_device(
        tmp_path):
    """With one that does not, Keras copies each call's logs to the host (a wait for the
    step, which on a GPU stops the host from queueing the next call); the matrix checks
    the runs' `host.logs_copied_by` too."""
    from tftrain.core import internals
    from tftrain.training.callbacks import Checkpointer
    from tftrain.training.heap import FrozenWhileFitting
    from tftrain.training.input_wait import InputWait
    from tftrain.training.profiling import ProfileWindow
    from tftrain.training.progress import EpochLine, UpdateLog
    from tftrain.training.epoch_logs import ExecutionSizer, GlobalMetrics, Throughput
    ours = [Throughput(32), GlobalMetrics(), ExecutionSizer(10), InputWait(), UpdateLog(1, 10),
            EpochLine("train", 2, 10), Checkpointer(None, 5, 10),
            ProfileWindow(2, 4, str(tmp_path), 10), FrozenWhileFitting(100)]
    assert all(c._implements_train_batch_hooks() for c in ours)
    assert internals.logs_copied_by(ours) == []
