"""The pairwise feature matrix: every pair of values of ten feature dimensions in at
least one config, each run with `--smoke` (a few updates per stage) with the strategy it
names. Its rows are part of the default run (`python -m pytest -m matrix` runs them
alone). Each either completes with every exported artifact verified, or is refused with
exit 2 before anything is written, with a line naming what cannot go together. Nothing
may fail after training has begun.

Some values cannot meet: token ids take no float augmentation (`normalize`, a crop,
`mixup`), a quantization-aware trained model exports as int8 only (no dynamic-range
or float16 TFLite), an embedding bag has no channels channel pruning could remove
(its table's width reaches the output through a mean), a speech model's audio feature
layer cannot be quantized after training (post-training int8 or dynamic-range TFLite;
QAT keeps it float), and no bundled model follows XNNPack's sparse-inference rules
(`export.tflite_sparse`: a 3x3 stride-2 first convolution padded equally on an odd input,
and so on). The covering array is built over the combinations that can run, and the pairs
that cannot are rows of their own (`REFUSED`) that must be refused at plan time. For
waveforms the crop of `normalize+crop` is `time_shift` (a random crop in time).

Each row runs what it names: a `mirrored` row on this worker's 2 virtual CPUs (2
replicas); a `multi_worker` row through `python -m tftrain.launch`, every other one as 2
worker processes of 1 replica each, the rest as a 1-worker cluster of 2 replicas;
`summary.json` must say so. And each row's first stage is held against a reference: the
same row on one device, accumulating its replicas' micro-batches (the same examples in
the same micro-batches, so the same batch-norm statistics and mixup pairs), without the
later stages and exports. Their training losses (the running mean Keras logs, after
each of the first updates: `updates.csv`) agree within a tolerance set by the compute
precision's rounding (`LOSS_RTOL`); a strategy that scales, reduces or batches the
gradients wrongly moves the second update's loss. The optimizer is a dimension: SGD's
update follows the gradient's scale (Adam's normalizes it away), so every strategy with
replicas meets SGD under every precision (`with_sgd_rows`). A QAT stage is held to the
same from the same weights, with its activation ranges held (`qat_ranges`), and its
kernels after its updates too (`QAT_KERNEL_RTOL`).

Exported artifacts are checked as every `--smoke` run checks them: float ones give the
model's logits to `export.max_logit_diff`; reduced-precision ones, whose accuracy after
three updates is noise, are held against the model they came from (their logits' SNR
above their precision's floor, `export.verification.SQNR_FLOOR_DB`). No row loosens a
check.

The `channels+qat` stages narrow the model with distillation from the wide one
(`compression.pruning.distill`), then run QAT.

The export preflight is a dimension of its own: with it on, an export that would fail is
refused before training (which only `REFUSED` rows may be); with it off, the run must
still end verified. Every value of every other dimension meets it on in some row, and
rows without it skip its second conversion of each artifact.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import random
import re
import subprocess
from collections import Counter

import pytest

from helpers import QUICKSTART, ROOT, start_run

SEED, MIN_CONFIGS = 2026, 60

DIMENSIONS = {
    "strategy": ["one_device", "mirrored", "multi_worker"],
    "precision": ["float32", "mixed_bfloat16", "mixed_float16"],
    "accumulation": [1, 3],
    "optimizer": ["adam", "sgd"],
    # resnet_v2: the pre-activation form (batch norm -> ReLU -> convolution, norms that no
    # convolution precedes: QAT quantizes them standalone)
    "model": ["cnn", "resnet", "resnet_v2", "ds_cnn", "conv1d", "embedding_bag", "tfidf_linear",
              "transformer", "keras_applications:MobileNetV2",
              "keras_applications:MobileNetV3Small"],
    # the model from its builder, or from a file the model was saved to: by tf_keras, or
    # by Keras 3 (converted layer by layer; Keras 3's own application of that name)
    "source": ["builder", "tf_keras_file", "keras3_file"],
    "augment": ["none", "normalize+crop", "mixup"],
    "remainder": ["drop", "pad"],
    "stages": ["train", "freeze", "distill", "ema", "prune", "prune+qat", "channels+qat"],
    "export": ["saved_model", "tflite_dynamic", "tflite_float16", "tflite_int8",
               "saved_model_int8", "onnx", "tflite_sparse"],
    "preflight": ["on", "off"],
    # activations recomputed in the backward pass (`train.recompute`)
    "recompute": ["none", "blocks", "every"],
}


TEXT = ("embedding_bag", "tfidf_linear", "transformer")
SPEECH = ("ds_cnn", "conv1d")
# models with a layer of tftrain's own (audio features, a token mean, position
# embeddings): a Keras 3 file of them holds a custom layer, which tftrain refuses
CUSTOM = SPEECH + TEXT


def refusal(row: dict) -> str | None:
    """What the config error of a combination that cannot run says (None: it runs)."""
    if row["model"] in TEXT and row["augment"] != "none":
        return "data.augment[0]: "
    if row["source"] == "keras3_file" and row["model"] in CUSTOM:
        return "model.name: "
    if row["stages"].endswith("+qat") and row["export"] in ("tflite_dynamic", "tflite_float16"):
        return "export.tflite: a quantization-aware trained model exports as int8"
    if row["stages"] == "channels+qat" and row["model"] in ("embedding_bag", "tfidf_linear"):
        return "compression.pruning.structure: channels found no group of channels"
    if row["export"] == "tflite_sparse":      # no bundled model follows XNNPack's rules
        return "export.tflite_sparse: "
    if row["model"] in SPEECH and row["export"] in ("tflite_int8", "tflite_dynamic") \
            and not row["stages"].endswith("+qat"):
        return "export.tflite: post-training"
    return None


def runs(row: dict) -> bool:
    return refusal(row) is None


def _pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(list(row), 2)}


# relative seconds of a row: each value multiplies a row's time by its factor, and each
# pair in `PAIR_COST` by its own; the factors fitted (least squares on the logarithm,
# ridge 1.0 toward 1) to the durations of two whole runs of the matrix's 78 rows
# (2026-12-07: the matrix alone, and within the whole suite; 3 pytest workers on 2 cores)
# at its MobileNets' cut backbones (`UNTIL`); a row's time within 1.24x of the fit's, one
# standard deviation (the factors fitted before the cut, 1.44x). A value not named is 1.
# A mirrored row costs about twice a one-device row (its one-device reference) and a
# multi_worker row 2.5 times (worker processes); QAT 2.5-3 times a plain stage;
# mixed_float16, emulated on CPUs, 1.26 times float32
COST = {"strategy": {"mirrored": 2.04, "multi_worker": 2.49},
        "precision": {"mixed_float16": 1.26},
        "model": {"resnet": 1.65, "resnet_v2": 1.48, "ds_cnn": 2.13, "conv1d": 1.06,
                  "embedding_bag": 0.79, "tfidf_linear": 1.35, "transformer": 1.45,
                  "keras_applications:MobileNetV2": 1.78,
                  "keras_applications:MobileNetV3Small": 2.49},
        "source": {"keras3_file": 1.08},
        "augment": {"normalize+crop": 1.09},
        "stages": {"freeze": 1.1, "distill": 1.11, "prune": 1.35, "prune+qat": 2.49,
                   "channels+qat": 2.92},
        "export": {"tflite_dynamic": 1.06, "tflite_float16": 1.08, "tflite_int8": 1.12},
        "preflight": {"off": 0.93},
        "recompute": {"blocks": 1.06}}
PAIR_COST = {(("model", f"keras_applications:{name}"), pair): factor
             for name, factors in {
                 "MobileNetV2": {("strategy", "mirrored"): 1.22,
                                 ("strategy", "multi_worker"): 0.87,
                                 ("precision", "mixed_bfloat16"): 1.12,
                                 ("stages", "prune+qat"): 1.1,
                                 ("stages", "channels+qat"): 0.87},
                 "MobileNetV3Small": {("strategy", "mirrored"): 1.22,
                                      ("strategy", "multi_worker"): 1.15,
                                      ("precision", "mixed_bfloat16"): 1.33,
                                      ("stages", "prune+qat"): 1.07,
                                      ("stages", "channels+qat"): 0.91}}.items()
             for pair, factor in factors.items()}


BASE_SECONDS = 7.2      # the fitted time of a row of every dimension's first value (and a cnn)


def seconds(row: dict) -> float:
    """The row's expected seconds in a whole run of the suite (3 workers on 2 cores)."""
    return BASE_SECONDS * cost(row)


