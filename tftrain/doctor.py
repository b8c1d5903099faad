"""Environment doctor: is the installed stack coherent, and what will a run use?

    python -m tftrain.doctor

prints the TensorFlow, tf_keras, Keras, tfmot and LiteRT versions and whether they work
together, the optional extras installed (onnx, mlflow, sweep, profile), the devices (GPU compute capabilities), what `precision.policy: auto` picks,
whether NCCL can reduce gradients, and the cluster this process belongs to (TF_CONFIG,
SLURM, Kubeflow). Exit 0 when a run can work, 1 with the fix for each problem when it
cannot. `tftrain.run` checks the cheap part (`stack_problems`: versions only, no
TensorFlow import) before it starts.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys

PACKAGES = {"TensorFlow": "tensorflow", "tf_keras": "tf_keras", "Keras": "keras",
            "tfmot": "tensorflow-model-optimization", "LiteRT": "ai-edge-litert"}


# optional extras: each needs one distribution of every group
EXTRAS = {"onnx": (("tf2onnx",), ("onnxruntime", "onnxruntime-gpu"), ("onnx",)),
          "mlflow": (("mlflow", "mlflow-skinny"),), "sweep": (("optuna",),),
          "profile": (("xprof", "tensorboard-plugin-profile"),)}


class StackError(RuntimeError):
    """The installed packages cannot work together; the message says how to fix it."""


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Installed version of each package of the stack, None when missing."""
    return {name: installed_version(dist) for name, dist in PACKAGES.items()}


def extras() -> list[tuple[str, str]]:
    """A report row per optional extra: its packages' versions, or how to install it."""
    rows = []
    for extra, groups in EXTRAS.items():
        found = [next(((d, v) for d in group if (v := installed_version(d))), None)
                 for group in groups]
        rows.append((f"extra [{extra}]", ", ".join(f"{d} {v}" for d, v in found) if all(found)
                     else f'not installed: pip install -e ".[{extra}]"'))
    return rows


def _minor(version: str) -> tuple[int, int]:
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def stack_problems(found: dict[str, str | None] | None = None) -> list[str]:
    """One line per incoherence, each with its fix (versions only: cheap)."""
    found = versions() if found is None else found
    tf_version, problems = found.get("TensorFlow"), []
    if tf_version is None:
        return ["TensorFlow is not installed: pip install -e . (installs the tested stack)"]
    major, minor = _minor(tf_version)
    if (major, minor) < (2, 16):
        problems.append(f"TensorFlow {tf_version} is older than 2.16, which tftrain needs: "
                        "pip install 'tensorflow>=2.16'")
    keras2 = found.get("tf_keras")
    if keras2 is None:
        problems.append(f"tf_keras is not installed (tfmot and tftrain need Keras 2 with "
                        f"TensorFlow {tf_version}): pip install 'tf_keras~={major}.{minor}.0'")
    elif _minor(keras2) != (major, minor):
        problems.append(f"tf_keras {keras2} does not match TensorFlow {tf_version} (their "
                        f"minor versions must be equal): pip install 'tf_keras~={major}.{minor}.0'")
    if found.get("tfmot") is None:
        problems.append("tensorflow-model-optimization is not installed (pruning, QAT): "
                        "pip install 'tensorflow-model-optimization>=0.8'")
    elif _minor(found["tfmot"]) < (0, 8):
        problems.append(f"tensorflow-model-optimization {found['tfmot']} predates tf_keras "
                        "support (0.8): pip install 'tensorflow-model-optimization>=0.8'")
    if found.get("LiteRT") is None:
        problems.append("ai-edge-litert is not installed (TFLite artifacts are verified with "
                        "it): pip install ai-edge-litert")
    return problems


def check_stack() -> None:
    """Raise `StackError` naming the first incoherence and its fix (for `tftrain.run`)."""
    problems = stack_problems()
    if problems:
        raise StackError(f"{problems[0]} (python -m tftrain.doctor shows the whole environment)")


