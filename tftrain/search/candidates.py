"""The candidates of a compression search: what each changes in the dense run's config,
which file it deploys, what it is predicted to cost and give, and the order they are
tried in (cheap and likely first; Optuna proposes the rest).

A candidate is a precision (the dense `float` file, `float16`, `dynamic` range, `int8`
after training, `qat`: int8 after quantization-aware training, which may keep up to
`export.int8_fallback_layers` noisy layers float) on the dense model's width or a
channel-pruned one (`channels`: the share of the dense FLOPs kept), and, where a size
budget counts gzipped bytes, weight sparsity (zeros compress). Each fine-tunes from the
dense run's checkpoints: pruning for `target.fine_tune_epochs`, QAT for
`target.qat_epochs`; post-training precisions only convert.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from tftrain.export import kinds

PRECISIONS = ("float", "float16", "dynamic", "int8", "qat")
CHANNEL_LEVELS = (0.7, 0.5, 0.35, 0.25)
SPARSITY_LEVELS = (0.5, 0.75)
# a file's bytes against the float file's, by precision (weights 2 or 4 times smaller,
# scales and the graph around them)
BYTES = {"float": 1.0, "float16": 0.52, "dynamic": 0.28, "int8": 0.28, "qat": 0.28}
# updates cost against a plain training update: fake-quant ops in the step; a forward
# pass of the dense teacher (a third of its update)
QAT_STEP = 2.0
TEACHER = 1 / 3
# the file each precision deploys: its size and speed (not its accuracy) alike
FILE_KIND = {"float": "float", "float16": "float16", "dynamic": "dynamic", "int8": "int8",
             "qat": "int8"}


@dataclass(frozen=True)
class Candidate:
    precision: str
    channels: float | None = None     # FLOPs kept by channel pruning; None: the dense width
    sparsity: float | None = None     # weight pruning's final sparsity
    origin: str = "list"              # the ordered list, or `optuna`

    @property
    def name(self) -> str:
        parts = ([f"channels{round(self.channels * 100)}"] if self.channels else []) + \
                ([f"sparse{round(self.sparsity * 100)}"] if self.sparsity else [])
        return "-".join(parts + [self.precision])

    @property
    def reference(self) -> bool:
        """The dense model's float file: what the others are measured against."""
        return self == DENSE

    def artifact(self, runtime: str) -> str:
        """The summary entry of the file this candidate deploys."""
        return kinds.deployed(runtime, "int8" if self.precision == "qat" else self.precision)

    def updates(self, steps_per_epoch: int, target) -> float:
        """Fine-tuning cost in plain training updates (QAT's weigh `QAT_STEP`; a narrower
        model's steps cost its share of the FLOPs, and the dense teacher's forward pass,
        a third of a dense update, while it is distilled)."""
        cost = 0.0
        if self.channels:
            cost += target.fine_tune_epochs * steps_per_epoch * (self.channels + TEACHER)
        elif self.sparsity:
            cost += target.fine_tune_epochs * steps_per_epoch
        if self.precision == "qat":
            cost += target.qat_epochs * steps_per_epoch * (self.channels or 1.0) * QAT_STEP
        return cost

    def config(self, base: dict, target, reference_file: str | None) -> dict:
        """The candidate's run config: `base` (the dense run's, as plain YAML data) with
        its compression, the export of its file (timed against `reference_file`) and the
        search's budget for the int8 fallback."""
        cfg = copy.deepcopy(base)
        compression = cfg.setdefault("compression", {})
        pruning = {"enabled": False}
        if self.channels:
            # a narrowed model relearns what its lost channels computed: its channels chosen
            # by batch-norm scale where it has batch norms, and taught by the dense model's
            # logits (image recipe, half the FLOPs, 66 updates: 0.78 by filter norm alone,
            # 0.85 distilled, 0.91 by scale, 0.91 by both with a lower loss)
            pruning = {"enabled": True, "structure": "channels", "target_flops": self.channels,
                       "epochs": target.fine_tune_epochs, "importance": "auto",
                       "distill": True}
        elif self.sparsity:
            pruning = {"enabled": True, "final_sparsity": self.sparsity,
                       "epochs": target.fine_tune_epochs}
        compression["pruning"] = pruning
        quantization = dict(compression.get("quantization") or {})
        quantization.update(enabled=self.precision == "qat", epochs=target.qat_epochs)
        compression["quantization"] = quantization
        export = cfg.setdefault("export", {})
        onnx = target.latency.runtime == "onnx"
        tflite = {"float": "float", "qat": "int8"}.get(self.precision, self.precision)
        export.update(
            saved_model=False, saved_model_int8=False, tflite_sparse=False, onnx=onnx,
            preflight=False, latency_reference=reference_file,
            tflite="none" if onnx and self.precision == "float" else tflite,
            max_accuracy_drop=target.max_accuracy_drop,
            int8_fallback="auto" if self.precision == "qat" else "off")
        return cfg

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