def cost(row: dict) -> float:
    return math.prod(COST[d].get(row[d], 1.0) for d in COST) * \
        math.prod(f for ((a, va), (b, vb)), f in PAIR_COST.items()
                  if row[a] == va and row[b] == vb)


def covering_array(dimensions: dict, valid=runs, seed: int = SEED,
                   at_least: int = MIN_CONFIGS, tries: int = 8) -> list[dict]:
    """The cheapest of `tries` greedy arrays (`_greedy`), seeded from `seed`."""
    names = list(dimensions)
    universe = {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2)
                for va in dimensions[a] for vb in dimensions[b]
                if possible(dimensions, valid, {a: va, b: vb})}
    arrays = [_cheapen(_greedy(dimensions, valid, universe, seed * 100 + i, at_least),
                       dimensions, valid, universe)
              for i in range(tries)]
    return min(arrays, key=lambda rows: sum(map(cost, rows)))


def _greedy(dimensions: dict, valid, universe: set, seed: int, at_least: int) -> list[dict]:
    """Valid rows (one value per dimension) covering every pair of values that some valid
    row holds at least once: greedy, each new row the best of a hundred random valid
    candidates at covering pairs still uncovered per unit of `cost` (AETG, cost-weighted);
    then the cheapest of a few random valid rows up to `at_least`."""
    rng = random.Random(seed)
    names = list(dimensions)

    def draw(fixed):
        while True:
            row = {n: fixed.get(n, rng.choice(dimensions[n])) for n in names}
            if valid(row):
                return row
    uncovered = set(universe)
    rows = []
    while uncovered:
        (a, va), (b, vb) = sorted(uncovered, key=repr)[rng.randrange(len(uncovered))]
        best, score = None, -1.0
        for _ in range(100):
            row = draw({a: va, b: vb})
            g = len(_pairs(row) & uncovered) / cost(row)
            if g > score:
                best, score = row, g
        rows.append(best)
        uncovered -= _pairs(best)
    while len(rows) < at_least:
        rows.append(min((draw({}) for _ in range(20)), key=cost))
    return rows


