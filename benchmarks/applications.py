"""The application recipes against baselines nobody here wrote, on the same split in
the same run: spoken digits (held-out voices) vs MFCC statistics + logistic regression
(the recipe and the microcontroller-sized keyword model, `configs/keywords_micro.yaml`),
fortunes by category vs TF-IDF + logistic regression (scikit-learn; C chosen by
cross-validation on the training split; of words, and of words and character 2- to 5-grams
within words, as the recipe's `tfidf_linear` has them; with `--seeds`, over several seeded splits), MobileNetV2 on upscaled digits with and
without batch-norm recalibration, and the token transformer with QAT. Each recipe runs as
`python -m tftrain.run` (its data is made first when missing); the table reports the
baseline, the float model (end of training), each stage, the int8 TFLite file (its label,
its share of int8 weight bytes, its gap to the QAT model), sizes (its constants split
into the float front end and the network), its tensor arena estimate, and its latency
against the float file's at batch 1 on 1 thread (with the CPU's int8 instructions).

    python benchmarks/applications.py [--recipes speech micro text image transformer]
                                      [--seeds 42 43 44]
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
import record

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"speech": "configs/speech_digits.yaml", "micro": "configs/keywords_micro.yaml",
           "text": "configs/text_classification.yaml",
           "image": "configs/image_transfer.yaml", "transformer": "configs/transformer_tokens.yaml"}
# settings a recipe runs with here beyond its file
SETTINGS = {"transformer": ("compression.quantization.enabled=true", "export.tflite=int8")}
DATA = {"speech": ("scripts/make_speech_digits.py", "data/speech_digits"),
        "micro": ("scripts/make_speech_digits.py", "data/speech_digits"),
        "text": ("scripts/make_fortunes_text.py", "data/fortunes")}


def ensure_data(recipe: str) -> None:
    if recipe in DATA:
        script, out = DATA[recipe]
        if not (ROOT / out).exists():
            subprocess.run([sys.executable, str(ROOT / script), "--out", str(ROOT / out)], check=True)


def train(recipe: str, runs: Path, *overrides: str) -> dict:
    name = recipe + "".join("-" + o.replace("=", "").split(".")[-1] for o in overrides)
    overrides = (*SETTINGS.get(recipe, ()), *overrides)
    cmd = [sys.executable, "-m", "tftrain.run", str(ROOT / RECIPES[recipe]), "--run-dir", str(runs),
           "--set", f"run.name={name}", *[a for o in overrides for a in ("--set", o)]]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    summary = json.loads((runs / name / "summary.json").read_text())
    tflite = runs / name / "export" / "model.tflite"
    if tflite.exists():
        from tftrain.export.artifacts import tflite_weights
        weights = tflite_weights(tflite.read_bytes(), min_size=1).values()
        summary["int8_weight_share"] = (sum(w.nbytes for w in weights if w.dtype == np.int8)
                                        / max(1, sum(w.nbytes for w in weights)))
    return summary


def _config(recipe: str):
    from tftrain.config import load_config
    return load_config(ROOT / RECIPES[recipe], [])


@functools.lru_cache(maxsize=None)
def speech_baseline() -> float:
    """MFCC statistics (mean and std of 13 MFCCs and their deltas over 25 ms frames every
    10 ms) + standardisation + logistic regression, on the recipe's split."""
    import tensorflow as tf
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from tftrain.data import load_source
    cfg = _config("speech")
    source = load_source(cfg.data, cfg.run.seed)
    rate = source.spec.sample_rate

    def stats(x):
        stft = tf.signal.stft(x, int(0.025 * rate), int(0.010 * rate), 512)
        mel = tf.signal.linear_to_mel_weight_matrix(40, 257, rate, 20.0, rate / 2)
        logmel = tf.math.log(tf.tensordot(tf.abs(stft) ** 2, mel, 1) + 1e-6)
        mfcc = tf.signal.mfccs_from_log_mel_spectrograms(logmel)[..., :13]
        delta = mfcc[:, 1:] - mfcc[:, :-1]
        return tf.concat([tf.reduce_mean(mfcc, 1), tf.math.reduce_std(mfcc, 1),
                          tf.reduce_mean(delta, 1), tf.math.reduce_std(delta, 1)], -1).numpy()

    train = tf.data.Dataset.range(source.num_train).map(lambda i: source.load(tf.cast(i, tf.int32)))
    x, y = zip(*[(stats(a), b.numpy()) for a, b in train.batch(256)])
    xv, yv = zip(*[(stats(a), b.numpy()) for a, b in source.validation().batch(256)])
    model = make_pipeline(StandardScaler(), LogisticRegressionCV(max_iter=5000))
    model.fit(np.concatenate(x), np.concatenate(y))
    return float(np.mean(model.predict(np.concatenate(xv)) == np.concatenate(yv)))


