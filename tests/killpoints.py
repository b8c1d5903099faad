"""Kill a run at a chosen point, for the tests of resumption: `python -m killpoints MODULE
ARGS...` runs `MODULE` (`tftrain.run`, or `tftrain.launch`, whose forked workers inherit
the patches) as `__main__` after patching tftrain's checkpointer so that every training
process SIGKILLs itself at the point `TFTRAIN_KILL` names (the launcher itself never
trains, so it is never the one killed):

- `update:U`: at the end of the training call that reaches update U of the first stage
  (with `train.steps_per_execution: 1`, exactly after update U);
- `step:U`: while update U's step runs (a timer fired from the batch's start: the step is
  in flight, its micro-batches half-accumulated);
- `validation:E`: during the validation that follows epoch E (1-based), after its first
  batch;
- `checkpoint:U`: inside the first checkpoint save numbered U or more, after its files are
  written and before the `checkpoint` state file lists it.

Nothing is patched without `TFTRAIN_KILL`. The process that was killed says where on
stderr first (`killpoint: ...`), so a test can check that the kill landed where it asked.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


def _die(where: str) -> None:
    print(f"killpoint: {where} (pid {os.getpid()})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install(spec: str) -> None:
    kind, _, value = spec.partition(":")
    at = int(value)
    from tftrain.training import callbacks

    checkpointer = callbacks.Checkpointer
    state = {"epoch": 0, "armed": True}

    if kind == "update":
        original = checkpointer.on_train_batch_end

        def on_train_batch_end(self, batch, logs=None):
            original(self, batch, logs)
            if self.update >= at and state["armed"]:
                _die(f"after update {self.update}")
        checkpointer.on_train_batch_end = on_train_batch_end
    elif kind == "step":
        def on_train_batch_begin(self, batch, logs=None):
            update = self._epoch * self.steps_per_epoch + batch + 1
            if update >= at and state["armed"]:
                state["armed"] = False
                threading.Timer(0.002, _die, args=(f"during the step of update {update}",)).start()
        checkpointer.on_train_batch_begin = on_train_batch_begin
    elif kind == "validation":
        original_end = checkpointer.on_epoch_begin

        def on_epoch_begin(self, epoch, logs=None):
            original_end(self, epoch, logs)
            state["epoch"] = epoch + 1

        def on_test_batch_end(self, batch, logs=None):
            if state["epoch"] >= at and self.model.stop_training is False:
                _die(f"during validation after epoch {state['epoch']}, batch {batch + 1}")
        checkpointer.on_epoch_begin = on_epoch_begin
        checkpointer.on_test_batch_end = on_test_batch_end
    elif kind == "checkpoint":
        from tensorflow.python.checkpoint import checkpoint_management as management

        update_state = management.update_checkpoint_state_internal

        def update_checkpoint_state_internal(save_dir, model_checkpoint_path, *args, **kwargs):
            number = int(str(model_checkpoint_path).rsplit("-", 1)[1])
            if number >= at:
                _die(f"writing checkpoint {number} (its files written, not yet listed)")
            return update_state(save_dir, model_checkpoint_path, *args, **kwargs)
        management.update_checkpoint_state_internal = update_checkpoint_state_internal
    else:
        raise SystemExit(f"killpoints: unknown kill point {spec!r}")


def main() -> None:
    import runpy

    import tftrain  # noqa: F401  (TF_USE_LEGACY_KERAS before TensorFlow)
    spec = os.environ.get("TFTRAIN_KILL")
    if spec:
        install(spec)
    module, args = sys.argv[1], sys.argv[2:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