def _cheapen(rows: list[dict], dimensions: dict, valid, universe: set) -> list[dict]:
    """The array with each row, dearest first, moved dimension by dimension to the
    cheapest valid value that leaves no pair of `universe` uncovered, until no move
    saves (the greedy rows carry values only the pairs they were drawn for needed)."""
    held = Counter(p for row in rows for p in _pairs(row) if p in universe)
    rows, changed = [dict(r) for r in rows], True
    while changed:
        changed = False
        for row in sorted(rows, key=cost, reverse=True):
            for name in dimensions:
                mine = {p for p in _pairs(row) if p in universe}
                for value in sorted(dimensions[name], key=lambda v: cost({**row, name: v})):
                    moved = {**row, name: value}
                    if cost(moved) >= cost(row):
                        break
                    if not valid(moved):
                        continue
                    theirs = {p for p in _pairs(moved) if p in universe}
                    if all(held[p] > 1 for p in mine - theirs):
                        held.subtract(mine - theirs)
                        held.update(theirs - mine)
                        row.update(moved)
                        changed = True
                        break
    return rows


# the dimensions `refusal` reads (`test_the_refusals_read_only_their_dimensions`): whether
# a row can run depends on them alone
RULED = ("model", "source", "augment", "stages", "export")


def possible(dimensions: dict, valid, fixed: dict) -> bool:
    """Whether some valid row holds the values `fixed` (exhaustive over the rest of the
    `RULED` dimensions, the others at their first value: the whole product took 7 s of
    every pytest process's collection)."""
    rest = [n for n in dimensions if n not in fixed and n in RULED]
    first = {n: values[0] for n, values in dimensions.items()}
    return any(valid({**first, **fixed, **dict(zip(rest, values))})
               for values in itertools.product(*(dimensions[n] for n in rest)))


def with_sgd_rows(rows: list[dict]) -> list[dict]:
    """`rows` with an SGD row for every strategy with replicas and every precision: Adam
    normalizes a gradient's scale away, so only an SGD row sees a strategy that scales,
    sums or loss-scales the gradients wrongly under that precision. A row of that strategy
    and precision is moved to SGD where no pair loses its last row, else one is added."""
    rows = [dict(r) for r in rows]
    for strategy, precision in itertools.product(["mirrored", "multi_worker"],
                                                 DIMENSIONS["precision"]):
        mine = [r for r in rows if (r["strategy"], r["precision"]) == (strategy, precision)]
        if not mine or any(r["optimizer"] == "sgd" for r in mine):
            continue
        held = Counter(p for r in rows for p in _pairs(r))
        for row in sorted(mine, key=cost):
            lost = _pairs(row) - _pairs({**row, "optimizer": "sgd"})
            if all(held[p] > 1 for p in lost):
                row["optimizer"] = "sgd"
                break
        else:
            rows.append({**min(mine, key=cost), "optimizer": "sgd"})
    return rows


ROWS = with_sgd_rows(covering_array(DIMENSIONS))
# the pairs no valid row can hold, each once: refused at plan time, before any update
REFUSED = [{**ROWS[i], "model": model, "augment": augment} for i, (model, augment) in
           enumerate(itertools.product(TEXT, ["normalize+crop", "mixup"]))] + \
          [{**ROWS[4 + i], "stages": stages, "export": export}
           for i, (stages, export) in enumerate(itertools.product(
               ["prune+qat", "channels+qat"], ["tflite_dynamic", "tflite_float16"]))] + \
          [{**ROWS[8], "model": "embedding_bag", "augment": "none", "stages": "channels+qat",
            "export": "tflite_int8"}] + \
          [{**ROWS[9 + i], "model": model, "augment": "none", "stages": "train",
            "export": export} for i, (model, export) in enumerate(
                itertools.product(SPEECH, ["tflite_int8", "tflite_dynamic"]))] + \
          [{**ROWS[13 + i], "model": model, "source": "keras3_file", "augment": "none",
            "stages": "train", "export": "saved_model"} for i, model in enumerate(CUSTOM)] + \
          [{"strategy": DIMENSIONS["strategy"][i % 3], "precision": DIMENSIONS["precision"][i % 3],
            "accumulation": DIMENSIONS["accumulation"][i % 2],
            "optimizer": DIMENSIONS["optimizer"][i % 2], "model": model,
            "source": {"cnn": "keras3_file", "resnet": "tf_keras_file"}.get(model, "builder"),
            "augment": "none" if model in TEXT else DIMENSIONS["augment"][i % 3],
            "remainder": DIMENSIONS["remainder"][i % 2],
            "stages": DIMENSIONS["stages"][i % len(DIMENSIONS["stages"])],
            "export": "tflite_sparse", "preflight": DIMENSIONS["preflight"][i % 2],
            "recompute": DIMENSIONS["recompute"][i % 3]}
           for i, model in enumerate(DIMENSIONS["model"])]


