"""The planner's memory estimate against the allocator's measured peak.

For several models and batch sizes: train a few steps on one CPU device, read the peak
bytes TensorFlow's allocator held (weights, optimizer slots, gradients, activations and
workspace, from before the model was built), and print it next to the planner's
estimate. The target is within +-30%.

    python benchmarks/planner.py
"""
import os
import sys

# the CPU allocator keeps statistics (peak memory) only as a BFC allocator: before TF loads
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import numpy as np

import tftrain  # noqa: F401
import record
from tftrain.runtime import placement
from tftrain.runtime import planner
from tftrain.runtime import precision
from tftrain.training import train_step
from tftrain.training.losses import build_loss
from tftrain.core.keras import keras
from tftrain.config import load_config
from tftrain.data import InputSpec
from tftrain.models import MODELS

import tensorflow as tf

CASES = [
    ("mlp [512, 512]", "mlp", {"hidden": [512, 512]}, InputSpec((32, 32, 1), "float32", 10)),
    ("cnn 32-64, dense 128", "cnn", {}, InputSpec((32, 32, 3), "float32", 10)),
    ("resnet-8 w16", "resnet", {"depth": 8, "width": 16}, InputSpec((32, 32, 3), "float32", 10)),
    ("transformer 2x64", "transformer", {}, InputSpec((64,), "int32", 4, 1000)),
]
BATCHES = (32, 128)


def measured_peak(name, params, spec, batch) -> tuple[int, float]:
    """(allocator peak bytes while training, the planner's estimate)."""
    keras.utils.set_random_seed(0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    with tf.device("/cpu:0"):
        net = precision.float32_outputs(MODELS.get(name)(spec, **params))
        model = train_step.TrainModel.wrap(net)
        model.compile(keras.optimizers.Adam(1e-3),
                      build_loss("sparse_categorical_crossentropy"))
        rng = np.random.default_rng(0)
        if spec.vocab_size:
            x = rng.integers(0, spec.vocab_size, (batch * 3, *spec.shape)).astype(np.int32)
        else:
            x = rng.normal(size=(batch * 3, *spec.shape)).astype(np.float32)
        y = rng.integers(0, spec.num_classes, len(x))
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - base
    cfg = load_config(None, [])
    estimate = planner.estimate(placement.layer_costs(net), batch, planner.optimizer_slots(cfg),
                                "float32").total
    return peak, estimate


def main():
    rows = []
    for label, name, params, spec in CASES:
        for batch in BATCHES:
            peak, est = measured_peak(name, params, spec, batch)
            rows.append((label, batch, peak, est))
    print("| model | batch | measured peak MiB | estimated MiB | estimate / measured |")
    print("|---|---|---|---|---|")
    for label, batch, peak, est in rows:
        print(f"| {label} | {batch} | {peak / 2**20:.1f} | {est / 2**20:.1f} | {est / peak:.2f} |")
    ratios = [est / peak for *_, peak, est in rows]
    print(f"\nwithin +-30%: {sum(0.7 <= r <= 1.3 for r in ratios)}/{len(ratios)}; "
          f"ratio range {min(ratios):.2f}-{max(ratios):.2f}")
    record.rows([("planner memory estimate / measured allocator peak (mlp, cnn, resnet-8, "
                  "transformer at batch 32 and 128)",
                  f"{min(ratios):.2f}–{max(ratios):.2f}, {sum(0.7 <= r <= 1.3 for r in ratios)} "
                  f"of {len(ratios)} within ±30%")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