def text_baselines(seed: int) -> dict:
    """Sublinear TF-IDF + logistic regression on the recipe's split for `seed`: of words
    (`words`), and of words and character 2- to 5-grams within word boundaries
    (`words_chars`, uncapped: the features the recipe's `tfidf_linear` has)."""
    from scipy.sparse import hstack
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegressionCV

    from tftrain.data.text import split
    cfg = _config("text")
    (train, y), (val, yv), _ = split(ROOT / cfg.data.params["path"], cfg.data.validation_fraction,
                                     seed)
    out = {}
    words = TfidfVectorizer(sublinear_tf=True)
    chars = TfidfVectorizer(sublinear_tf=True, analyzer="char_wb", ngram_range=(2, 5))
    for name, vectorizers in (("words", [words]), ("words_chars", [words, chars])):
        x = hstack([v.fit_transform(train) for v in vectorizers]).tocsr()
        xv = hstack([v.transform(val) for v in vectorizers]).tocsr()
        model = LogisticRegressionCV(max_iter=5000).fit(x, y)
        out[name] = float(np.mean(model.predict(xv) == yv))
    return out


def row(name: str, summary: dict, baseline) -> dict:
    stages = summary["stages"]
    first = stages.get("train", next(iter(stages.values())))
    int8 = summary["artifacts"].get("tflite_int8", {})
    return {"recipe": name, "baseline": baseline,
            "float": first["metrics"]["val_accuracy"],
            "stages": {k: v["metrics"]["val_accuracy"] for k, v in stages.items()},
            "int8_tflite": int8.get("accuracy"),
            "float32_variables_gzip": first.get("float32_variables_gzip_bytes"),
            "int8_tflite_gzip": int8.get("gzip_bytes"), "int8_tflite_bytes": int8.get("size_bytes"),
            "latency_ms": int8.get("latency_ms"), "label": int8.get("label"),
            "int8_weight_share": summary.get("int8_weight_share"),
            "weight_bytes": int8.get("weight_bytes"), "arena_bytes": int8.get("arena_bytes"),
            "speedup_b1": int8.get("speedup_vs_float", {}).get("batch1_threads1"),
            "cpu_int8": int8.get("cpu_int8"),
            "worst_layers": int8.get("worst_layers", [])[:3],
            "inputs": {k: v.get("input") for k, v in summary["artifacts"].items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="text: run the recipe and its baselines on the split of each of "
                             "these seeds (run.seed) and report the spread of the differences")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import tftrain  # noqa: F401
    rows = []
    with tempfile.TemporaryDirectory(prefix="tftrain-apps-") as tmp:
        runs = Path(tmp)
        for recipe in args.recipes:
            ensure_data(recipe)
            summary = None if recipe == "text" and args.seeds else train(recipe, runs)
            if recipe == "speech":
                rows.append(row("speech digits (held-out voices)", summary, speech_baseline()))
            elif recipe == "micro":     # the same split (data, fraction and seed)
                rows.append(row("keywords micro (held-out voices)", summary, speech_baseline()))
            elif recipe == "text":
                seeds = args.seeds or [_config("text").run.seed]
                for seed in seeds:
                    run = summary or train(recipe, runs, f"run.seed={seed}")
                    base = text_baselines(seed)
                    rows.append(row(f"fortunes by category, seed {seed}", run, base["words"]))
                    rows[-1]["baseline_words_chars"] = base["words_chars"]
            elif recipe == "transformer":
                rows.append(row("token transformer, QAT", summary, None))
            else:
                rows.append(row("MobileNetV2, recalibrated", summary, None))
                off = train(recipe, runs, "train.recalibrate_batch_norm=off")
                rows.append(row("MobileNetV2, not recalibrated", off, None))
    print("| recipe | baseline | tftrain float | stages | int8 TFLite | float32 vars gzip | "
          "int8 TFLite (gzip) | int8 latency |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = "-" if r["baseline"] is None else f"{r['baseline']:.4f}"
        stages = ", ".join(f"{k} {v:.4f}" for k, v in r["stages"].items())
        print(f"| {r['recipe']} | {base} | {r['float']:.4f} | {stages} | {r['int8_tflite']:.4f} | "
              f"{r['float32_variables_gzip']:,} B | {r['int8_tflite_bytes']:,} B "
              f"({r['int8_tflite_gzip']:,} B) | {r['latency_ms']:.2f} ms |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    record.rows([*text_spread(rows), *[(f"application: {r['recipe']}: baseline / tftrain float / each stage / int8 "
                  "TFLite validation accuracy (its gap to the last stage); int8 TFLite bytes "
                  "(gzip), its label, share of weight bytes int8; noisiest layers",
                  f"{'-' if r['baseline'] is None else format(r['baseline'], '.4f')} / "
                  f"{r['float']:.4f} / "
                  + " / ".join(f"{k} {v:.4f}" for k, v in r["stages"].items())
                  + f" / {r['int8_tflite']:.4f} ({gap(r)}); {r['int8_tflite_bytes']:,} B "
                  f"({r['int8_tflite_gzip']:,} B), {r['label']}, "
                  f"{r['int8_weight_share']:.4f} int8; {', '.join(r['worst_layers']) or '-'}"
                  + file_needs(r) + words_chars(r)) for r in rows]])


