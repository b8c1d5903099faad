"""`tftrain.plan`: what a run changes for its whole process is put back afterwards."""
import pytest
from tensorflow.python.framework import config as tf_config

from tftrain.plan import process_settings_kept


def test_op_determinism_a_run_turns_on_is_turned_off_after_it_even_on_error():
    assert not tf_config.is_op_determinism_enabled()
    with process_settings_kept():
        tf_config.enable_op_determinism()          # what `run.deterministic` does
        assert tf_config.is_op_determinism_enabled()
    assert not tf_config.is_op_determinism_enabled()
    with pytest.raises(RuntimeError, match="user code"):
        with process_settings_kept():
            tf_config.enable_op_determinism()
            raise RuntimeError("user code")
    assert not tf_config.is_op_determinism_enabled()


def test_a_caller_who_had_op_determinism_on_keeps_it():
    tf_config.enable_op_determinism()
    try:
        with process_settings_kept():
            tf_config.disable_op_determinism()
        assert tf_config.is_op_determinism_enabled()
    finally:
        tf_config.disable_op_determinism()


def _digits(*sets):
    from tftrain import data
    from tftrain.config.loading import load_config
    cfg = load_config(None, ["data.name=digits", "data.per_replica_batch_size=32",
                             "distribute.strategy=one_device", "distribute.virtual_cpus=2", *sets])
    return cfg, data.load_source(cfg.data, 0)


def test_a_cpu_planned_with_device_memory_counts_the_hosts_data_in_it():
    """A CPU's memory is the host's: the source's arrays and the input pipeline's buffers
    share its allocator, and the plan leaves them out of the step's room."""
    from tftrain.data.pipeline import decoded_bytes
    from tftrain.plan import INPUT_BUFFER_BATCHES, resident
    cfg, source = _digits("distribute.device_memory=64MiB", "data.feed=host")
    example = decoded_bytes(source) / source.num_train
    buffers = INPUT_BUFFER_BATCHES * 32 * example
    arrays = resident(cfg, source)                      # nothing measured: the arrays' bytes
    assert arrays.bytes == pytest.approx(decoded_bytes(source) + buffers)
    assert arrays.what == "the host's data: arrays and input buffers"
    measured = resident(cfg, source, held=3 * decoded_bytes(source))   # the allocator's word
    assert measured.bytes == pytest.approx(3 * decoded_bytes(source) + buffers)
    fed = resident(*_digits("distribute.device_memory=64MiB", "data.feed=device"))
    assert fed.bytes == pytest.approx(2 * decoded_bytes(source))       # arrays and the copy
    assert fed.what == "the host's data: arrays and the feed's copy"


def test_a_cpu_planned_on_its_available_memory_holds_nothing_back():
    from tftrain.plan import resident
    assert not resident(*_digits())


@pytest.mark.parametrize("strategy,builds", [("mirrored", 1), ("auto", 2)])
def test_a_named_strategy_trains_the_model_the_plan_sized_built_once(strategy, builds, monkeypatch):
    """With the strategy named, the plan sizes the model under it and the first stage
    trains that model, built once from the run's seed (the same weights as a build of its
    own); `auto` sizes a draft to choose the strategy, then builds the model under it."""
    import numpy as np

    import tftrain.models
    from tftrain.config.loading import load_config
    from tftrain.core.keras import keras
    from tftrain.plan import make
    from tftrain.runtime.precision import Precision
    from tftrain.training.preemption import Preemption

    real, calls = tftrain.models.build_model, []
    monkeypatch.setattr(tftrain.models, "build_model",
                        lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    cfg = load_config("configs/quickstart.yaml", [f"distribute.strategy={strategy}",
                                                  "export.preflight=false"])
    with Preemption() as stop:
        planned = make(cfg, smoke=True, stop=stop)
    assert len(calls) == builds
    net = planned.stages[0].net
    assert planned.parallel.take_draft() is None            # taken by the first stage
    assert all(planned.parallel.strategy.extended.variable_created_in_scope(v)
               for v in net.weights)
    keras.utils.set_random_seed(cfg.run.seed)
    alone = Precision(policy=planned.precision.policy, config=cfg.precision).build(
        lambda: real(cfg.model, planned.source.spec))
    assert [w.shape for w in alone.weights] == [w.shape for w in net.weights]
    for theirs, ours in zip(alone.weights, net.weights):
        np.testing.assert_array_equal(np.asarray(theirs), np.asarray(ours))
