"""Whether each exported artifact is what the model computes: float artifacts give its
logits within `export.max_logit_diff` (times the largest logit, when above 1); reduced-precision ones its accuracy within
`export.max_accuracy_drop` or, where accuracy says nothing (the export preflight's
untrained model, a `--smoke` run's few updates), its logits to within the noise their
precision adds. A failed check leaves the artifact written and marked."""
from __future__ import annotations

from tftrain.export import kinds, layer_noise

# Without labels to judge by (the export preflight's untrained model, a --smoke run's few
# updates), a reduced-precision artifact is held against the model it came from. An int8
# file compared layer by layer (`export.fidelity`) must not have a layer that adds more
# noise than `export.min_layer_sqnr` (20 dB; an 8-bit tensor's own rounding is 6.02 x 8 +
# 1.76 = 49.9 dB below a full-range signal, and layers measured here add 38-50 dB; one
# layer's kernel scale 8x off adds the noise at -16 dB). Against a QAT model, which
# computes the 8-bit arithmetic itself (fake quantization), only rounding differs, and
# its layers added 45-57 dB on --smoke rows. The accumulated error at the logits is no
# test on its own: a barely trained deep network amplifies any perturbation (a
# smoke-trained MobileNetV2's int8 kernels each add noise 46-48 dB down, and the logits
# end 6 dB above it; a smoke-trained QAT MobileNetV2's layers 45-57 dB, its logits 6.3 dB).
# So a QAT model's files without a layer comparison must give its logits to within
# rounding (`export.min_layer_sqnr` at the logits; 39-57 dB on --smoke rows of shallower
# models), other files need only more signal than error at their logits (dB).
SQNR_FLOOR_DB = {"int8": 0.0, "dynamic": 0.0, "float16": 10.0}
# a float file's layer adds float32 rounding, far below this (capped at 99 dB when
# compared): a layer converted to something else adds noise within a few dB of its values
FLOAT_LAYER_SQNR_DB = 60.0
# logits spread less than this across classes (RMS) carry no signal to compare with: an
# untrained Keras 3 MobileNetV2's fade to 1e-12 by its last blocks
SIGNAL_FLOOR = 1e-4


def precision_of(name: str) -> str:
    """The precision an artifact computes in (`float`, `int8`, `dynamic`, `float16`): its
    kind's (a QAT model's SavedModel is float: its float fake-quant graph)."""
    return kinds.named(name).precision


def verify(report: dict, cfg, accuracy: float | None, qat: bool = False, by_labels: bool = True,
           untrained: bool = False) -> dict:
    """Mark each artifact verified or failed: float artifacts must give the in-memory
    model's logits within `export.max_logit_diff`; reduced-precision ones (dynamic,
    float16, int8) its accuracy within `export.max_accuracy_drop` or, without
    `by_labels` (a model whose accuracy is noise), no layer adding more noise than
    `export.min_layer_sqnr` (int8 files compared layer by layer), or else the logits of
    a QAT model's files within `export.min_layer_sqnr` and others' above the floor of
    their precision (`SQNR_FLOOR_DB`). `untrained` (the export preflight): a QAT
    model's ranges are not calibrated yet, so its files are held to the plain floors. The
    SavedModel of a quantization-aware trained model (`qat`) holds its fake-quant ops in
    float: it is held, as a float artifact, to the model traced as a function
    (`measures.against_traced`), not to the eager model, from which a value on an 8-bit
    rounding edge can move a whole step."""
    for name, entry in report.items():
        precision = precision_of(name)
        if precision == "float":
            ok, entry["check"] = _float_check(entry, cfg)
        elif by_labels:
            assert accuracy is not None, "judged by labels: the model's accuracy is needed"
            drop = accuracy - entry["accuracy"]
            ok = drop <= cfg.max_accuracy_drop + 1e-9
            entry["judged_by"] = "accuracy"     # a miss is a budget missed, not a fault
            model = "traced" if qat else "in memory"    # (`ExportContext.reference_accuracy`)
            entry["check"] = (f"accuracy {entry['accuracy']:.4f} vs {accuracy:.4f} {model}: "
                              f"drop {drop:.4f} {'<=' if ok else '>'} export.max_accuracy_drop "
                              f"{cfg.max_accuracy_drop:g}")
        else:
            ok, entry["check"] = _against_the_model(entry, precision, cfg, qat and not untrained,
                                                    untrained)
        entry["verified"] = ok
    return report