DENSE = Candidate("float")


def from_dict(data: dict) -> Candidate:
    return Candidate(**data)


def predicted(candidate: Candidate, target, dense: dict, int8_fast: bool) -> dict:
    """What the candidate should give, from the dense file's figures (`bytes`): its bytes
    and latency against the dense file's. Rough (a model's per-op overheads vary); only
    the order of the list depends on it."""
    keep = candidate.channels or 1.0
    size = dense["bytes"] * keep * BYTES[candidate.precision]
    if candidate.sparsity and target.size == "gzip":
        size *= 1.0 - 0.8 * candidate.sparsity
    speed = {"float": 1.0, "float16": 1.0, "dynamic": 0.9, "int8": 0.6 if int8_fast else 1.2}
    return {"bytes": size, "latency_ratio": keep ** 0.8 * speed[FILE_KIND[candidate.precision]]}


def feasible(prediction: dict, target, dense: dict) -> bool:
    """Whether a prediction meets the target's size and latency (with some slack)."""
    if target.max_bytes and prediction["bytes"] > 1.2 * target.max_bytes:
        return False
    ratio = prediction["latency_ratio"]
    if target.max_latency_ratio and ratio > 1.15 * target.max_latency_ratio:
        return False
    if target.max_latency_ms and dense.get("latency_ms") and \
            ratio * dense["latency_ms"] > 1.15 * target.max_latency_ms:
        return False
    return True


def listed(target) -> list[Candidate]:
    """Every candidate of the ordered list, before ordering (the runtime's precisions;
    sparsity only where the size is counted gzipped)."""
    onnx = target.latency.runtime == "onnx"
    precisions = ("int8", "qat") if onnx else ("float16", "int8", "dynamic", "qat")
    found = [Candidate(p) for p in precisions]
    for level in CHANNEL_LEVELS:
        found += [Candidate("qat", channels=level), Candidate("float", channels=level)]
    if target.size == "gzip":
        found += [Candidate("qat", sparsity=s) for s in SPARSITY_LEVELS]
    return found


def ordered(target, dense: dict, steps_per_epoch: int, int8_fast: bool) -> list[Candidate]:
    """The list in the order it is tried: predicted to meet the size and latency target
    first, then the milder compression (more accuracy kept: likelier within the accuracy
    budget, and a miss rules the harsher out, see `ruled_out`), then the cheaper to
    fine-tune; `target.candidates - target.refine` of them."""
    def key(candidate):
        meets = feasible(predicted(candidate, target, dense, int8_fast), target, dense)
        mild = (candidate.channels or 1.0) * (1.0 - (candidate.sparsity or 0.0))
        return (not meets, -mild, candidate.updates(steps_per_epoch, target))
    return sorted(listed(target), key=key)[:target.candidates - target.refine]


