"""What each compression stage costs and gains, for the digits CNN and a larger model.

For each model, three runs of the same config differ only in the stages they run:
float32 (train only, float TFLite), pruned (train + 80% pruning, float TFLite) and
pruned + prune-preserving QAT (int8 TFLite). Each row gives validation accuracy of the
exported TFLite model, SavedModel and TFLite sizes (raw and gzip) and TFLite latency per
example at 1 thread. The float32 and PQAT runs also write the int8 SavedModel
(`export.saved_model_int8`: post-training weight-only int8 for the float32 model, QAT's
codes and ranges for the PQAT one): its accuracy, variables gzip against the float32
SavedModel's, the zero fraction of its int8 kernels and the batch norms folded. They
also write ONNX (`export.onnx`): the float32 model.onnx against the SavedModel, and the
PQAT model_int8.onnx against the int8 TFLite model, run with ONNX Runtime. The int8 / float latency ratio is measured by timing both models
alternately (ABBA rounds) and taking the median of per-round ratios.

    python benchmarks/compression.py [--rounds 7] [--quick]
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

import tftrain  # noqa: F401
import record
from tftrain.config import load_config
from tftrain.data import load_source
from tftrain.export.artifacts import tflite_logits
from tftrain.run import run
from tftrain.runtime.strategy import configure_devices

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "digits CNN (configs/compress.yaml)": [],
    "ResNet-14, width 32": ["model={name: resnet, params: {depth: 14, width: 32}}",
                            "compression.pruning.epochs=8", "compression.quantization.epochs=3"],
}
STAGES = {
    "float32": ["compression.pruning.enabled=false", "compression.quantization.enabled=false",
                "export.tflite=float", "export.saved_model_int8=true", "export.onnx=true"],
    "pruned 80%": ["compression.quantization.enabled=false", "export.tflite=float"],
    "pruned + PQAT, int8": ["export.saved_model_int8=true", "export.onnx=true"],
}


def one_run(tmp: Path, name: str, sets: list[str]) -> tuple[dict, bytes]:
    cfg = load_config(ROOT / "configs" / "compress.yaml",
                      [f"run.dir={tmp}", f"run.name={name}", "train.verbose=0", *sets])
    summary = run(cfg)
    return summary, (tmp / name / "export" / "model.tflite").read_bytes()


def latency_ratio(slow: bytes, fast: bytes, x: np.ndarray, rounds: int) -> float:
    """Median over ABBA rounds of latency(fast) / latency(slow), 1 thread each."""
    ratios = []
    for r in range(rounds):
        order = [slow, fast] if r % 2 == 0 else [fast, slow]
        times = {id(m): tflite_logits(m, x, threads=1)[1] for m in order}
        ratios.append(times[id(fast)] / times[id(slow)])
    return statistics.median(ratios)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="digits CNN only")
    args = p.parse_args()
    configure_devices(load_config(ROOT / "configs" / "compress.yaml"))   # before any op
    x_val = np.concatenate([x for x, _ in load_source(load_config(None, []).data, 42)
                            .val.batch(512).as_numpy_iterator()])
    report = []
    with tempfile.TemporaryDirectory(prefix="tftrain-bench-") as tmp:
        for model, model_sets in list(MODELS.items())[:1 if args.quick else None]:
            rows, blobs, int8s, onnxs = [], {}, {}, {}
            for i, (stage, stage_sets) in enumerate(STAGES.items()):
                summary, blob = one_run(Path(tmp), f"m{len(report)}s{i}", model_sets + stage_sets)
                blobs[stage] = blob
                if "saved_model_int8" in summary["artifacts"]:
                    int8s[stage] = summary["artifacts"]["saved_model_int8"]
                onnxs.update({(stage, k): v for k, v in summary["artifacts"].items()
                              if k.startswith("onnx")})
                saved = summary["artifacts"]["saved_model"]
                lite_name, lite = next((k, v) for k, v in summary["artifacts"].items()
                                       if k.startswith("tflite"))
                rows.append((stage, lite["accuracy"], saved["size_bytes"], saved["gzip_bytes"],
                             lite_name.split("_")[1], lite["size_bytes"], lite["gzip_bytes"],
                             lite["latency_ms"]))
            baseline_vars = summary["stages"]["train"]["float32_variables_gzip_bytes"]
            ratio = latency_ratio(blobs["float32"], blobs["pruned + PQAT, int8"], x_val, args.rounds)
            report.append((model, rows, ratio, baseline_vars, int8s, onnxs))
    for model, rows, ratio, baseline_vars, int8s, onnxs in report:
        print(f"\n### {model}\n")
        print("| stage | TFLite accuracy | SavedModel | SavedModel gzip | TFLite | TFLite size "
              "| TFLite gzip | latency ms/example (1 thread) |")
        print("|---|---|---|---|---|---|---|---|")
        for stage, acc, sm, smz, kind, size, gz, ms in rows:
            print(f"| {stage} | {acc:.4f} | {sm:,} | {smz:,} | {kind} | {size:,} | {gz:,} | {ms:.3f} |")
        int8 = rows[-1]
        print(f"\nint8 / float TFLite latency (median of {args.rounds} interleaved rounds): "
              f"{ratio:.2f}")
        print(f"accuracy change float32 -> int8: {(int8[1] - rows[0][1]) * 100:+.2f} points; "
              f"float32 SavedModel variables gzip / int8 TFLite gzip: "
              f"{baseline_vars / int8[6]:.1f}x")
        for stage, entry in int8s.items():
            print(f"int8 SavedModel of {stage}: {_int8_figures(entry, baseline_vars)}")
        for (stage, kind), entry in onnxs.items():
            print(f"{kind} of {stage}: {_onnx_figures(entry, rows)}")
    record.rows([(f"compression, {model}: 80% pruning + PQAT; int8 TFLite accuracy vs float32; "
                  "float32 SavedModel variables gzip / int8 TFLite gzip; int8 / float TFLite "
                  "latency per example, 1 thread",
                  f"{rows[-1][1]:.4f} vs {rows[0][1]:.4f} ({(rows[-1][1] - rows[0][1]) * 100:+.2f} "
                  f"pt); {baseline_vars / rows[-1][6]:.1f}×; {ratio:.2f}")
                 for model, rows, ratio, baseline_vars, _, _ in report]
                + [(f"int8 SavedModel, {model}, {stage} ({entry['kernels']}): accuracy (vs "
                    "float32; vs the run's int8 TFLite); float32 SavedModel variables gzip / "
                    "its variables gzip; int8 kernel zeros; batch norms folded",
                    _int8_figures(entry, baseline_vars, rows[0][1],
                                  rows[-1][1] if "PQAT" in stage else None))
                   for model, rows, _, baseline_vars, int8s, _ in report
                   for stage, entry in int8s.items()]
                + [(f"ONNX, {model}, {stage}: " + (
                    "model.onnx (float32, tf2onnx): largest logit difference vs the SavedModel; "
                    "accuracy" if kind == "onnx" else
                    "model_int8.onnx (QDQ from the int8 TFLite model): accuracy vs int8 TFLite; "
                    "largest logit difference vs it; ONNX Runtime int8 kernels")
                    + "; gzip; ONNX Runtime latency ms/example (1 example per call)",
                    _onnx_figures(entry, rows))
                   for model, rows, _, _, _, onnxs in report
                   for (stage, kind), entry in onnxs.items()])
    return 0


def _onnx_figures(entry: dict, rows) -> str:
    if "int8_kernels" not in entry:
        return (f"{entry['max_abs_diff_vs_saved_model']:.1e}; {entry['accuracy']:.4f}; "
                f"{entry['gzip_bytes']:,} B; {entry['latency_ms']:.3f}")
    kernels = ", ".join(f"{n} {k}" for k, n in entry["int8_kernels"].items())
    return (f"{entry['accuracy']:.4f} vs {rows[-1][1]:.4f} ({(entry['accuracy'] - rows[-1][1]) * 100:+.2f}"
            f" pt); {entry['max_abs_diff_vs_tflite_int8']:.1e}; {kernels}; {entry['gzip_bytes']:,} B; "
            f"{entry['latency_ms']:.3f}")


def _int8_figures(entry: dict, baseline_vars: int, float_acc=None, lite_acc=None) -> str:
    versus = [f"{(entry['accuracy'] - a) * 100:+.2f} pt vs {name}"
              for name, a in (("float32", float_acc), ("int8 TFLite", lite_acc)) if a is not None]
    return (f"{entry['accuracy']:.4f}" + (f" ({'; '.join(versus)})" if versus else "")
            + f"; {baseline_vars / entry['variables_gzip_bytes']:.1f}× "
            f"({entry['variables_gzip_bytes']:,} B); zeros {entry['int8_zero_fraction']:.3f}; "
            f"{entry['folded_batch_norms']} folded")


if __name__ == "__main__":
    sys.exit(main())
