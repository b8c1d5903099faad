"""Runs the end-to-end tests of several modules hold their results against."""
import pytest

from helpers import shared_run


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """`python -m tftrain.launch --workers 2` on the quickstart (test_launch.py's `SETS`),
    once per session: (its run directory, its output)."""
    from test_launch import finish, launch, scratch_dirs

    def build(out_dir):         # workers started fresh; every other launch forks them
        code, out = finish(launch(out_dir, f"tracking.mlflow={{uri: 'sqlite:///{out_dir}/mlflow.db', "
                                           "experiment: launch}", start="fresh"))
        assert code == 0, out[-3000:]
        assert not scratch_dirs(out_dir / "quickstart")   # non-chief scratch checkpoints removed
        return out
    out_dir, out = shared_run(tmp_path_factory, "two-workers", build)
    return out_dir / "quickstart", out