def words_chars(r: dict) -> str:
    return (f"; TF-IDF of words and character 2-5-grams + LR {r['baseline_words_chars']:.4f}"
            if r.get("baseline_words_chars") is not None else "")


def text_spread(rows: list[dict]) -> list[tuple[str, str]]:
    """One row over the text recipe's seeds: float and int8 minus each baseline, per seed."""
    text = [r for r in rows if r["recipe"].startswith("fortunes") and "seed" in r["recipe"]]
    if len(text) < 2:
        return []

    def spread(key: str, base: str) -> str:
        d = [100 * (r[key] - r[base]) for r in text]
        return f"{np.median(d):+.2f} pt (seeds {', '.join(f'{x:+.2f}' for x in d)})"
    seeds = ", ".join(r["recipe"].rsplit(" ", 1)[-1] for r in text)
    return [(f"application: fortunes by category over seeded splits ({seeds}): tftrain float / "
             "int8 TFLite minus TF-IDF of words + LR; minus TF-IDF of words and character "
             "2-5-grams + LR (median, each seed)",
             f"float {spread('float', 'baseline')}, int8 {spread('int8_tflite', 'baseline')}; "
             f"float {spread('float', 'baseline_words_chars')}, int8 "
             f"{spread('int8_tflite', 'baseline_words_chars')}")]


def file_needs(r: dict) -> str:
    """The int8 file's constants (front end, network), arena estimate and speed."""
    if not r.get("weight_bytes"):
        return ""
    w = r["weight_bytes"]
    return (f"; constants {w['front_end']:,} B front end + {w['network']:,} B network, "
            f"tensor arena estimate {r['arena_bytes']:,} B"
            + (f"; int8 / float speed at batch 1, 1 thread {r['speedup_b1']:.2f}x "
               f"(CPU int8: {r['cpu_int8']})" if r.get("speedup_b1") else ""))


def gap(r: dict) -> str:
    """The int8 file's accuracy against the last stage's (the model it was converted from),
    in points; float and int8 against float when there is no later stage."""
    last = list(r["stages"].values())[-1]
    return f"{100 * (r['int8_tflite'] - last):+.2f} pt vs {list(r['stages'])[-1]}, " \
           f"{100 * (r['int8_tflite'] - r['float']):+.2f} pt vs float"


if __name__ == "__main__":
    main()
