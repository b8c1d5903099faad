"""Deployment: are compressed models smaller and faster where they run?

For ResNet-14 (width 32) and Keras Applications MobileNetV2 (alpha 0.35), both on digits
at 32x32x3 (the image-transfer recipe, configs/image_transfer.yaml, in float32: this
benchmark is about the deployed files, and bfloat16 trains slower on CPUs without BF16
instructions), four runs differ only in their stages: dense (train), dense + QAT (int8),
channels (train + channel pruning to `--target-flops` of the FLOPs, fine-tuned as many
epochs as training at a constant 0.001, or with `--distill` on training's schedule learning
the dense model's logits too) and channels + QAT (int8; channel pruning to
`--combined-target-flops`, by default 0.25 for ResNet and 0.5 for the thinner MobileNetV2:
int8 adds little speed without VNNI).
Each exports its TFLite file and its ONNX model. Accuracies are the exported files' own, on
the validation split.

Latencies are measured after a model's four runs, every file of it in interleaved rounds
(the order rotating each round), with each ratio the median of its per-round ratios:
channels / dense float TFLite at batch 1, 1 thread (and its bytes); int8 / float TFLite
and int8 / float ONNX at batch 32, 1 thread; channels + QAT int8 / dense float TFLite at
batch 1, 1 thread. The CPU's int8 and bfloat16 instructions are printed beside them.

    python benchmarks/deploy.py [--rounds 7] [--target-flops 0.5] [--combined-target-flops F]
                                [--models resnet mobilenet] [--epochs-scale 1.0] [--distill]
                                [--keep DIR]

Each model's rows are printed (and recorded) as soon as its files are measured. A run
whose export verification fails is measured all the same, and its row says so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

import record

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "image_transfer.yaml"
# label, settings, and the channel target before QAT of the channels + QAT run: MobileNetV2
# alpha 0.35 is thin already, and pruned to 0.24 of its FLOPs it lost 7.8 pt after QAT
MODELS = {
    "resnet": ("ResNet-14, width 32", ["model={name: resnet, params: {depth: 14, width: 32}}",
                                       "train.epochs=6", "compression.quantization.epochs=2"],
               0.25),
    "mobilenet": ("MobileNetV2, alpha 0.35", [], 0.5),   # the recipe's model and epochs
}


def variants(target: float, combined: float, distill: bool = False) -> dict[str, list[str]]:
    """The four runs' stage settings. Channel pruning to `target` of the FLOPs (`combined`
    before QAT) fine-tunes at a constant 0.001, or with `distill` on training's schedule
    learning the dense model's logits too; its epochs are filled in by `one_run`."""
    retrain = "distill: true" if distill else "learning_rate: 0.001"
    channels = ("compression.pruning={enabled: true, structure: channels, "
                "target_flops: {target}, epochs: EPOCHS, " + retrain + "}")
    return {
        "dense": ["compression.pruning.enabled=false", "compression.quantization.enabled=false",
                  "export.tflite=float"],
        "dense_int8": ["compression.pruning.enabled=false", "export.tflite=int8"],
        "channels": [channels.replace("{target}", str(target)),
                     "compression.quantization.enabled=false", "export.tflite=float"],
        "channels_int8": [channels.replace("{target}", str(combined)), "export.tflite=int8"],
    }


def one_run(runs: Path, name: str, sets: list[str], scale: float = 1.0) -> dict:
    from tftrain.config import load_config
    from tftrain.run import ExportFailed, run

    base = load_config(RECIPE, [s for s in sets if "compression.pruning={" not in s])
    # channel pruning fine-tunes as many epochs as training (the same budget, then as long
    # again): at the recipe's 6 of MobileNetV2's 12 it lost 8.2 pt, at 12 it gained 2.6
    epochs = {"train.epochs": base.train.epochs,
              "compression.quantization.epochs": base.compression.quantization.epochs}
    sets = [s.replace("EPOCHS", str(max(1, round(base.train.epochs * scale)))) for s in sets]
    sets += [f"{k}={max(1, round(v * scale))}" for k, v in epochs.items()]
    cfg = load_config(RECIPE, [f"run.dir={runs}", f"run.name={name}", "train.verbose=0",
                               "precision.policy=float32", "train.jit_compile=false",
                               "export.preflight=false", "export.saved_model=false",
                               "export.onnx=true", *sets])
    try:
        summary = run(cfg)
    except ExportFailed as err:               # measured all the same, and said so
        summary = {**err.summary, "failed": "export verification failed: " + "; ".join(err.failed)}
    export = runs / name / "export"
    files = {"tflite": (export / "model.tflite").read_bytes()}
    for filename, kind in (("model.onnx", "onnx"), ("model_int8.onnx", "onnx")):
        if (export / filename).exists():
            files[kind] = (export / filename).read_bytes()
    return {"summary": summary, "files": files}