def test_the_matrix_covers_every_pair():
    names = list(DIMENSIONS)
    for a, b in itertools.combinations(names, 2):
        seen = {(row[a], row[b]) for row in ROWS + REFUSED}
        assert seen == set(itertools.product(DIMENSIONS[a], DIMENSIONS[b])), (a, b)
        # every pair that can run is run, not only refused
        runnable = {(va, vb) for va, vb in itertools.product(DIMENSIONS[a], DIMENSIONS[b])
                    if possible(DIMENSIONS, runs, {a: va, b: vb})}
        assert {(row[a], row[b]) for row in ROWS} == runnable, (a, b)
    assert len(ROWS) >= MIN_CONFIGS and all(map(runs, ROWS))
    # a wrong gradient scale shows only under SGD: every strategy with replicas meets it
    # under every precision
    assert {(r["strategy"], r["precision"]) for r in ROWS if r["optimizer"] == "sgd"} >= \
        set(itertools.product(["mirrored", "multi_worker"], DIMENSIONS["precision"]))
    assert not any(map(runs, REFUSED))
    print(f"feature matrix: {len(ROWS)} configs that run and {len(REFUSED)} that are refused, "
          f"seed {SEED}")


# A MobileNet's rows take its backbone up to a block that has every kind of layer the
# whole one has (`model.params.until`; for a Keras 3 file, the same cut of Keras 3's own):
# MobileNetV2's third block (its first residual add; zero padding before a stride-2
# depthwise convolution, ReLU6, batch norms to fold), MobileNetV3Small's fifth (hard-swish
# as operations on tensors, squeeze-and-excitation, 5x5 depthwise, a residual add) -- 30
# and 87 layers of 157 and 230. A whole MobileNet's row took 2-2.7x as long (a
# MobileNetV2 prune+qat row to int8 TFLite: 96 s whole, 35 s cut), its time going to what
# grows with the layers (QAT's clones, tracing, exports), not to what it checks.
UNTIL = {"keras_applications:MobileNetV2": ("block_2_add", "block_2_add"),
         "keras_applications:MobileNetV3Small": ("expanded_conv_4/Add", "expanded_conv_4_add")}


def test_the_refusals_read_only_their_dimensions():
    class Reading(dict):
        read: set = set()

        def __getitem__(self, key):
            Reading.read.add(key)
            return super().__getitem__(key)
    rng = random.Random(0)
    for values in itertools.product(*DIMENSIONS.values()):
        if rng.random() < 0.01:                             # (a sample: 19,000 of them)
            refusal(Reading(zip(DIMENSIONS, values)))
    assert Reading.read == set(RULED)


def overrides(row: dict, speech, text) -> list[str]:
    """The row as `--set` overrides of the quickstart config. Models take no dropout (a
    replica's masks are not one device's: the reference could not agree)."""
    model = row["model"]
    sets = [f"distribute.strategy={row['strategy']}", f"precision.policy={row['precision']}",
            f"train.accumulation_steps={row['accumulation']}", "data.per_replica_batch_size=12",
            f"data.remainder={row['remainder']}", "train.jit_compile=false", "train.verbose=0",
            f"export.preflight={row['preflight'] == 'on'}",
            {"adam": "train.optimizer={name: adam, learning_rate: 0.003}",
             "sgd": "train.optimizer={name: sgd, learning_rate: 0.05, params: {momentum: 0.9}}"}[
                row["optimizer"]]]
    if model in SPEECH:
        sets += ["data.name=audio_folder",
                 f"data.params={{path: {speech}, sample_rate: 16000, duration: 1.0}}",
                 "data.validation_fraction=0.25",
                 f"model={{name: {model}, params: {{filters: 16, dropout: 0.0, spectrum: matrix}}}}"
                 if model == "ds_cnn"
                 else f"model={{name: {model}, params: {{filters: [16, 16], dropout: 0.0}}}}"]
    elif model == "tfidf_linear":       # with character n-grams within words
        sets += ["data.name=text", f"data.params={{path: {text}, vocab_size: 2000, char_ngrams: 3, "
                 "char_analyzer: char_wb, char_vocab_size: 4000}", "model={name: tfidf_linear}"]
    elif model in TEXT:
        sets += ["data.name=text", f"data.params={{path: {text}, vocab_size: 2000}}",
                 f"model={{name: {model}, params: {{embed_dim: 16}}}}" if model == "embedding_bag"
                 else f"model={{name: {model}, params: {{embed_dim: 16, num_heads: 2, "
                      "num_layers: 1, mlp_dim: 32}}"]
    elif model.startswith("keras_applications"):     # MobileNetV3's alpha: 0.75 or 1.0
        alpha = 0.35 if model.endswith("MobileNetV2") else 0.75
        sets += ["data.params={image_size: 32, channels: 3}",
                 f"model={{name: '{model}', params: {{weights: null, alpha: {alpha}, "
                 f"dropout: 0.0, until: '{UNTIL[model][0]}'}}}}"]
    elif model == "resnet_v2":
        sets += ["model={name: resnet, params: {depth: 8, width: 8, preact: true}}"]
    else:
        sets += [f"model={{name: {model}, params: {{}}}}" if model == "cnn" else
                 f"model={{name: {model}, params: {{depth: 8, width: 8}}}}"]
    sets += {"none": [],
             "normalize+crop": ["data.augment=[{normalize: {mean: 0.5, std: 2.0}}, " +
                                ("{time_shift: 0.1}]" if model in SPEECH
                                 else "{random_crop: {padding: 1}}]")],
             "mixup": ["data.augment=[{mixup: {alpha: 0.2}}]"]}[row["augment"]]
    sets += {"train": [],
             "freeze": ["train.freeze={epochs: 1}"],
             "distill": [f"compression.distillation={{enabled: true, epochs: 1, student: "
                         f"{{name: {'embedding_bag' if model in TEXT else 'mlp'}}}}}"],
             "ema": ["train.ema={decay: 0.9, recalibrate_batches: 2}"],
             "prune": ["compression.pruning={enabled: true, epochs: 1, final_sparsity: 0.5}"],
             "prune+qat": ["compression.pruning={enabled: true, epochs: 1, final_sparsity: 0.5}",
                           f"compression.quantization={{enabled: true, epochs: 1, "
                           f"skip_unsupported: true, ranges: {qat_ranges(row)}}}"],
             "channels+qat": ["compression.pruning={enabled: true, epochs: 1, "
                              "structure: channels, target_flops: 0.5, distill: true}",
                              f"compression.quantization={{enabled: true, epochs: 1, "
                              f"skip_unsupported: true, ranges: {qat_ranges(row)}}}"]
             }[row["stages"]]
    sets += {"saved_model": ["export.tflite=none"],
             "tflite_dynamic": ["export.tflite=dynamic"],
             "tflite_float16": ["export.tflite=float16"],
             "tflite_int8": ["export.tflite=int8"],
             "saved_model_int8": ["export.tflite=none", "export.saved_model_int8=true"],
             "onnx": ["export.tflite=none", "export.onnx=true"],
             "tflite_sparse": ["export.tflite=none", "export.tflite_sparse=true"]}[row["export"]]
    sets += {"none": [], "blocks": ["train.recompute=blocks"],
             "every": ["train.recompute={every: 3}"]}[row["recompute"]]
    return sets