# a float artifact may be this many times the model's own logit noise apart
# (`measures.rounding_noise`): it rounds at every layer, the noise only at the input
NOISE_FACTOR = 10.0


def _limit(entry: dict, cfg) -> tuple[float, str]:
    """The largest logit difference a float artifact may show, and what it is:
    `export.max_logit_diff` times the model's largest logit where that is above 1 (float32
    rounds relative to a value's size), or `NOISE_FACTOR` times the model's own logit
    noise where that is more (a deep untrained network amplifies rounding)."""
    scale = max(1.0, entry.get("logit_scale", 1.0))
    noise = NOISE_FACTOR * entry.get("logit_noise", 0.0)
    if noise > cfg.max_logit_diff * scale:
        return noise, (f"{noise:.2g}, {NOISE_FACTOR:g} x the model's own logit noise (its "
                       f"logits moved by {entry['logit_noise']:.2g} under input rounding)")
    return cfg.max_logit_diff * scale, f"export.max_logit_diff {cfg.max_logit_diff:g}" + (
        f" x the largest logit {scale:.3g}" if scale > 1.0 else "")


def logits_within(entry: dict, cfg) -> bool:
    """Whether a float artifact's largest logit difference is within its `_limit`, and
    that limit says something (not `vacuous`)."""
    return entry["max_abs_logit_diff"] <= _limit(entry, cfg)[0] and not vacuous(entry)


def vacuous(entry: dict) -> bool:
    """Whether the model's own logit noise allows a difference as large as its largest
    logit: an untrained deep network that amplifies float32 rounding past its signal
    (EfficientNetB4-B7 and V2S-V2L untrained at 32 x 32: logits moved by 30-160% of
    their size under input rounding), where no difference at the logits tells a broken
    file from a sound one."""
    return NOISE_FACTOR * entry.get("logit_noise", 0.0) >= entry.get("logit_scale", float("inf"))


def _float_check(entry: dict, cfg) -> tuple[bool, str]:
    """(verified, why) for a float artifact: its logits within `logits_within`, or else,
    compared layer by layer (`layers`, a float TFLite file's), no layer adding noise above
    float rounding (`FLOAT_LAYER_SQNR_DB`): an untrained EfficientNetV2B0 (270 layers)
    amplified its float TFLite file's rounding, each layer exact to 99 dB, into logits
    0.053 apart on a largest logit of 35.5, and its SavedModel's 0.0069 on 53."""
    limit, what = _limit(entry, cfg)
    ok = entry["max_abs_logit_diff"] <= limit
    why = (f"largest logit difference {entry['max_abs_logit_diff']:.2g} "
           f"{'<=' if ok else '>'} {what}")
    if ok and vacuous(entry):
        ok, why = False, (f"{why}, which is as large as the largest logit "
                          f"{entry['logit_scale']:.3g}: the model amplifies float32 rounding past "
                          "its signal (untrained, deep), and no difference at its logits can tell "
                          "a broken file; train it first, or compare it layer by layer")
    rows = entry.get("layers")
    if ok or not rows:
        return ok, why
    if entry.get("uncompared"):
        return False, f"{why}; {partial(entry['uncompared'])}"
    worst = min(rows, key=lambda row: row["local_sqnr_db"])
    ok = worst["local_sqnr_db"] >= FLOAT_LAYER_SQNR_DB
    return ok, (f"{why}; layer by layer the noisiest, {worst['layer']}, adds noise "
                f"{worst['local_sqnr_db']:.1f} dB below its values {'>=' if ok else '<'} "
                f"{FLOAT_LAYER_SQNR_DB:g} dB" + (" (float rounding, amplified by the network)"
                                                 if ok else ""))


