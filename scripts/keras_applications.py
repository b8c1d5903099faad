"""Every Keras 3 Application brought in as a file: each `keras.applications` model that
builds at 32 x 32 x 3 (75 x 75 for those that need more) is saved untrained by Keras 3 as
`.keras` with a 10-class head, then run as `model.name: file:...` with `train.epochs: 0`
(digits upscaled to that size, one device, float32, SavedModel and float TFLite), and its
outcome printed as a row of docs/bring_your_own_model.md's table: converted and every
file verified, or refused (exit 2) with the reason, or failed (exit 1) with the error.
Slow (minutes a model), so a script, not a test.

    python scripts/keras_applications.py [--only MobileNetV3Small ConvNeXtTiny] [--runs DIR]
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


def names() -> list[str]:
    import keras
    return sorted(n for n in dir(keras.applications) if n[:1].isupper())


def save(name: str, size: int, out: Path) -> Path:
    path = out / f"{name}.keras"
    code = f"""
import keras
inputs = keras.Input(({size}, {size}, 3))
backbone = getattr(keras.applications, {name!r})(include_top=False, weights=None,
                                                 input_tensor=inputs, pooling="avg")
keras.Model(inputs, keras.layers.Dense(10, name="logits")(backbone.output)).save({str(path)!r})
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return path


def trial(name: str, runs: Path, timeout: int) -> dict:
    for size in SIZES:
        try:
            path = save(name, size, runs)
            break
        except subprocess.CalledProcessError as err:
            why = err.stderr.decode().strip().splitlines()[-1][-300:]
    else:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=None)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--timeout", type=int, default=1800)
    args = parser.parse_args()
    runs = args.runs or Path(tempfile.mkdtemp(prefix="tftrain-applications-"))
    runs.mkdir(parents=True, exist_ok=True)
    for name in args.only or names():
        print(json.dumps(trial(name, runs, args.timeout)), flush=True)


if __name__ == "__main__":
    main()