def model_file(row: dict, sets: list[str], files):
    """The row's model saved to a file as its `source` says; the override naming it. The
    file is made once per worker for the model, its source and its data (`files`: a
    directory of the session's), and rows that name the same share it: it holds the
    same weights either way (seed 7)."""
    import hashlib

    key = json.dumps([row["source"], row["model"],
                      sorted(s for s in sets if s.startswith(("data.", "model=")))])
    directory = files / hashlib.sha256(key.encode()).hexdigest()[:16]
    path = directory / "model.keras"
    if not path.exists():                 # (renamed whole: a failed save leaves none)
        directory.mkdir(parents=True, exist_ok=True)
        save_model_file(row, sets, directory / "partial.keras")
        (directory / "partial.keras").replace(path)
    return f"model={{name: 'file:{path}'}}"


def save_model_file(row: dict, sets: list[str], path) -> None:
    from tftrain.config import load_config
    from tftrain.core.keras import keras, keras3
    from tftrain.data import load_source
    from tftrain.models import build_model
    from tftrain.models import keras3 as convert

    # the row's model and data (what it compresses and exports may be refused: not here)
    cfg = load_config(QUICKSTART, [s for s in sets if not s.startswith(("compression.", "export."))])
    spec = load_source(cfg.data, cfg.run.seed).spec
    keras.utils.set_random_seed(7)
    if row["source"] == "tf_keras_file":
        build_model(cfg.model, spec).save(str(path))
    elif row["model"] in CUSTOM:
        custom_keras3_model(spec).save(str(path))
    elif row["model"].startswith("keras_applications"):      # Keras 3's own, cut alike
        k3 = keras3()
        name = row["model"].split(":")[1]
        backbone = getattr(k3.applications, name)(
            input_shape=spec.shape, alpha=0.35 if name == "MobileNetV2" else 0.75,
            weights=None, include_top=False)
        x = k3.layers.GlobalAveragePooling2D()(backbone.get_layer(UNTIL[row["model"]][1]).output)
        k3.Model(backbone.input, k3.layers.Dense(spec.num_classes)(x)).save(str(path))
    else:
        convert.to_keras3(build_model(cfg.model, spec)).save(str(path))


def custom_keras3_model(spec):
    """A Keras 3 model with a layer of its own (as a Keras 3 form of a model with one of
    tftrain's layers would have)."""
    k3 = keras3_module()

    @k3.saving.register_keras_serializable("matrix")
    class Features(k3.layers.Layer):
        def call(self, x):
            return k3.ops.cast(x, "float32") * 2.0

    inputs = k3.Input(spec.shape, dtype="int32" if "int" in spec.dtype else "float32")
    x = k3.layers.Flatten()(Features(name="features")(inputs))
    return k3.Model(inputs, k3.layers.Dense(spec.num_classes)(x))


def keras3_module():
    from tftrain.core.keras import keras3
    return keras3()


def workers(row: dict, index: int) -> int:
    """Worker processes of a row (0: the row runs in this process): every other
    multi_worker row of the matrix has 2, the rest 1 (a cluster of one)."""
    if row["strategy"] != "multi_worker":
        return 0
    before = sum(r["strategy"] == "multi_worker" for r in (ROWS + REFUSED)[:index])
    return 2 if before % 2 == 0 else 1


