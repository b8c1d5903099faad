"""Int8 fallback on the image recipe (Keras Applications MobileNetV2, alpha 0.35, on
digits at 32x32): the recipe's run with one layer's kernel scales multiplied by `--factor`
in its int8 TFLite file (a converter that got that layer wrong), once with
`export.int8_fallback: off` and once with `auto`. Reports the layer the fidelity report
names worst, the int8 file's accuracy against the QAT model's, and which layers the
fallback kept float and what that cost.

    python benchmarks/fallback.py [--layer quant_block_6_project] [--factor 8] [--epochs-scale 0.5]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import record

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
ROOT = Path(__file__).resolve().parents[1]


def run_recipe(runs: Path, name: str, setting: str, layer: str, factor: float, scale: float):
    from tftrain.config import load_config
    from tftrain.export import artifacts, fallback
    from tftrain.run import run

    base = load_config(ROOT / "configs" / "image_transfer.yaml", [])
    epochs = {"train.epochs": base.train.epochs,
              "compression.pruning.epochs": base.compression.pruning.epochs,
              "compression.quantization.epochs": base.compression.quantization.epochs}
    sets = [f"{k}={max(1, round(v * scale))}" for k, v in epochs.items()]
    cfg = load_config(ROOT / "configs" / "image_transfer.yaml", [
        f"run.dir={runs}", f"run.name={name}", "train.verbose=0", "export.preflight=false",
        f"export.int8_fallback={setting}", *sets])
    convert = artifacts.convert_tflite
    artifacts.convert_tflite = lambda *a, **k: fallback.with_kernel_scales(convert(*a, **k),
                                                                            layer, factor)
    try:
        return run(cfg)
    finally:
        artifacts.convert_tflite = convert


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", default="quant_block_6_project")
    parser.add_argument("--factor", type=float, default=8.0)
    parser.add_argument("--epochs-scale", type=float, default=0.5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tftrain-fallback-") as tmp:
        found = {}
        for setting in ("off", "auto"):
            try:
                summary = run_recipe(Path(tmp), f"fallback-{setting}", setting, args.layer,
                                     args.factor, args.epochs_scale)
            except RuntimeError:          # "off": the export check fails; its summary stays
                import json
                summary = json.loads((Path(tmp) / f"fallback-{setting}" / "summary.json")
                                     .read_text())
            found[setting] = summary
    qat = found["off"]["stages"]["qat"]["metrics"]["val_accuracy"]
    off, auto = found["off"]["artifacts"]["tflite_int8"], found["auto"]["artifacts"]["tflite_int8"]
    fell = auto.get("fallback", {})
    record.rows([
        (f"int8 fallback, MobileNetV2 a0.35 digits 32x32, {args.layer} kernel scales x{args.factor:g}: "
         "worst layer named / QAT accuracy / int8 off / int8 auto / layers fallen back / "
         "size and latency before -> after",
         f"{off['worst_layers'][0]} / {qat:.4f} / {off['accuracy']:.4f} / {auto['accuracy']:.4f} / "
         f"{', '.join(fell.get('layers', [])) or 'none'} / "
         f"{fell.get('size_bytes_before', off['size_bytes'])} -> {auto['size_bytes']} B, "
         f"{fell.get('latency_ms_before', off['latency_ms']):.3f} -> {auto['latency_ms']:.3f} ms "
         f"({record.cpu_features()})")])


if __name__ == "__main__":
    main()
