"""Every Keras 3 Application brought in as a file: each `keras.applications` model that
builds at 32 x 32 x 3 (75 x 75 for those that need more) is saved untrained by Keras 3 as
`.keras` with a 10-class head, then run as `model.name: file:...` with `train.epochs: 0`
(digits upscaled to that size, one device, float32, SavedModel and float TFLite), and its
outcome printed as a row of docs/bring_your_own_model.md's table: converted and every
file verified, or refused (exit 2) with the reason, or failed (exit 1) with the error.
Slow (minutes a model), so a script, not a test.

`--compress`: each model from both sources, a Keras 3 `.keras` file and tf_keras's own
(`keras_applications:NAME`), trained 1 epoch on the digits (longer or slower where
`TRAINING` says so for its family), then pruned to 50% (1 epoch), prune-preserving QAT
(1 epoch) and an int8 TFLite file: a row of the QAT model's accuracy, the int8 file's,
its bytes, int8 / float latency at batch 1 on 1 thread and the float ops left, or the
refusal with its reason. About 5-20 minutes a model and
source on 2 cores (ResNet50V2 from tf_keras: 12 minutes).

    python scripts/keras_applications.py [--only MobileNetV3Small ConvNeXtTiny] [--runs DIR]
    python scripts/keras_applications.py --compress [--only DenseNet121 ResNet50V2]
                                         [--keras3-epochs 10] [--out rows.jsonl]

`--out`: each row is appended to this file as it is made, and rows already in it are not
made again, so a sweep of many hours can stop and go on where it stopped. The rows made
so far are in `benchmarks/keras_applications.jsonl` (`--out` it to go on from them), the
smallest models first:

    python scripts/keras_applications.py --compress --out benchmarks/keras_applications.jsonl \
        --only $(python scripts/keras_applications.py --by-size)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (32, 75)          # the first each builds at without pretrained weights
TRAINED: dict[Path, float] = {}     # a file's Keras 3 accuracy on the training split
BUILDS_AT: dict[str, int] = {}      # an application's smallest size (of SIZES) it builds at


def names() -> list[str]:
    import keras
    return sorted(n for n in dir(keras.applications) if n[:1].isupper())


# the order the sweep takes them in: the smallest (fewest parameters) first, so that an
# interrupted sweep has covered as many as it could
BY_SIZE = ("MobileNetV3Small MobileNet MobileNetV2 MobileNetV3Large EfficientNetB0 "
           "EfficientNetV2B0 NASNetMobile ConvNeXtTiny ResNet50 ResNet50V2 DenseNet121 "
           "EfficientNetB1 EfficientNetV2B1 EfficientNetB2 EfficientNetV2B2 InceptionV3 "
           "Xception VGG16 VGG19 EfficientNetB3 EfficientNetV2B3 DenseNet169 DenseNet201 "
           "ConvNeXtSmall ResNet101 ResNet101V2 EfficientNetV2S InceptionResNetV2 ResNet152 "
           "ResNet152V2 EfficientNetB4 ConvNeXtBase EfficientNetB5 EfficientNetV2M NASNetLarge "
           "EfficientNetB6 ConvNeXtLarge EfficientNetB7 EfficientNetV2L ConvNeXtXLarge").split()


# applications that rescale their input inside from [0, 255] (include_preprocessing):
# tftrain's images are in [0, 1], so their Keras 3 files get a `Rescaling(255)` first, as
# a user feeding them would add (without it, ConvNeXt's normalization made every image
# nearly the same); the rows of 2026-12-07's first sweep sessions were made without it
RESCALED_INSIDE = ("ConvNeXt", "EfficientNet", "MobileNetV3")
# training settings a family needs from random weights in one epoch: VGG (no batch norm)
# stays at chance with Adam at the recipe's 0.003 and reaches 0.87 at 1e-4 (plain Keras,
# VGG16 on the digits, one epoch)
# EfficientNet (B0-B7; not the V2s, 0.88-0.98 in one epoch) reached only 0.44-0.79 in one
# epoch, and a network that far from trained is chaotic in int8: EfficientNetB4 from
# tf_keras's int8 file, run by XNNPack and by LiteRT's built-in kernels (one 8-bit step
# apart here and there), agreed on 72% of the digits, so its int8 / QAT accuracy was a
# coin toss. Three epochs (2026-12-07, from tf_keras): EfficientNetB2 QAT 0.5519 -> 0.8222
# (int8 0.8407, 88% of the int8 file's answers the QAT model's), EfficientNetB4 0.5444 ->
# 0.7593 (int8 0.7704, 79%)
TRAINING = {"VGG": ["train.optimizer.learning_rate=0.0001",
                    "compression.pruning.learning_rate=0.0001",
                    "compression.quantization.learning_rate=0.00005"],
            "EfficientNetB": ["train.epochs=3"]}


def family_settings(name: str) -> list[str]:
    return [o for prefix, overrides in TRAINING.items() if name.startswith(prefix)
            for o in overrides]


def save(name: str, size: int, out: Path, epochs: int = 0) -> Path:
    """The application `name` at `size` with a 10-class head, saved by Keras 3; trained
    first by Keras 3 for `epochs` on the digits' training split as tftrain reads it."""
    path = out / f"{name}.keras"
    rescaled = name.startswith(RESCALED_INSIDE)
    code = f"""
import sys
import numpy as np
import keras
inputs = keras.Input(({size}, {size}, 3))
x = keras.layers.Rescaling(255.0)(inputs) if {rescaled} else inputs
backbone = getattr(keras.applications, {name!r})(include_top=False, weights=None,
                                                 input_tensor=x, pooling="avg")
model = keras.Model(inputs, keras.layers.Dense(10, name="logits")(backbone.output))
if {epochs}:
    import tensorflow as tf
    from tftrain import data
    from tftrain.config import load_config
    cfg = load_config({str(ROOT / "configs/image_transfer.yaml")!r},
                      ["data.params={{image_size: {size}, channels: 3}}"])
    source = data.load_source(cfg.data, cfg.run.seed)
    x, y = (np.asarray(t) for t in source.load(tf.range(source.num_train, dtype=tf.int32)))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs={epochs}, verbose=0)
    print("keras 3 training accuracy", model.evaluate(x, y, verbose=0)[1], file=sys.stderr)
model.save({str(path)!r})
"""
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    for line in done.stderr.decode().splitlines():
        if line.startswith("keras 3 training accuracy"):
            TRAINED[path] = float(line.split()[-1])
    return path



