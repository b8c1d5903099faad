"""Start-up lines of TensorFlow's native code, kept off a run's console.

TensorFlow 2.21 logs through absl before `absl::InitializeLog()`, so
`TF_CPP_MIN_LOG_LEVEL` does not hold its import's lines back: every CPU run printed
"All log messages before absl::InitializeLog() ...", oneDNN's and the CUDA stub's notices
(twice: two libraries load), the CPU-feature guard's, and "failed call to cuInit" when
the devices are first listed on a machine without a GPU; the TFLite converter and LiteRT
print more while exporting. `quiet()` sends the process's stderr (its file descriptor,
where native code writes) to a temporary file for a bounded stretch (an import, the
device set-up, the export) and afterwards writes back every line but these (`NOISE`),
so an error or a warning of tftrain's own in that stretch is still shown, just after it.
`--verbose` (or TFTRAIN_VERBOSE=1) leaves stderr alone.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

NOISE = re.compile("|".join([
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"^[IW]0000 .*\] (oneDNN custom operations are on|Could not find cuda drivers)",
    r"^[IW]0000 .*cpu_feature_guard\.cc",
    r"^To enable the following instructions: .*rebuild TensorFlow",
    r"^E0000 .*cuda_(platform|executor|diagnostics)\.cc.*",
    r"^[IWE]0000 .*(cuda_dnn|cuda_fft|cuda_blas)\.cc.*Unable to register",
    r"^fully_quantize: \d+, inference_type: \d+, input_inference_type",
    r"^INFO: Created TensorFlow Lite XNNPACK delegate for CPU\.$",
    r"^INFO: Initialized TensorFlow Lite runtime\.$",
]))


def verbose() -> bool:
    return os.environ.get("TFTRAIN_VERBOSE") == "1"


@contextlib.contextmanager
def quiet():
    """Native stderr of the block held back, then written out without `NOISE`."""
    if verbose():
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):        # no real stderr (captured by a caller): as is
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except ValueError:
                pass
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode("utf-8", "replace").splitlines(True)
                    if not NOISE.search(line.rstrip("\n"))]
            if kept:
                os.write(2, "".join(kept).encode())


def _errors_only(record) -> bool:
    return record.levelno >= logging.ERROR


def python_warnings_held() -> None:
    """TensorFlow's own Python warnings (its `tensorflow` logger: "Callback method
    on_train_batch_end is slow compared to the batch time", retracing notices) kept off
    the command line's console below errors, as its native lines are; `--verbose` shows
    them. For the CLI's process only: `tftrain.run.run` from Python leaves logging as it
    is."""
    logger = logging.getLogger("tensorflow")
    if _errors_only not in logger.filters:
        logger.addFilter(_errors_only)
