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