# the training losses of a row and of its one-device reference agree to this relative
# tolerance. float32: 100 units of roundoff (2^-24), for sums taken in another order (a
# replica's gradients summed by the all-reduce rather than the accumulation loop).
# bfloat16 and float16: a tenth of the compute dtype's unit roundoff (2^-8, 2^-11): both
# sides compute the same micro-batches in the same dtype, and the float32 weights they
# update differ by float32 rounding, which moves a weight's bfloat16 or float16 value only
# where it lies on a rounding edge. Measured over the whole matrix (2026-12-04): float32
# rows at most 0.04 of their tolerance, bfloat16 8e-5, float16 2e-6; a replica's
# gradients not divided by the replica count moves the second update's loss by 0.1-1%.
LOSS_RTOL = {"float32": 100 * 2.0 ** -24, "mixed_bfloat16": 2.0 ** -8 / 10,
             "mixed_float16": 2.0 ** -11 / 10}


# QAT's updates under a strategy against one device from the same weights, with the
# activation ranges held at their calibrated values (`compression.quantization.ranges:
# fixed`, `qat_ranges`): tfmot's moving ranges follow an EMA of each forward pass's min
# and max, once per replica batch under a strategy (the replicas' moves averaged) and once
# per micro-batch in turn on one device. The losses were held to 3e-3, twice the largest
# clean difference measured (1.5e-3, a transformer; others 7e-5 to 8e-5). Most of that
# difference was a fault of its own: a smoke run capped its calibration batches by count,
# and two replicas' batches are half one device's, so the two sides calibrated their
# ranges on different examples (now the same examples: `Runner._batches`). Held and
# calibrated alike, the QAT rows with replicas measured 0 to 0.023 of float32's loss
# tolerance (2026-12-05): the QAT stage computes in float32 whatever the row's policy,
# and its losses are held to float32's `LOSS_RTOL`.
QAT_RTOL = LOSS_RTOL["float32"]

# A QAT-stage gradient 0.5% off where replicas train (the planted fault
# `qat_gradient_off_with_replicas`) moves those losses by 0.53 and 0.83 of that
# tolerance only (QAT's rate is a tenth of training's, and the loss a running mean), so
# the stage's kernels after its updates are compared too, as the largest difference
# relative to each kernel's largest value: clean 0 to 7.4e-8 (about one unit of float32's
# rounding), the fault 2.0e-5 and 8.5e-5 on the SGD rows (Adam normalizes a gradient's
# scale away). Held to 16 units of float32's rounding, between the two.
QAT_KERNEL_RTOL = 16 * 2.0 ** -24


def qat_ranges(row: dict) -> str:
    """The QAT stage's activation ranges in a row: fixed where replicas are compared with
    one device, tfmot's moving ones elsewhere (one-device rows)."""
    return "moving" if row["strategy"] == "one_device" else "fixed"


def _id(row):
    return "-".join(str(v) for v in row.values()).replace("keras_applications:", "")