def _against_the_model(entry: dict, precision: str, cfg, qat: bool,
                       untrained: bool = False) -> tuple[bool, str]:
    """(verified, why) for a reduced-precision artifact judged without labels. Logits
    without signal pass unjudged only in the preflight (`untrained`), which judges again at
    the run's end; a file compared layer by layer with no layer found fails."""
    tail = (f"; its logits {entry['logit_sqnr_db']:.1f} dB above their difference from the "
            f"model's, top-1 agreeing on {entry['top1_agreement']:.1%}; accuracy is not judged: "
            "the model is untrained or smoke-trained")
    spread = entry.get("logit_spread", 1.0)
    if spread < SIGNAL_FLOOR:
        why = (f"not judged: the model's logits carry no signal to compare (they spread "
               f"{spread:.1e} across classes; an untrained deep network whose batch-norm "
               "statistics are still their initial values can fade its activations to nothing)")
        if untrained:
            return True, why + "; judged again at the run's end"
        return False, why + ("; after training this file cannot be told from a broken one: "
                             "train longer, or export it with labels to judge it by")
    rows = entry.get("layers")
    if rows is not None and not rows:
        return False, ("compared layer by layer, but none of the model's layers was found in "
                       "the file (its tensors' names match no layer): nothing shows it computes "
                       "what the model does" + tail)
    if rows and entry.get("uncompared"):
        return False, partial(entry["uncompared"]) + tail
    if rows:
        floor = layer_noise.floor(precision, cfg)
        failed = [row for row in rows if layer_noise.too_noisy(row, floor)]
        worst = min(failed or rows, key=lambda row: row["local_sqnr_db"])
        return not failed, (f"the {'noisiest failing' if failed else 'noisiest'} layer, "
                            f"{layer_noise.why_noisy(worst, floor, precision)}" + tail)
    if qat:     # the QAT model computes the 8-bit arithmetic itself: only rounding differs
        ok = entry["logit_sqnr_db"] >= cfg.min_layer_sqnr
        return ok, (f"logits {entry['logit_sqnr_db']:.1f} dB above their difference from the "
                    f"QAT model's {'>=' if ok else '<'} export.min_layer_sqnr "
                    f"{cfg.min_layer_sqnr:g} (it computes the same 8-bit arithmetic); top-1 "
                    f"agrees on {entry['top1_agreement']:.1%}; accuracy is not judged: the model "
                    "is untrained or smoke-trained")
    if not untrained:     # after training, a file passes without labels only on its layers
        return False, ("not compared layer by layer: without labels to judge it by, nothing "
                       "shows it computes what the model does" + tail)
    floor = SQNR_FLOOR_DB[precision]
    ok = entry["logit_sqnr_db"] >= floor
    return ok, (f"logits {entry['logit_sqnr_db']:.1f} dB above their difference from the "
                f"model's {'>=' if ok else '<'} {floor:g} dB ({precision}; top-1 agrees on "
                f"{entry['top1_agreement']:.1%}; the preflight's untrained model: not judged "
                "layer by layer here, judged again at the run's end)")


def partial(missing: list[str]) -> str:
    """Why a comparison that missed layers judges nothing of them."""
    return (f"compared layer by layer, but {len(missing)} of the model's layers with weights "
            f"have no counterpart in the file ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}): nothing shows it computes them")


def failures(report: dict) -> list[str]:
    """One line per artifact that failed its check."""
    return [f"{name}: {entry['check']}" for name, entry in report.items()
            if not entry.get("verified", True)]


def only_budget_missed(report: dict) -> bool:
    """Whether every failed artifact (at least one) failed only its accuracy budget
    (`export.max_accuracy_drop`, judged on the validation labels): a reduced-precision
    file that works but loses more than allowed, not a conversion that computes
    something else (a float file's logits apart, a layer's noise without labels)."""
    failed = [entry for entry in report.values() if not entry.get("verified", True)]
    return bool(failed) and all(entry.get("judged_by") == "accuracy" for entry in failed)


def best_within_budget(report: dict) -> str | None:
    """The artifact to ship when another missed its budget: of those verified, the
    smallest file (then the fastest at batch 1 on 1 thread); None when none is."""
    def rank(item):
        name, entry = item
        grid = entry.get("latency_grid") or {}
        return (entry.get("size_bytes", float("inf")),
                grid.get("batch1_threads1", entry.get("latency_ms", float("inf"))))
    passed = [item for item in report.items() if item[1].get("verified", True)]
    return min(passed, key=rank)[0] if passed else None
