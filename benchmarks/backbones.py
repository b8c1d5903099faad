"""The mobile backbones people deploy, through compression: MobileNetV3 (Small, Large,
Large minimalistic), EfficientNetB0 and EfficientNetV2B0, each built by tf_keras
(`model.name: keras_applications:NAME`) and from a Keras 3 `.keras` file of
`keras.applications.NAME` (`model.name: file:...`), trained on digits upscaled to
32 x 32 x 3 (`configs/image_transfer.yaml` on one device in float32, no pretrained
weights), then pruned to 50%, trained with prune-preserving QAT and exported as an int8
TFLite file (`--ptq`: trained, then post-training int8, no pruning or QAT). Reports, per
run: the float model's, the QAT model's and the int8 file's accuracy, the file's bytes,
its latency at batch 1 and 32 on 1 thread against the float TFLite file of the same
model (interleaved rounds, medians; the run's own report), the ops XNNPack leaves to the
CPU, and the CPU's int8 instructions (int8 outruns float only with a dot product).

    python benchmarks/backbones.py [--backbones MobileNetV3Small ...] [--sources tf_keras keras3] [--ptq]
    python benchmarks/backbones.py --runs DIR --reuse     # report runs already in DIR
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import record

ROOT = Path(__file__).resolve().parents[1]
BACKBONES = {"MobileNetV3Small": {}, "MobileNetV3Large": {},
             "MobileNetV3LargeMinimalistic": {"minimalistic": True},
             "EfficientNetB0": {}, "EfficientNetV2B0": {}}
SHORT = ("train.epochs=6", "compression.pruning.epochs=3", "compression.quantization.epochs=2")


def keras3_file(name: str, out: Path) -> Path:
    """`keras.applications.NAME` with a 10-class head, saved by Keras 3 (its input in
    [0, 1] scaled to the [0, 255] the backbone's own preprocessing expects)."""
    path = out / f"{name}.keras"
    if path.exists():
        return path
    code = f"""
import keras
args = {BACKBONES[name]!r}
fn = getattr(keras.applications, {name!r}.replace("Minimalistic", ""))
inputs = keras.Input((32, 32, 3))
x = keras.layers.Rescaling(255.0)(inputs)
backbone = fn(include_top=False, weights=None, input_tensor=x, pooling="avg", **args)
y = keras.layers.Dropout(0.2)(backbone.output)
keras.Model(inputs, keras.layers.Dense(10, name="logits")(y)).save({str(path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    return path


def run(name: str, source: str, ptq: bool, runs: Path, reuse: bool = False) -> dict:
    label = f"{name}-{source}{'-ptq' if ptq else ''}"
    if reuse and (runs / label / "summary.json").exists():
        return figures(label, json.loads((runs / label / "summary.json").read_text()))
    if source == "keras3":
        model = [f"model.name=file:{keras3_file(name, runs)}", "model.params={}"]
    else:
        params = {"weights": None, "dropout": 0.2, **BACKBONES[name]}
        model = [f"model.name=keras_applications:{name.replace('Minimalistic', '')}",
                 "model.params=" + json.dumps(params).replace("null", "null")]
    compression = (["compression.pruning.enabled=false", "compression.quantization.enabled=false"]
                   if ptq else [])
    overrides = [f"run.name={label}", "precision.policy=float32", "distribute.strategy=one_device",
                 "train.accumulation_steps=1", *SHORT, *model, *compression]
    cmd = [sys.executable, "-m", "tftrain.run", "configs/image_transfer.yaml", "--run-dir",
           str(runs), *[a for o in overrides for a in ("--set", o)]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return {"label": label, "exit": done.returncode, "error": done.stdout[-600:] + done.stderr[-600:]}
    return figures(label, json.loads((runs / label / "summary.json").read_text()))


def figures(label: str, summary: dict) -> dict:
    """A run's row: accuracies, the int8 file's bytes, its speed against the float file,
    the ops XNNPack leaves and the float ops."""
    stages, lite = summary["stages"], summary["artifacts"]["tflite_int8"]
    return {"label": label, "exit": 0,
            "float": stages["train"]["metrics"]["val_accuracy"],
            "qat": stages.get("qat", {}).get("metrics", {}).get("val_accuracy"),
            "int8": lite["accuracy"], "bytes": lite["size_bytes"],
            "speedup_b1": lite.get("speedup_vs_float", {}).get("batch1_threads1"),
            "speedup_b32": lite.get("speedup_vs_float", {}).get("batch32_threads1"),
            "not_xnnpack": len(lite.get("xnnpack", {}).get("fallback", [])),
            "float_ops": len(lite.get("float_ops", [])), "cpu_int8": lite.get("cpu_int8")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbones", nargs="+", default=list(BACKBONES), choices=list(BACKBONES))
    parser.add_argument("--sources", nargs="+", default=["tf_keras", "keras3"],
                        choices=["tf_keras", "keras3"])
    parser.add_argument("--ptq", action="store_true", help="post-training int8, no pruning or QAT")
    parser.add_argument("--runs", type=Path, default=None, help="keep the runs here")
    parser.add_argument("--reuse", action="store_true",
                        help="report a run already in --runs instead of running it again")
    args = parser.parse_args()
    runs = args.runs or Path(tempfile.mkdtemp(prefix="tftrain-backbones-"))
    runs.mkdir(parents=True, exist_ok=True)
    figures = []
    for name in args.backbones:
        for source in args.sources:
            found = run(name, source, args.ptq, runs, args.reuse)
            print(json.dumps(found), flush=True)
            if found["exit"]:
                figures.append((f"{found['label']}", f"exit {found['exit']}"))
                continue
            qat = f", QAT {found['qat']:.4f}" if found["qat"] is not None else ""
            figures.append((f"{found['label']}: accuracy float / int8 file, bytes, int8 vs float "
                            "TFLite at batch 1 / 32 on 1 thread, ops XNNPack leaves",
                            f"{found['float']:.4f}{qat} / {found['int8']:.4f}, {found['bytes']:,} B, "
                            f"{found['speedup_b1']:.2f}x / {found['speedup_b32']:.2f}x, "
                            f"{found['not_xnnpack']} ({record.cpu_features()})"))
    record.rows(figures)


if __name__ == "__main__":
    main()