def _run(row: dict, index: int, sets: list[str], tmp_path, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the row: in this process, or launched."""
    args = [str(QUICKSTART), "--run-dir", str(tmp_path), "--smoke",
            *[a for s in sets for a in ("--set", s)]]
    n = workers(row, index)
    if not n:
        from tftrain.run import main
        code = main(args)
        out, err = capsys.readouterr()
        return code, out, err
    cpus = "distribute.virtual_cpus=" + ("1" if n == 2 else "2")    # 2 replicas either way
    proc = start_run("--workers", str(n), *args, "--set", cpus, module="tftrain.launch",
                     session=True, stderr=subprocess.STDOUT, env=replica_threads(n))
    try:
        out, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, out


def replica_threads(n: int) -> dict | None:
    """The environment of a row's worker processes: 2 workers of one replica each run
    their ops on one thread, as this process's replicas do and its one-device reference
    (`strategy.share_cores`: 2 logical CPUs on 2 cores); a worker process of its own
    would otherwise give each op both cores. The thread count is not only speed: oneDNN's
    bfloat16 batch norm in training mode sums in another order on 2 threads (about one
    bfloat16 step on a pre-activation net's first norm, 1.6% of the loss three updates
    later), which the reference could not agree with."""
    import os
    return {**os.environ, "PYTHONPATH": str(ROOT),
            "TF_NUM_INTRAOP_THREADS": "1"} if n == 2 else None


# refusals that need the model or the data read (a layer of the model's, the data's
# dtype): `--dry-run`, before TensorFlow loads, cannot know them and says what checks them
NEEDS_THE_MODEL = ("data.augment[0]: ", "model.name: ", "export.tflite_sparse: ",
                   "compression.pruning.structure: channels", "export.tflite: post-training")
# the plan lines both plans print alike (a stage's full line goes on after the dry run's)
PLAN_LINES = ("strategy: ", "batch: ", "training: ", "stage ", "exports: ")


def dry_run_agrees(row: dict, index: int, sets: list[str], tmp_path, capsys, code: int,
                   out: str, err: str) -> None:
    """`--dry-run` (the config alone, before TensorFlow loads) says what the plan the row's
    run built and printed says (`--dry-run --full` prints that plan and stops): the same
    exit code and config error, or the same strategy, batch and exports lines, whole, and
    each stage's line (training's first) up to what the model or the files decide. A refusal that needs the model is left to the full plan, which the dry
    run names."""
    from tftrain.run import main
    args = [str(QUICKSTART), "--run-dir", str(tmp_path / "dry"), "--smoke", "--dry-run",
            *[a for s in sets for a in ("--set", s)]]
    n = workers(row, index)
    if n:                  # as launched: each worker's dry run (worker 0's lines compared)
        cpus = "distribute.virtual_cpus=" + ("1" if n == 2 else "2")
        proc = start_run("--workers", str(n), *args, "--set", cpus, module="tftrain.launch",
                         stderr=subprocess.STDOUT)
        sketch, _ = proc.communicate(timeout=300)
        dry, sketch, sketch_err, out = proc.returncode, worker0(sketch), sketch, worker0(out)
    else:
        capsys.readouterr()
        dry = main(args)
        sketch, sketch_err = capsys.readouterr()
    assert not (tmp_path / "dry").exists()

    def errors(text):
        return [line.split("] ", 1)[-1] for line in text.splitlines() if "config error" in line]
    if code:
        assert refusal(row) is not None, err[-4000:]      # a row that runs failed
        if refusal(row).startswith(NEEDS_THE_MODEL):
            assert dry == 0 and "--dry-run --full builds the model" in sketch, sketch_err
        else:
            assert dry == code and errors(sketch_err)[:1] == errors(err)[:1], (sketch_err, err)
        return
    assert dry == 0, sketch_err[-2000:]

    def plan(text: str) -> list[str]:
        lines = text.splitlines()
        block = lines[next(i for i, line in enumerate(lines) if line.startswith("strategy: ")):]
        block = block[:next(i for i, line in enumerate(block) if line.startswith("run directory"))]
        # (the dry run names where the cluster came from: "workers: 2 (from TF_CONFIG)")
        return [re.sub(r" \(from \w+\)", "", line.split("   devices:")[0]) for line in block
                if line.startswith(PLAN_LINES)]
    ours, theirs = plan(sketch), plan(out)
    # whole lines, but for the stages' (training's first): the run's says more after its
    # updates (what the model decides: sparsity's schedule, QAT's dtype, the weight
    # average), and the dry run may not know a file's example count (its updates)
    assert len(ours) == len(theirs) and all(
        t.startswith(o) if o.startswith(("stage ", "training: ")) else t == o
        for o, t in zip(ours, theirs)), (ours, theirs)
    assert ours[0].startswith("strategy: ") and ours[-1].startswith("exports: ")


def worker0(text: str) -> str:
    """Worker 0's lines of a launch's output, without their prefix."""
    return "\n".join(line[len("[worker 0] "):] for line in text.splitlines()
                     if line.startswith("[worker 0] "))


def stage_losses(run_path) -> dict[str, dict[int, float]]:
    """{stage's updates file: {update: training loss}} of a run (`updates.csv` is
    training's, `updates-frozen.csv` a frozen stage's, `updates-qat.csv` QAT's, ...)."""
    found = {}
    for path in sorted(run_path.glob("updates*.csv")):
        with open(path) as f:
            found[path.name] = {int(r["update"]): float(r["loss"]) for r in csv.DictReader(f)}
    return found


def qat_kernels_agree(run, reference) -> None:
    """The QAT stage's kernels after its updates, in the row's run and in its one-device
    reference, agree within `QAT_KERNEL_RTOL` of each kernel's largest value."""
    import numpy as np
    ours, theirs = stage_kernels(run, "qat"), stage_kernels(reference, "qat")
    assert ours.keys() == theirs.keys() and ours, (sorted(ours), sorted(theirs))
    gaps = {k: float(np.max(np.abs(ours[k] - theirs[k])) / max(np.max(np.abs(theirs[k])), 1e-30))
            for k in theirs}
    worst = max(gaps, key=gaps.get)
    print(f"matrix qat kernels: {len(gaps)}, {gaps[worst] / QAT_KERNEL_RTOL:.3g} of the tolerance")
    assert gaps[worst] <= QAT_KERNEL_RTOL, (worst, gaps[worst])


def stage_kernels(run_path, stage: str) -> dict:
    """{variable: value} of the kernels in a stage's last checkpoint."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(run_path / "checkpoints" / stage))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith("model/") and "kernel" in name and "OPTIMIZER" not in name}


def first_stage(row: dict) -> str:
    return "updates-frozen.csv" if row["stages"] == "freeze" else "updates.csv"


def one_device(row: dict, sets: list[str]) -> list[str]:
    """The row's overrides on one device, accumulating both replicas' micro-batches (the
    same global batch)."""
    keep = [s for s in sets if not s.startswith(("distribute.strategy=", "train.accumulation_steps="))]
    return keep + ["distribute.strategy=one_device",
                   f"train.accumulation_steps={2 * row['accumulation']}"]


# a reference run exports nothing: its losses and kernels are what it is compared on
NO_EXPORT = ["export.tflite=none", "export.saved_model=false", "export.preflight=false"]


def reference_sets(row: dict, sets: list[str], dropped: tuple[str, ...]) -> list[str]:
    """The row's overrides on one device (`one_device`) without those starting with
    `dropped`, exporting nothing (`NO_EXPORT`)."""
    return [s for s in one_device(row, sets) if not s.startswith(dropped)] + NO_EXPORT


def reference_losses(row: dict, sets: list[str], tmp_path, capsys) -> dict[str, dict[int, float]]:
    """The row's first stage on one device (`one_device`), without the later stages and
    exports."""
    from tftrain.run import main
    keep = reference_sets(row, sets, ("compression.", "export."))
    code = main([str(QUICKSTART), "--run-dir", str(tmp_path / "reference"), "--smoke",
                 *[a for s in keep for a in ("--set", s)]])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    return stage_losses(tmp_path / "reference" / "quickstart-smoke")


def resumed_losses(row: dict, sets: list[str], run, stage: str, tmp_path,
                   capsys) -> dict[int, float]:
    """A later stage (a channel fine-tune, QAT) of the row run again on one device from
    where the row's stages before it left off: the row's run directory with that stage
    and those after it taken out, resumed on one device accumulating both replicas'
    micro-batches (the same global batch, the row's config otherwise), so both sides start
    from the same weights and, for QAT, calibrate the same ranges. It exports nothing
    (`NO_EXPORT`, written into the copy's config as well: a resume keeps its config but for
    its topology); the row's run verified its exports."""
    import shutil

    import yaml

    from tftrain.config import dump_config, load_config
    from tftrain.run import main
    copy = tmp_path / f"resumed-{stage}" / run.name
    shutil.copytree(run, copy)
    done = json.loads((copy / "stages.json").read_text())
    order = list(done)
    ours = reference_sets(row, sets, ("export.",))
    later = order[order.index(stage) + 1:]
    assert later in ([], ["qat"]), later
    if later:                 # a channel fine-tune's reference stops there: QAT is not run
        ours.append("compression.quantization.enabled=false")
    config = yaml.safe_load((copy / "config.yaml").read_text())
    resolved = yaml.safe_load(dump_config(load_config(QUICKSTART, ours)))
    config["export"], config["compression"] = resolved["export"], resolved["compression"]
    (copy / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for name in order[order.index(stage):]:
        del done[name]
        shutil.rmtree(copy / "checkpoints" / name, ignore_errors=True)
        for log in (f"updates-{name}.csv", f"metrics-{name}.csv"):
            (copy / log).unlink(missing_ok=True)
    (copy / "stages.json").write_text(json.dumps(done))
    (copy / "summary.json").unlink()
    shutil.rmtree(copy / "export", ignore_errors=True)
    code = main([str(QUICKSTART), "--run-dir", str(copy.parent), "--smoke",
                 *[a for s in ours for a in ("--set", s)]])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    assert f"[{stage}] " in out and not any(f"[{n}] " in out for n in order if n != stage)
    return stage_losses(copy)[f"updates-{stage}.csv"]


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("index,row", list(enumerate(ROWS + REFUSED)),
                         ids=[_id(row) for row in ROWS + REFUSED])
def test_every_combination_works_or_is_refused_before_training(index, row, tmp_path, capsys,
                                                              spoken_digits, fortunes,
                                                              tmp_path_factory):
    sets = overrides(row, spoken_digits, fortunes)
    if row["source"] != "builder":
        files = tmp_path_factory.getbasetemp() / "matrix-model-files"
        sets = [s for s in sets if not s.startswith("model=")] + [model_file(row, sets, files)]
    code, out, err = _run(row, index, sets, tmp_path, capsys)
    dry_run_agrees(row, index, sets, tmp_path, capsys, code, out, err)
    run = tmp_path / "quickstart-smoke"
    if not runs(row):                   # refused: at plan time, one line, nothing written
        assert code == 2, err[-4000:]
        lines = [line.split("] ", 1)[-1] for line in err.splitlines()
                 if "tftrain: config error: " in line]
        assert lines and "Traceback" not in err, err[-3000:]
        assert refusal(row) in lines[0], lines[0]
        assert not run.exists() and "training:" not in out, out[-2000:]
        return
    assert code == 0, err[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["artifacts"]
    assert summary["strategy"] == row["strategy"]
    assert summary["replicas"] == (1 if row["strategy"] == "one_device" else 2)
    assert summary.get("workers", 1) == max(1, workers(row, index))
    for name, artifact in summary["artifacts"].items():
        assert artifact["verified"], (name, artifact.get("check"))
    for name, stage in summary["stages"].items():   # no call's logs copied to the host
        assert stage["host"]["logs_copied_by"] == [], (name, stage["host"])
    if row["strategy"] == "one_device":
        return
    all_ours = stage_losses(run)
    held = {first_stage(row): reference_losses(row, sets, tmp_path, capsys)[first_stage(row)]}
    if row["stages"].endswith("+qat"):  # QAT and a channel fine-tune, each from the same start
        stages = [n for n in json.loads((run / "stages.json").read_text()) if n != "train"]
        held.update({f"updates-{n}.csv": resumed_losses(row, sets, run, n, tmp_path, capsys)
                     for n in stages if n in ("qat", "channels")})
    if row["stages"].endswith("+qat"):
        qat_kernels_agree(run, tmp_path / "resumed-qat" / run.name)
    for name, theirs in held.items():
        ours = all_ours[name]
        common = sorted(set(ours) & set(theirs))
        # updates 1 and 2 each end a call of their own (the calls are sized after them);
        # a stage of one update (an epoch of one, under --smoke) has only the first
        assert common[:2] == [1, 2] or common == [1] == sorted(ours), (name, ours, theirs)
        rtol = QAT_RTOL if name == "updates-qat.csv" else LOSS_RTOL[row["precision"]]
        worst = max(abs(ours[u] - theirs[u]) / abs(theirs[u]) for u in common)
        print(f"matrix loss agreement: {name} {row['precision']} {worst / rtol:.3g} of the "
              "tolerance")
        assert worst <= rtol, (name, {u: (ours[u], theirs[u]) for u in common})