def import_problems() -> list[str]:
    """What fails when the stack is imported together (the expensive part)."""
    problems = []
    try:
        import tftrain  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow)
        import tensorflow as tf
        if not tf.keras.__name__.startswith("tf_keras") and not \
                tf.keras.__version__.startswith("2."):
            problems.append(f"tf.keras is Keras {tf.keras.__version__}: set TF_USE_LEGACY_KERAS=1 "
                            "before TensorFlow is imported (import tftrain first)")
    except Exception as err:     # noqa: BLE001  (reported, with the fix)
        return [f"TensorFlow does not import ({type(err).__name__}: {err}): reinstall it, "
                "pip install --force-reinstall -e ."]
    try:
        import tensorflow_model_optimization  # noqa: F401
    except Exception as err:     # noqa: BLE001
        problems.append(f"tensorflow-model-optimization does not import ({type(err).__name__}: "
                        f"{err}): pip install 'tensorflow-model-optimization>=0.8' 'tf_keras'")
    return problems


def devices() -> list[str]:
    import tensorflow as tf

    lines = [f"{len(tf.config.list_physical_devices('CPU'))} CPU, "
             f"{len(tf.config.list_physical_devices('GPU'))} GPU"]
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        cap = details.get("compute_capability")
        lines.append(f"{gpu.name}: {details.get('device_name', 'GPU')}, compute capability "
                     f"{'.'.join(map(str, cap)) if cap else 'unknown'}")
    return lines


def precision_choice() -> str:
    from tftrain.runtime import precision
    from tftrain.config import PrecisionConfig

    cap = precision.gpu_compute_capability()
    why = (f"GPU compute capability {cap[0]}.{cap[1]}" if cap else
           "CPU with bfloat16 instructions" if precision.cpu_has_bf16() else
           "CPU without bfloat16 instructions")
    return f"{precision.choose_policy(PrecisionConfig())} ({why})"


def nccl() -> str:
    import tensorflow as tf

    info = tf.sysconfig.get_build_info()
    gpus = len(tf.config.list_physical_devices("GPU"))
    if not info.get("is_cuda_build"):
        return "no (this TensorFlow is not a CUDA build): gradients are reduced on the host"
    if gpus == 0:
        return "no GPU visible: gradients are reduced on the host"
    return (f"yes (CUDA {info.get('cuda_version')}, {gpus} GPU): gradients are all-reduced "
            "with NCCL (MirroredStrategy, and multi-worker with distribute.communication auto "
            "or nccl); a bfloat16 all-reduce travels as float16 (NCCL has no bfloat16)")


def cluster_environment(env=None) -> tuple[str, list[str]]:
    """(what this process is part of, problems)."""
    from tftrain.runtime import cluster

    env = os.environ if env is None else env
    try:
        task = cluster.current_task(env)
    except Exception as err:     # noqa: BLE001  (malformed TF_CONFIG or SLURM variables)
        return "unreadable", [f"the cluster environment is malformed ({err}): fix or unset "
                              "TF_CONFIG / the JobSet pod's or SLURM's variables"]
    if task.source == "local":
        unstarted = cluster.slurm_without_srun(env)
        if unstarted:                 # it works, as one process: said, not a problem
            return f"none: a single worker; {unstarted}", []
        slurm = " (inside a SLURM allocation)" if "SLURM_JOB_ID" in env else ""
        return f"none: a single worker{slurm}", []
    source = task.source
    if source == "TF_CONFIG" and "KUBERNETES_SERVICE_HOST" in env:
        source = "Kubeflow (TF_CONFIG from the training operator)"
    role = "chief" if task.chief else "worker"
    return (f"{source}: {len(task.workers)} workers, this process is {role} (rank "
            f"{task.rank})" + (f", GPUs {task.gpus}" if task.gpus else ""), [])


def report(env=None) -> tuple[list[tuple[str, str]], list[str]]:
    """(rows of the report, problems with their fixes)."""
    found = versions()
    problems = stack_problems(found)
    rows = [(name, version or "not installed") for name, version in found.items()]
    if not problems:
        problems += import_problems()
    rows.append(("stack", "coherent" if not problems else "INCOHERENT"))
    rows += extras()
    if not problems:
        rows += [("devices", line) for line in devices()]
        rows += [("precision auto", precision_choice()), ("NCCL", nccl())]
        where, cluster_problems = cluster_environment(env)
        rows.append(("cluster", where))
        problems += cluster_problems
    return rows, problems


def main(argv=None) -> int:
    rows, problems = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for problem in problems:
        print(f"tftrain doctor: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