def saved(name: str, runs: Path, epochs: int = 0) -> tuple[int, Path | None, str]:
    """(size, path, "") of the model saved at the first size it builds at, or (size,
    None, why) when it builds at none."""
    why = ""
    for size in SIZES:
        try:
            return size, save(name, size, runs, epochs), ""
        except subprocess.CalledProcessError as err:
            why = err.stderr.decode().strip().splitlines()[-1][-300:]
    return SIZES[-1], None, why


def trial(name: str, runs: Path, timeout: int) -> dict:
    size, path, why = saved(name, runs)
    if path is None:
        return {"name": name, "outcome": "does not build", "why": why}
    overrides = [f"run.name={name}", f"model.name=file:{path}", "model.params={}",
                 "data.name=digits", f"data.params={{image_size: {size}, channels: 3}}",
                 "train.epochs=0", "distribute.strategy=one_device", "precision.policy=float32",
                 "train.accumulation_steps=1", "compression.pruning.enabled=false",
                 "compression.quantization.enabled=false", "export.tflite=float",
                 "export.preflight=false"]
    cmd = [sys.executable, "-m", "tftrain.run", "configs/image_transfer.yaml", "--run-dir",
           str(runs), *[a for o in overrides for a in ("--set", o)]]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "size": size, "outcome": f"over {timeout} s"}
    row = {"name": name, "size": size, "exit": done.returncode}
    summary = runs / name / "summary.json"
    if done.returncode == 0 and summary.exists():
        found = json.loads(summary.read_text())
        row["outcome"] = "converted, " + ", ".join(
            f"{k} {'verified' if a.get('verified') else 'FAILED'}"
            for k, a in found["artifacts"].items())
        row["converted_diff"] = found.get("model_source", {}).get("converted_diff")
    else:
        lines = [l for l in (done.stdout + done.stderr).splitlines() if l.startswith(("tftrain", "model."))]
        row["outcome"] = "refused" if done.returncode == 2 else "failed"
        row["why"] = lines[-1][:300] if lines else (done.stderr or done.stdout)[-300:]
    path.unlink(missing_ok=True)
    return row


COMPRESS = ["train.epochs=1", "compression.pruning={enabled: true, epochs: 1, final_sparsity: 0.5}",
            "compression.quantization={enabled: true, epochs: 1}", "export.tflite=int8",
            "export.preflight=false", "distribute.strategy=one_device", "precision.policy=float32",
            "train.accumulation_steps=1", "data.name=digits"]


