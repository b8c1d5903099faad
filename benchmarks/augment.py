"""Does augmentation earn its keep? A ResNet-8 trained on 300 digits upscaled to 32x32,
with and without random rotation/zoom/translation, same seed, same updates; validated on
the other 1,497 digits. Each side runs `--seeds` seeds; the figures are the medians.

    python benchmarks/augment.py [--epochs 60] [--seeds 3]
"""
import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

import tftrain  # noqa: F401
import record
import tensorflow as tf
from tftrain.config import load_config
from tftrain.run import run

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
AUGMENT = "[{random_affine: {rotation: 0.04, zoom: 0.1, translation: 0.08}}]"


def digits_32(path: Path, n_train: int = 300) -> Path:
    from sklearn.datasets import load_digits
    d = load_digits()
    x = tf.image.resize((d.images / 16.0)[..., None], (32, 32)).numpy().astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    tr, va = order[:n_train], order[n_train:]
    np.savez(path, x=x[tr], y=d.target[tr], vx=x[va], vy=d.target[va])
    return path


def accuracy(data: Path, out: str, epochs: int, seed: int, augment: bool) -> float:
    sets = [f"run.dir={out}", f"run.name={'aug' if augment else 'plain'}-{seed}", f"run.seed={seed}",
            "train.verbose=0", "data.name=npz",
            f"data.params={{path: {data}, val_x_key: vx, val_y_key: vy}}",
            "data.per_replica_batch_size=16", "data.remainder=pad", "model={name: resnet, params: {depth: 8}}",
            f"train.epochs={epochs}", "train.optimizer={name: adam, learning_rate: 0.002}",
            "train.schedule={name: cosine, warmup_steps: 20}", "export.saved_model=false",
            "export.tflite=none", "distribute.strategy=mirrored"]
    if augment:
        sets.append(f"data.augment={AUGMENT}")
    return run(load_config(QUICKSTART, sets))["metrics"]["val_accuracy"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    from tftrain.runtime.strategy import configure_devices
    configure_devices(load_config(QUICKSTART))      # before the first TensorFlow op
    with tempfile.TemporaryDirectory() as out:
        data = digits_32(Path(out) / "digits32.npz")
        plain, aug = [], []
        for seed in range(args.seeds):
            plain.append(accuracy(data, out, args.epochs, seed, False))
            aug.append(accuracy(data, out, args.epochs, seed, True))
            print(f"seed {seed}: without {plain[-1]:.4f}, with augmentation {aug[-1]:.4f}", flush=True)
    record.rows([(f"augmentation: ResNet-8 on 300 digits at 32×32 (validated on the other "
                  f"1,497), {args.epochs} epochs, without / with `{AUGMENT}`, same seeds and "
                  "updates",
                  f"{statistics.median(plain):.4f} / {statistics.median(aug):.4f} validation "
                  f"accuracy (medians of {args.seeds} seeds: "
                  + ", ".join(f"{a:.3f} → {b:.3f}" for a, b in zip(plain, aug)) + ")")])


if __name__ == "__main__":
    main()
