"""The config schema's compression and export sections (`schema.py` holds the rest and
the checks across sections): pruning, quantization-aware training, distillation, and the
artifacts written and verified at the end."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from tftrain.core.config_types import Duration, Strict, _parse_duration, _size_bytes, size_schema

_M_BY_N = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class PruningConfig(Strict):
    """Magnitude pruning (tfmot) as its own fine-tuning stage after training."""

    enabled: bool = False
    final_sparsity: float = Field(0.8, gt=0, lt=1)
    initial_sparsity: float = Field(0.0, ge=0, lt=1)
    schedule: Literal["polynomial", "constant"] = "polynomial"
    begin: Duration = Duration(value=0, unit="steps")       # of the pruning stage
    end: Duration = Duration(value=0.7, unit="fraction")    # final sparsity reached here
    frequency: int = Field(10, ge=1)                        # updates between mask updates
    power: float = Field(3.0, gt=0)                         # polynomial schedule
    structure: str = "unstructured"        # or "M:N", e.g. "2:4", or "channels" (narrower model)
    block: Optional[tuple[int, int]] = None                 # block sparsity, e.g. [1, 4]
    block_pooling: Literal["avg", "max"] = "avg"
    layers: list[str] = []            # layer name / regex rules; empty: every prunable layer
    epochs: int = Field(4, ge=1)      # length of the pruning stage
    # constant; default: train's / 10 (structure channels: training's schedule)
    learning_rate: Optional[float] = Field(None, gt=0)
    # structure: channels: the share of the dense model's multiply-add FLOPs kept
    target_flops: float = Field(0.5, gt=0, le=1)
    # filter norm, batch-norm |gamma|, or auto: |gamma| where a group has a batch norm
    importance: Literal["l1", "l2", "bn", "auto"] = "l1"
    min_channels: int = Field(4, ge=1)              # a narrowed group keeps at least these
    channel_multiple: int = Field(8, ge=1)          # kept channels rounded to a multiple
    # the narrowed model also learns the trained wide model's logits (knowledge
    # distillation, with compression.distillation's temperature and alpha)
    distill: bool = False

    @field_validator("begin", "end", mode="before")
    @classmethod
    def _duration(cls, v):
        return _parse_duration(v)

    @field_validator("structure", mode="before")
    @classmethod
    def _structure(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):
            raise ValueError("write M:N in quotes, e.g. structure: \"2:4\" (unquoted, YAML "
                             "reads 2:4 as the number 124)")
        if v in ("unstructured", "channels"):
            return v
        m = _M_BY_N.match(str(v))
        if not m or not 0 < int(m.group(1)) < int(m.group(2)):
            raise ValueError("expected 'unstructured', 'channels' or 'M:N' with 0 < M < N "
                             "(M zeros in every N weights along the input axis), e.g. \"2:4\"")
        return f"{int(m.group(1))}:{int(m.group(2))}"

    @field_validator("block")
    @classmethod
    def _block(cls, v):
        if v is not None and min(v) < 1:
            raise ValueError("block sizes must be >= 1, e.g. [1, 4]")
        return v

    @field_validator("layers")
    @classmethod
    def _rules(cls, v):
        for rule in v:
            try:
                re.compile(rule)
            except re.error as err:
                raise ValueError(f"rule {rule!r} is not a valid regular expression ({err})")
        return v

    @model_validator(mode="after")
    def _one_structure(self):
        if self.structure != "unstructured" and self.block not in (None, (1, 1)):
            raise ValueError("compression.pruning.block: M:N structure and block sparsity "
                             "cannot be combined; set one of them")
        if self.distill and self.structure != "channels":
            raise ValueError("compression.pruning.distill: only with structure: channels (a "
                             "narrowed model learns from the wide one); remove distill")
        if self.structure == "channels" and self.layers:
            raise ValueError("compression.pruning.layers: channel pruning narrows every group "
                             "of channels the model can lose (by target_flops); remove layers")
        weights_only = ("final_sparsity", "initial_sparsity", "schedule", "begin", "end",
                        "frequency", "power", "block", "block_pooling")
        channels_only = ("target_flops", "importance", "min_channels", "channel_multiple")
        ignored = weights_only if self.structure == "channels" else channels_only
        for key in ignored:        # a value other than the default would be ignored
            if getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(
                    f"compression.pruning.{key}: has no effect with structure: "
                    f"{self.structure} (" + ("channel pruning narrows the model to "
                                             "target_flops" if self.structure == "channels"
                                             else "only structure: channels uses it")
                    + f"); remove {key}" + (" or set structure: channels"
                                            if self.structure != "channels" else ""))
        if self.initial_sparsity > self.final_sparsity:
            raise ValueError("compression.pruning.initial_sparsity: must not exceed "
                             "final_sparsity")
        return self

    @property
    def channels(self) -> bool:
        """Whole channels removed (a narrower model), not weights zeroed."""
        return self.structure == "channels"

    @property
    def m_by_n(self) -> Optional[tuple[int, int]]:
        if self.structure in ("unstructured", "channels"):
            return None
        m, n = self.structure.split(":")
        return int(m), int(n)


class QuantizationConfig(Strict):
    """8-bit quantization-aware training (tfmot) as the stage after pruning."""

    enabled: bool = False
    preserve_sparsity: bool = True     # prune-preserving QAT when pruning ran
    epochs: int = Field(2, ge=1)
    learning_rate: Optional[float] = Field(None, gt=0)   # default: train's / 10
    skip_unsupported: bool = False     # leave layers tfmot cannot quantize in float
    # activation ranges set from this many training batches before the first QAT update
    # (auto: about 2,000 examples; 0: tfmot's [-6, 6] start, moved by an EMA of 0.999)
    calibration_batches: Union[Literal["auto"], Annotated[int, Field(ge=0)]] = "auto"
    # activation ranges during QAT: moving (tfmot's EMA of each batch's min and max, per
    # replica batch under a strategy, per micro-batch when accumulating) or fixed (the
    # calibrated ranges held: the weights learn the grid the int8 file will have, and
    # replicas and accumulation compute the same updates)
    ranges: Literal["moving", "fixed"] = "moving"

    @model_validator(mode="after")
    def _fixed_needs_calibration(self):
        if self.ranges == "fixed" and self.calibration_batches == 0:
            raise ValueError("compression.quantization.ranges: fixed holds the calibrated "
                             "activation ranges, and calibration_batches: 0 calibrates none "
                             "(they would stay tfmot's [-6, 6]); set calibration_batches: auto "
                             "or ranges: moving")
        return self


class StudentConfig(Strict):
    name: str                       # registry name, or "package.module:function"
    params: dict[str, Any] = {}


class DistillationConfig(Strict):
    """Knowledge distillation as a stage after training: a smaller student learns from
    the trained model (or the SavedModel `teacher`), then goes on to pruning/QAT/export."""

    enabled: bool = False
    student: Optional[StudentConfig] = None
    teacher: Optional[str] = None     # a SavedModel directory; replaces the training stage
    temperature: float = Field(4.0, gt=0)
    alpha: float = Field(0.1, ge=0, le=1)      # weight of the labels' cross-entropy
    epochs: int = Field(10, ge=1)
    learning_rate: Optional[float] = Field(None, gt=0)   # default: training's schedule

    @model_validator(mode="after")
    def _student(self):
        if self.enabled and self.student is None:
            raise ValueError("compression.distillation.student: required when distillation "
                             "is enabled, e.g. {name: cnn, params: {filters: [8, 16]}}")
        return self


_SECONDS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)?\s*$")


def seconds_of(value) -> Optional[float]:
    """90, '90s', '30min', '1.5h' -> seconds."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    m = _SECONDS.match(str(value))
    if not m:
        raise ValueError("expected seconds, or a time like '90s', '30min' or '2h'")
    return float(m.group(1)) * {"s": 1, "sec": 1, None: 1, "min": 60, "m": 60, "h": 3600}[m.group(2)]


