"""Does distillation earn its keep? A student at least 4x smaller than its teacher,
trained on 300 digits (validated on the others) alone and distilled from the
teacher, same seed, same student updates; then the distilled student exported as int8
TFLite (post-training, calibrated) and checked on the validation digits. Each side runs
`--seeds` seeds; the figures are the medians.

    python benchmarks/distill.py [--epochs 40] [--seeds 3] [--temperature 4] [--alpha 0.1]
                                 [--augment "[{mixup: {alpha: 1.0}}]"]
"""
import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np

import tftrain  # noqa: F401
import record
from tftrain.config import load_config
from tftrain.run import run

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
# A teacher regularized with dropout (as in Hinton et al.'s MNIST experiment) and a
# student 4.8x smaller without it.
TEACHER = "{name: cnn, params: {filters: [32, 64], dense: [128], dropout: 0.5}}"
STUDENT = "{name: cnn, params: {filters: [16, 32], dense: [32]}}"


def digits(path: Path, n_train: int = 300) -> Path:
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.images / 16.0)[..., None].astype(np.float32)
    order = np.random.default_rng(0).permutation(len(x))
    tr, va = order[:n_train], order[n_train:]
    np.savez(path, x=x[tr], y=d.target[tr], vx=x[va], vy=d.target[va])
    return path


CHOSEN = {"augment": "[]", "student": STUDENT, "teacher": TEACHER}   # from the command line


def common(data: Path, out: str, name: str, seed: int, epochs: int) -> list[str]:
    return [f"run.dir={out}", f"run.name={name}-{seed}", f"run.seed={seed}", "train.verbose=0",
            f"data.augment={CHOSEN['augment']}",
            "data.name=npz", f"data.params={{path: {data}, val_x_key: vx, val_y_key: vy}}",
            "data.per_replica_batch_size=16", "data.remainder=pad", f"train.epochs={epochs}",
            "train.optimizer={name: adam, learning_rate: 0.003}",
            "train.schedule={name: cosine, warmup_steps: 10}", "distribute.strategy=mirrored"]


def alone(data, out, seed, epochs) -> dict:
    sets = common(data, out, "alone", seed, epochs) + [
        f"model={CHOSEN['student']}", "export.saved_model=false", "export.tflite=none"]
    return run(load_config(QUICKSTART, sets))


def distilled(data, out, seed, epochs, temperature, alpha) -> dict:
    sets = common(data, out, "distilled", seed, epochs) + [
        f"model={CHOSEN['teacher']}", "export.tflite=int8",
        f"compression.distillation={{enabled: true, epochs: {epochs}, temperature: {temperature}, "
        f"alpha: {alpha}, student: {CHOSEN['student']}}}"]
    return run(load_config(QUICKSTART, sets))


def parameters(model: str) -> int:
    from tftrain.config import ModelConfig
    from tftrain.data import InputSpec
    from tftrain.models import build_model
    cfg = load_config(None, [f"model={model}"]).model
    return build_model(ModelConfig(name=cfg.name, params=cfg.params),
                       InputSpec((8, 8, 1), "float32", 10)).count_params()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--train-examples", type=int, default=300)
    p.add_argument("--teacher", default=None, help=f"the teacher model (default {TEACHER})")
    p.add_argument("--student", default=None, help=f"the student model, as `model` "
                   f"(default {STUDENT})")
    p.add_argument("--augment", default="[]", help="data.augment of every run, e.g. "
                   "'[{mixup: {alpha: 1.0}}]' (the teacher then labels the same mixed inputs)")
    args = p.parse_args()
    CHOSEN.update(augment=args.augment, student=args.student or STUDENT,
                  teacher=args.teacher or TEACHER)
    from tftrain.runtime.strategy import configure_devices
    configure_devices(load_config(QUICKSTART))      # before the first TensorFlow op
    teacher_params, student_params = parameters(CHOSEN["teacher"]), parameters(CHOSEN["student"])
    rows = []
    with tempfile.TemporaryDirectory() as out:
        data = digits(Path(out) / "digits.npz", args.train_examples)
        for seed in range(args.seeds):
            a = alone(data, out, seed, args.epochs)["metrics"]["val_accuracy"]
            s = distilled(data, out, seed, args.epochs, args.temperature, args.alpha)
            teacher = s["stages"]["train"]["metrics"]["val_accuracy"]
            student = s["metrics"]["val_accuracy"]
            int8 = s["artifacts"]["tflite_int8"]["accuracy"]
            rows.append((teacher, a, student, int8))
            print(f"seed {seed}: teacher {teacher:.4f}, student alone {a:.4f}, distilled "
                  f"{student:.4f}, distilled int8 TFLite {int8:.4f}", flush=True)
    med = [statistics.median(col) for col in zip(*rows)]
    gains = [s - a for _, a, s, _ in rows]
    drops = [s - i for _, _, s, i in rows]
    print(f"teacher {teacher_params:,} parameters, student {student_params:,} "
          f"({teacher_params / student_params:.1f}x smaller); {args.train_examples} training digits, "
          f"{args.epochs} epochs each, T={args.temperature:g}, alpha={args.alpha:g}, "
          f"data.augment={args.augment}")
    print(f"validation accuracy (medians of {args.seeds} seeds): teacher {med[0]:.4f}, student "
          f"alone {med[1]:.4f}, distilled {med[2]:.4f} (gain {statistics.median(gains) * 100:+.2f} "
          f"pt, won {sum(g > 0 for g in gains)}/{len(gains)}), distilled int8 TFLite {med[3]:.4f} "
          f"(drop {statistics.median(drops) * 100:.2f} pt, largest {max(drops) * 100:.2f} pt)")
    record.rows([(
        f"distillation: a CNN student ({student_params:,} parameters, "
        f"{teacher_params / student_params:.1f}× smaller) on {args.train_examples} digits, "
        f"{args.epochs} epochs, alone / distilled from a teacher ({teacher_params:,} parameters) "
        f"at T={args.temperature:g}, alpha {args.alpha:g}, same seeds and student updates",
        f"{med[1]:.4f} / {med[2]:.4f} validation accuracy (medians of {args.seeds} seeds; paired "
        f"gain median {statistics.median(gains) * 100:+.2f} pt, distilled better on "
        f"{sum(g > 0 for g in gains)} of {len(gains)}; teacher {med[0]:.4f}); the distilled "
        f"student as int8 TFLite {med[3]:.4f} (largest drop {max(drops) * 100:.2f} pt)")])


if __name__ == "__main__":
    main()
