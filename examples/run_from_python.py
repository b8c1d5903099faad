"""Run the whole pipeline from Python and read the summary.

    python examples/run_from_python.py
"""
import tftrain  # noqa: F401
from tftrain import load_config
from tftrain.run import run

cfg = load_config("configs/quickstart.yaml", ["run.name=from-python", "train.epochs=5"])
summary = run(cfg)
print("validation accuracy:", summary["metrics"]["val_accuracy"])