class LatencySetting(Strict):
    """How a deployment runs the model, for a latency target."""

    runtime: Literal["tflite", "onnx"] = "tflite"      # LiteRT (XNNPack) or ONNX Runtime
    batch: Literal[1, 32] = 1
    threads: Literal[0, 1] = 1                          # 0: every core


class TargetConfig(Strict):
    """A deployment budget `python -m tftrain.search RUN_DIR` compresses a completed
    run's dense model to: accuracy lost at most, and size and latency at most (each
    optional), measured on the deployed file on this machine."""

    # accuracy the deployed file may lose against the dense model's deployed (float) file
    max_accuracy_drop: float = Field(0.01, ge=0, le=1)
    max_bytes: Optional[int] = Field(None, gt=0, json_schema_extra=size_schema)
    max_latency_ms: Optional[float] = Field(None, gt=0)
    # of the dense model's float file of the same runtime, timed in turn with it
    max_latency_ratio: Optional[float] = Field(None, gt=0)
    latency: LatencySetting = LatencySetting()
    size: Literal["file", "gzip"] = "file"              # what max_bytes counts
    # among the candidates meeting the target, the one chosen: fastest, smallest or
    # most accurate
    objective: Literal["latency", "bytes", "accuracy"] = "latency"
    candidates: int = Field(12, ge=1)                   # the most the search tries
    time_budget: Optional[float] = Field(None, gt=0, json_schema_extra=lambda schema: schema.update(
        anyOf=[{"type": "number", "exclusiveMinimum": 0}, {"type": "string",
               "pattern": _SECONDS.pattern}, {"type": "null"}]))   # seconds; '30min', '2h'
    # each pruning candidate's stage; unset: the run's compression.pruning.epochs when
    # it pruned, else half its training epochs
    fine_tune_epochs: Optional[int] = Field(None, ge=1)
    # each QAT candidate's stage; unset: compression.quantization.epochs
    qat_epochs: Optional[int] = Field(None, ge=1)
    # of `candidates`, those a multi-objective sampler (Optuna) proposes after the ordered
    # list (pruning levels between and beyond the list's)
    refine: int = Field(3, ge=0)
    seed: int = 0

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _bytes(cls, v):
        return _size_bytes(v)

    @field_validator("time_budget", mode="before")
    @classmethod
    def _time(cls, v):
        return seconds_of(v)

    @model_validator(mode="after")
    def _refine_within(self):
        if self.refine >= self.candidates:
            raise ValueError(f"compression.target.refine: {self.refine} of "
                             f"{self.candidates} candidates would leave none to the ordered "
                             "list; set refine below candidates")
        return self