def accuracy(result: dict, artifact: str) -> float:
    return result["summary"]["artifacts"][artifact]["accuracy"]


def interleaved(runners: dict, x: np.ndarray, batch: int, rounds: int) -> dict[str, list[float]]:
    """ms per example of each runner, one figure per round, the order rotating."""
    from tftrain.export import speed

    names, times = list(runners), {n: [] for n in runners}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(speed.timed(runners[name], x, batch, budget=0.3))
    return times


def ratio(times: dict, slow: str, fast: str) -> float:
    """Median over rounds of slow / fast (above 1: `fast` is faster)."""
    return statistics.median(a / b for a, b in zip(times[slow], times[fast]))


def measure(label: str, results: dict, x: np.ndarray, rounds: int) -> list[tuple[str, str]]:
    from tftrain.export import speed

    dense, dense8 = results["dense"], results["dense_int8"]
    narrow, narrow8 = results["channels"], results["channels_int8"]
    b1 = interleaved({"dense": speed.tflite_runner(dense["files"]["tflite"], 1, 1, x),
                      "channels": speed.tflite_runner(narrow["files"]["tflite"], 1, 1, x),
                      "channels_int8": speed.tflite_runner(narrow8["files"]["tflite"], 1, 1, x)},
                     x, 1, rounds)
    b32 = interleaved({"tflite": speed.tflite_runner(dense["files"]["tflite"], 32, 1, x),
                       "tflite_int8": speed.tflite_runner(dense8["files"]["tflite"], 32, 1, x),
                       "onnx": speed.onnx_runner(dense["files"]["onnx"], 32, 1, x, False),
                       "onnx_int8": speed.onnx_runner(dense8["files"]["onnx"], 32, 1, x, True)},
                      x, 32, rounds)
    flops = narrow["summary"]["stages"]["channels"]["channels"]["flops_ratio"]
    flops8 = narrow8["summary"]["stages"]["channels"]["channels"]["flops_ratio"]
    acc = {k: accuracy(results[k], a) for k, a in (
        ("dense", "tflite_float"), ("channels", "tflite_float"),
        ("dense_int8", "tflite_int8"), ("channels_int8", "tflite_int8"))}
    onnx8 = accuracy(dense8, "onnx_int8")
    layout = dense8["summary"]["artifacts"]["onnx_int8"].get("layout", "?")
    islands = len(dense8["summary"]["artifacts"]["onnx_int8"].get("float_ops", []))
    xnn = dense8["summary"]["artifacts"]["tflite_int8"].get("xnnpack", {})
    cpu = f"{record.cpu_features()}; int8: {speed.cpu_int8()}"
    failed = {k: f"; {k}: {r['summary']['failed']}" if "failed" in r["summary"] else ""
              for k, r in results.items()}
    lite_ratio, onnx_ratio = ratio(b32, 'tflite', 'tflite_int8'), ratio(b32, 'onnx', 'onnx_int8')
    why = speed.int8_reason() if min(lite_ratio, onnx_ratio) < 1 else ""
    size = len(narrow["files"]["tflite"]) / len(dense["files"]["tflite"])
    med = {k: statistics.median(v) for k, v in {**b1, **{f"{k}@32": v for k, v in b32.items()}}.items()}
    return [
        (f"deploy, {label}, digits 32x32x3: channel pruning to {flops:.2f} of the FLOPs: "
         "validation accuracy dense / channels (float TFLite); float TFLite bytes channels / "
         "dense; LiteRT latency dense / channels, batch 1, 1 thread",
         f"{acc['dense']:.4f} / {acc['channels']:.4f} ({100 * (acc['channels'] - acc['dense']):+.2f} pt); "
         f"{size:.2f} ({len(narrow['files']['tflite']):,} vs {len(dense['files']['tflite']):,} B); "
         f"{ratio(b1, 'dense', 'channels'):.2f}x ({med['dense']:.3f} vs {med['channels']:.3f} ms; "
         f"{rounds} rounds; {cpu})" + failed["channels"]),
        (f"deploy, {label}: int8 vs float at batch 32, 1 thread: LiteRT float / int8 TFLite "
         "latency (XNNPack ops falling back); ONNX Runtime float / int8 ONNX latency (layout, "
         "float ops left between the int8 kernels); "
         "accuracy int8 TFLite / int8 ONNX / float",
         f"{lite_ratio:.2f}x ({med['tflite@32']:.4f} vs "
         f"{med['tflite_int8@32']:.4f} ms/example; {len(xnn.get('fallback', [])) or 'none'} "
         f"falling back); {onnx_ratio:.2f}x ({med['onnx@32']:.4f} vs "
         f"{med['onnx_int8@32']:.4f} ms/example; {layout}, {islands} float ops); "
         f"{acc['dense_int8']:.4f} / "
         f"{onnx8:.4f} / {acc['dense']:.4f} ({cpu})" + (f"; int8 loses here: {why}" if why else "")
         + failed["dense_int8"]),
        (f"deploy, {label}: channels to {flops8:.2f} of the FLOPs + QAT, int8 TFLite: "
         "accuracy vs dense float; LiteRT "
         "latency dense float / channels int8, batch 1, 1 thread",
         f"{acc['channels_int8']:.4f} vs {acc['dense']:.4f} "
         f"({100 * (acc['channels_int8'] - acc['dense']):+.2f} pt); "
         f"{ratio(b1, 'dense', 'channels_int8'):.2f}x ({med['dense']:.3f} vs "
         f"{med['channels_int8']:.3f} ms; {cpu})" + failed["channels_int8"]),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--target-flops", type=float, default=0.5)
    parser.add_argument("--combined-target-flops", type=float, default=None,
                        help="channel pruning's target before QAT in the channels + QAT run "
                             "(default: 0.25 for resnet, 0.5 for mobilenet)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs in this directory (default: a temporary one)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--epochs-scale", type=float, default=1.0,
                        help="every stage's epochs times this (a quick look; not the figures)")
    parser.add_argument("--distill", action="store_true",
                        help="channel pruning with distill: true on training's schedule")
    args = parser.parse_args(argv)
    from tftrain.config import load_config
    from tftrain.data import BatchPlan, load_source, val_dataset
    from tftrain.runtime.strategy import configure_devices

    base = load_config(RECIPE, [])
    configure_devices(base)                      # before any op: 2 logical CPUs
    source = load_source(base.data, base.run.seed)
    x = np.concatenate([b for b, _ in val_dataset(source, BatchPlan(256, 1, 1), base.data)
                        .as_numpy_iterator()])[:64]
    raw = {}
    with tempfile.TemporaryDirectory(prefix="tftrain-deploy-") as tmp:
        runs = args.keep or Path(tmp)
        for key in args.models:
            label, model_sets, combined = MODELS[key]
            combined = args.combined_target_flops or combined
            results = {name: one_run(runs, f"{key}-{name}", [*model_sets, *sets],
                                     args.epochs_scale)
                       for name, sets in variants(args.target_flops, combined,
                                                  args.distill).items()}
            raw[key] = {k: v["summary"] for k, v in results.items()}
            if args.json:
                args.json.write_text(json.dumps(raw, indent=1, default=str) + "\n")
            record.rows(measure(label + (", channels distilled" if args.distill else ""),
                                results, x, args.rounds))


if __name__ == "__main__":
    main()