def compress_trial(name: str, source: str, runs: Path, timeout: int,
                   keras3_epochs: int = 0) -> dict:
    """`name` from `source` ("keras3": a saved file; "tf_keras": tftrain's builder)
    through pruning, QAT and int8 (`COMPRESS`), as a row. `keras3_epochs`: the Keras 3
    file is trained that long by Keras 3 first, and tftrain trains it no further
    (`train.epochs: 0`)."""
    size, path = SIZES[0], None
    if source == "keras3" or name not in BUILDS_AT:     # the size it builds at: Keras 3's
        size, path, why = saved(name, runs, keras3_epochs if source == "keras3" else 0)
        if path is None:
            return {"name": name, "source": source, "outcome": "does not build", "why": why}
        BUILDS_AT[name] = size
        if source != "keras3":
            path.unlink()
            path = None
    size = BUILDS_AT[name]              # (InceptionV3 from tf_keras was tried at 32 x 32)
    model = f"model.name=file:{path}" if path else f"model.name=keras_applications:{name}"
    run_name = f"{name}-{source}"
    overrides = [f"run.name={run_name}", model, "model.params={}",
                 f"data.params={{image_size: {size}, channels: 3}}", *COMPRESS,
                 *family_settings(name),
                 *(["train.epochs=0"] if path and keras3_epochs else [])]
    cmd = [sys.executable, "-m", "tftrain.run", "configs/image_transfer.yaml", "--run-dir",
           str(runs), *[a for o in overrides for a in ("--set", o)]]
    epochs = [o.split("=", 1)[1] for o in overrides if o.startswith("train.epochs=")][-1]
    row = {"name": name, "source": source, "size": size, "train_epochs": int(epochs),
           **({"keras3_train_accuracy": TRAINED[path]} if path in TRAINED else {})}
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:        # (the stages it finished, from its run directory)
        stages = runs / run_name / "stages.json"
        done_stages = list(json.loads(stages.read_text())) if stages.exists() else []
        return {**row, "outcome": f"over {timeout} s",
                "why": f"stages finished: {', '.join(done_stages) or 'none'}"}
    summary = runs / run_name / "summary.json"
    # exit 3: the int8 file works but misses its accuracy budget (its check says by how much)
    if done.returncode in (0, 1, 3) and summary.exists():
        row.update(summary_row(json.loads(summary.read_text())))
    else:
        lines = [l for l in (done.stdout + done.stderr).splitlines() if l.startswith(("tftrain", "    "))]
        row.update(outcome="refused" if done.returncode == 2 else "failed",
                   why=" ".join(l.strip() for l in lines[-6:])[:400] if lines
                   else (done.stderr or done.stdout)[-300:])
    if path:
        path.unlink(missing_ok=True)
    return row


def summary_row(found: dict) -> dict:
    """A `compress_trial` row's figures from its run's summary."""
    lite = found["artifacts"].get("tflite_int8", {})
    fast = lite.get("speedup_vs_float") or {}
    return dict(outcome="through" if lite.get("verified") else "int8 file not verified",
                qat=found["stages"].get("qat", {}).get("metrics", {}).get("val_accuracy"),
                int8=lite.get("accuracy"), bytes=lite.get("size_bytes"),
                speedup=fast.get("batch1_threads1"), float_ops=lite.get("float_ops", []),
                check=lite.get("check"), seconds=found.get("seconds"))


def table_row(row: dict) -> str:
    """docs/bring_your_own_model.md's row of a `compress_trial`."""
    if row["outcome"] != "through":
        detail = row.get("why") or row.get("check")
        return f"| {row['name']} | {row['source']} | {row['outcome']}{': ' + detail if detail else ''} |"
    ops = row["float_ops"]
    return (f"| {row['name']} | {row['source']} | {row['qat']:.4f} | {row['int8']:.4f} | "
            f"{row['bytes']:,} B | {row['speedup']:.2f}x | "
            f"{len(ops)}{' (' + ', '.join(sorted({o.split()[0] for o in ops})) + ')' if ops else ''} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=None)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--compress", action="store_true",
                        help="prune, QAT and int8 each model from both sources")
    parser.add_argument("--sources", nargs="+", choices=("keras3", "tf_keras"),
                        default=("keras3", "tf_keras"), help="--compress: where models come from")
    parser.add_argument("--keras3-epochs", type=int, default=0,
                        help="train each Keras 3 file this many epochs by Keras 3 first, "
                             "then run it with train.epochs: 0")
    parser.add_argument("--by-size", action="store_true",
                        help="print the applications in the sweep's order and stop")
    parser.add_argument("--out", type=Path, default=None,
                        help="append each row here; rows already here are not made again")
    args = parser.parse_args()
    if args.by_size:
        print(" ".join(BY_SIZE))
        return
    done = {}
    if args.out and args.out.exists():
        for line in args.out.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[(row["name"], row.get("source"))] = row
    runs = args.runs or Path(tempfile.mkdtemp(prefix="tftrain-applications-"))
    runs.mkdir(parents=True, exist_ok=True)
    for name in args.only or names():
        for source in args.sources if args.compress else (None,):
            row = done.get((name, source))
            if row is None:
                row = (compress_trial(name, source, runs, args.timeout, args.keras3_epochs)
                       if args.compress
                       else trial(name, runs, args.timeout))
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            if args.compress:
                print(table_row(row), flush=True)


if __name__ == "__main__":
    main()