class CompressionConfig(Strict):
    distillation: DistillationConfig = DistillationConfig()
    pruning: PruningConfig = PruningConfig()
    quantization: QuantizationConfig = QuantizationConfig()
    # what `python -m tftrain.search` compresses to (plain runs leave it unused)
    target: TargetConfig = TargetConfig()


class ExportConfig(Strict):
    # every export below converted (and run once) from the untrained model before
    # training, so a conversion that cannot work is a config error, not a failure at the end
    preflight: bool = True
    saved_model: bool = True
    # export/saved_model_int8/: int8 kernels (QAT's ranges, else post-training weight-only)
    saved_model_int8: bool = False
    # model.onnx (float32) and, with an int8 TFLite model, model_int8.onnx (QDQ); [onnx] extra
    onnx: bool = False
    # model_int8.onnx's codes: auto picks what ONNX Runtime runs fastest and exactly on
    # this CPU (U8S8 with VNNI, else U8U8); S8S8 is the TFLite file's own layout
    onnx_int8_layout: Literal["auto", "U8S8", "U8U8", "S8S8"] = "auto"
    tflite: Literal["none", "float", "dynamic", "float16", "int8"] = "float"
    # also model_sparse.tflite: float, pruned weights stored sparse for XNNPack's sparse
    # inference (its rules checked on the model at plan time)
    tflite_sparse: bool = False
    calibration_examples: int = Field(200, ge=1)
    # an int8 artifact's layer adding noise below this SQNR (dB) is named in a warning
    min_layer_sqnr: float = 20.0
    max_logit_diff: float = Field(1e-3, gt=0)     # float artifacts vs the in-memory model
    max_accuracy_drop: float = Field(0.01, ge=0, le=1)   # reduced-precision artifacts
    # auto: an int8 TFLite file of a QAT model further than max_accuracy_drop from it
    # keeps its noisiest layers' kernels float, one at a time, until within (or
    # int8_fallback_layers tried); off: report and verify only; unset: auto for a QAT
    # run's int8 TFLite file (the only one it applies to)
    int8_fallback: Optional[Literal["off", "auto"]] = None
    int8_fallback_layers: int = Field(4, ge=1)
    # a TFLite or ONNX file (a model in production, the dense model) each artifact of its
    # runtime is timed against, in turn: reference_latency_grid, speedup_vs_reference
    latency_reference: Optional[str] = None

    @field_validator("latency_reference")
    @classmethod
    def _reference(cls, value):
        from pathlib import Path
        if value is not None:
            if Path(value).suffix not in (".tflite", ".onnx"):
                raise ValueError(f"{value} is not a .tflite or .onnx file; give the file a "
                                 "deployment runs")
            if not Path(value).is_file():
                raise ValueError(f"{value} does not exist; give an existing .tflite or .onnx file")
        return value

    @field_validator("int8_fallback", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        # YAML reads a bare `off` as false (and `on` as true)
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value