def ruled_out(candidate: Candidate, measured: list[tuple[Candidate, dict]], target,
              refused: list[tuple[Candidate, str]] = ()) -> str:
    """Why the candidates measured so far say this one will miss the target ("": they do
    not): one of the same precision and sparsity that kept more channels (or of the same
    channels that was less sparse) and still lost more accuracy than the budget (a
    harsher cut loses more), or one whose file is of the same kind (int8 after training
    or after QAT alike) that kept less and was still over a size or latency limit (a
    milder cut is bigger and slower). Of the candidates `refused` at their plan (with the
    reason): a channel-pruned one refused for its channels rules out every channel level
    (a model channel pruning cannot narrow at one level cannot at another)."""
    for other, figures in measured:
        if other.reference or FILE_KIND[other.precision] != FILE_KIND[candidate.precision]:
            continue
        if other.sparsity == candidate.sparsity:
            kept, keep = other.channels or 1.0, candidate.channels or 1.0
        elif other.channels == candidate.channels:
            kept, keep = 1.0 - (other.sparsity or 0.0), 1.0 - (candidate.sparsity or 0.0)
        else:
            continue
        over = violations(figures, target)
        if over[0] > 0 and keep <= kept and other.precision == candidate.precision:
            return f"{other.name} kept as much or more and lost {figures['drop'] * 100:.2f} pt"
        # a latency miss within the timing's uncertainty (`borderline`) rules nothing out
        latency_over = max(over[2:]) > 0 and not figures.get("borderline")
        if (over[1] > 0 or latency_over) and keep >= kept:
            return f"{other.name} kept as much or less and was over the size or latency limit"
    for other, reason in refused:
        if candidate.channels and other.channels and refused_key(reason) == CHANNELS_KEY:
            return f"{other.name} was refused at its plan (channel pruning of this model)"
    return ""


# the key a run's refusal of channel pruning names (its plan's config error)
CHANNELS_KEY = "compression.pruning.structure"


def refused_key(reason: str) -> str:
    """The config key a refusal names: a config error says the key first (`KEY: what is
    wrong`, after `config error: ` in a refused run's last line)."""
    return reason.removeprefix("config error: ").split(":", 1)[0]


def proposed(history: list[tuple[Candidate, dict]], target, seed: int, tried: set[str]):
    """The next candidate Optuna's multi-objective TPE sampler proposes from what was
    measured (`history`: candidates with their figures), over the continuous knobs:
    the FLOPs kept, QAT or not, sparsity where gzipped size counts. The target's limits
    are its constraints. None when it proposes only what was tried."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spaces = {"keep": optuna.distributions.FloatDistribution(0.15, 1.0),
              "qat": optuna.distributions.CategoricalDistribution([True, False])}
    if target.size == "gzip":
        spaces["sparsity"] = optuna.distributions.FloatDistribution(0.0, 0.9)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=3)
    study = optuna.create_study(directions=["maximize", "minimize", "minimize"], sampler=sampler)
    for candidate, figures in history:
        if candidate.precision not in ("float", "qat"):
            continue
        params = {"keep": candidate.channels or 1.0, "qat": candidate.precision == "qat"}
        if "sparsity" in spaces:
            params["sparsity"] = candidate.sparsity or 0.0
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: spaces[k] for k in params},
            values=[figures["accuracy"], figures["latency_ratio"], figures["bytes"]],
            constraints=dict(zip(("accuracy", "bytes", "latency_ms", "latency_ratio"),
                                 violations(figures, target)))))
    for _ in range(20):
        trial = study.ask(spaces)
        keep = round(trial.params["keep"], 2)
        sparsity = round(trial.params.get("sparsity", 0.0), 2)
        candidate = Candidate("qat" if trial.params["qat"] else "float",
                              channels=keep if keep < 0.95 else None,
                              sparsity=sparsity if sparsity >= 0.1 else None, origin="optuna")
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        if candidate.name not in tried:
            return candidate
    return None


def violations(figures: dict, target) -> list[float]:
    """How far the figures are past each limit of the target, as shares of the limit
    (<= 0 where met): accuracy drop, bytes, latency (ms), latency ratio."""
    found = [(figures["drop"] - target.max_accuracy_drop) / max(target.max_accuracy_drop, 0.005)]
    for value, limit in ((figures["bytes"], target.max_bytes),
                         (figures["latency_ms"], target.max_latency_ms),
                         (figures["latency_ratio"], target.max_latency_ratio)):
        found.append(value / limit - 1.0 if limit else -1.0)
    return found
