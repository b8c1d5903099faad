"""The first training step (tracing, graph optimisation, first run) and the steady step,
with tf_keras' Adam against tftrain's fused Adam (`tftrain.optim.fused`: one
`ResourceApplyAdam` per variable instead of a dozen element-wise ops), interleaved.

Each side runs in a process of its own (a process keeps what it traced), in turn A B A B
...; the figures are medians over rounds of the per-round ratios. Models: MobileNetV2
(alpha 0.35, 32x32x3, 158 trainable variables) and the quickstart CNN (8 variables),
compiled as a Keras user compiles them, trained on 12 random examples per step.

    python benchmarks/first_step.py [--rounds 3] [--steps 20]
"""
import argparse
import json
import statistics
import subprocess
import sys

import record

CHILD = r"""
import json, sys, time
import numpy as np
import tftrain
from tftrain.core.keras import keras
from tftrain.optim import fused
model_name, side, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
if model_name == "MobileNetV2":
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                           classes=10, classifier_activation=None)
    shape = (32, 32, 3)
else:
    from tftrain.data.source import InputSpec
    from tftrain.models.cnn import cnn
    shape = (8, 8, 1)
    model = cnn(InputSpec(shape, "float32", 10), filters=[32, 64], dense=[128])
optimizer = (fused.Adam if side == "fused" else keras.optimizers.Adam)(1e-3)
model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x, y = rng.random((12, *shape), np.float32), rng.integers(0, 10, 12)
began = time.perf_counter(); model.train_on_batch(x, y); first = time.perf_counter() - began
began = time.perf_counter()
for _ in range(steps):
    model.train_on_batch(x, y)
print(json.dumps({"first": first, "step": (time.perf_counter() - began) / steps}))
"""


def side(model: str, which: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, which, str(steps)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"CPU: {record.cpu_features()}", flush=True)
    figures = []
    for model in ("MobileNetV2", "cnn"):
        runs = {"tf_keras": [], "fused": []}
        for r in range(args.rounds):
            order = ("tf_keras", "fused") if r % 2 == 0 else ("fused", "tf_keras")
            for which in order:
                runs[which].append(side(model, which, args.steps))
                print(f"{model} round {r} {which}: {runs[which][-1]}", flush=True)
        ratio = lambda key: statistics.median(  # noqa: E731
            f[key] / k[key] for f, k in zip(runs["fused"], runs["tf_keras"]))
        first = {w: statistics.median(r["first"] for r in runs[w]) for w in runs}
        figures += [(f"{model}: first train step, fused Adam / tf_keras Adam",
                     f"{ratio('first'):.2f}x ({first['fused']:.1f} s against "
                     f"{first['tf_keras']:.1f} s; {record.cpu_features()})"),
                    (f"{model}: steady train step, fused Adam / tf_keras Adam",
                     f"{ratio('step'):.2f}x")]
    record.rows(figures)


if __name__ == "__main__":
    main()
