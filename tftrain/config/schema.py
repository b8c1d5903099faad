"""The config schema: typed, frozen, unknown keys forbidden (loading: `loading.py`).

`load_config(path, overrides)` reads a YAML file with a safe loader, applies
`key.path=value` overrides (values parsed as YAML scalars or lists) and validates the
result. Every problem becomes one line naming the file, the key path, the bad value and
what is expected; they are raised together as a `ConfigError`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator


from tftrain.core.config_types import (Duration, Strict, _parse_duration,  # noqa: F401
                                       _size_bytes, size_schema)
from tftrain.optim.schedules import Constant as ConstantSchedule
from tftrain.optim.schedules import ScheduleConfig  # noqa: F401  (one model per schedule)
from tftrain.config.compression import CompressionConfig, ExportConfig
from tftrain.optim.configs import OptimizerConfig


# --- sections ------------------------------------------------------------------------
class RunConfig(Strict):
    name: str = Field("run", pattern=r"^[A-Za-z0-9_.-]+$")
    dir: str = "runs"
    seed: int = 42
    deterministic: bool = False
    # resume on a topology with another global batch: positions move to the same example
    # of the epoch, the learning rate scales with the batch (inexact: summary.json records it)
    allow_batch_change: bool = False

    @field_validator("name")
    @classmethod
    def _a_directory_of_its_own(cls, v):
        if set(v) == {"."}:           # "." and ".." name run.dir itself or its parent
            raise ValueError("must name a directory inside run.dir, not '.' or '..'; use "
                             "letters, digits, '_', '-' or '.' (e.g. quickstart)")
        return v


class DistributeConfig(Strict):
    strategy: Literal["auto", "default", "one_device", "mirrored", "multi_worker"] = "auto"
    devices: Optional[list[str]] = None
    virtual_cpus: Optional[int] = Field(None, ge=1, le=64)
    device_memory: Optional[int] = Field(None, json_schema_extra=size_schema)
    gpu_memory_growth: bool = True
    gpu_memory_limit: Optional[int] = Field(None, json_schema_extra=size_schema)
    cross_device_ops: Literal["auto", "nccl", "hierarchical_copy", "reduce_to_one_device"] = "auto"
    communication: Literal["auto", "ring", "nccl"] = "auto"
    all_reduce_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    # multi-worker: gradients all-reduced in packs of about this size (e.g. 4MiB), each
    # launched once its gradients exist, so communication overlaps the rest of the
    # backward pass; null: TensorFlow's default, one pack per update
    pack_bytes: Optional[int] = Field(None, json_schema_extra=size_schema)
    # a Kubernetes JobSet pod waits this many seconds for every peer to answer before
    # TensorFlow starts, then exits 2 naming one that did not
    peer_wait: float = Field(300.0, gt=0)

    @field_validator("device_memory", "gpu_memory_limit", "pack_bytes", mode="before")
    @classmethod
    def _sizes(cls, v):
        return _size_bytes(v)


class PrecisionConfig(Strict):
    policy: Literal["auto", "float32", "mixed_float16", "mixed_bfloat16"] = "auto"
    loss_scale: Union[Literal["dynamic"], float] = "dynamic"
    initial_scale: float = Field(2.0**15, gt=0)

    @field_validator("loss_scale")
    @classmethod
    def _positive(cls, v):
        if v != "dynamic" and v <= 0:
            raise ValueError("a fixed loss scale must be > 0 (or use 'dynamic')")
        return v


class PlacementConfig(Strict):
    devices: list[str]
    stages: Union[Literal["auto"], list[list[str]]] = "auto"
    balance: Literal["params", "flops", "memory"] = "params"
    # `auto`: the count of 1, 2, 4 or 8 (dividing the batch) whose step measured fastest
    microbatches: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = 1


class ModelConfig(Strict):
    name: str = "cnn"
    params: dict[str, Any] = {}
    placement: Optional[PlacementConfig] = None
    # a model file (and a distillation teacher file) may carry code that runs when it is
    # loaded or computes: refused unless this says the file is trusted
    trust_code: bool = False


class ServiceConfig(Strict):
    """tf.data service: the input pipeline runs on data workers, one per dispatcher
    (`python -m tftrain.launch --data-workers N` starts N locally)."""
    dispatchers: list[str] = Field(min_length=1)     # e.g. [grpc://host-a:5050, ...]

    @field_validator("dispatchers", mode="before")
    @classmethod
    def _one_or_more(cls, v):
        return [v] if isinstance(v, str) else v


class DataConfig(Strict):
    name: str = "digits"
    params: dict[str, Any] = {}
    per_replica_batch_size: int = Field(32, ge=1)
    shuffle: bool = True
    shuffle_buffer: Optional[int] = Field(None, ge=1)     # streaming sources: 10,000 records
    cache: Literal["auto", "memory", "none"] = "auto"
    cache_budget: int = Field(1_000_000_000, json_schema_extra=size_schema)  # decoded training data
    # where training batches are made: `device` gathers them from an in-memory training
    # set held on every replica's device, inside the step; `host` runs the tf.data pipeline
    feed: Literal["auto", "device", "host"] = "auto"
    remainder: Literal["drop", "pad"] = "drop"
    shard_policy: Literal["auto", "file", "data"] = "auto"
    augment: list[Union[str, dict[str, Any]]] = []
    service: Optional[ServiceConfig] = None
    on_bad_record: Literal["fail", "skip"] = "fail"
    validation_fraction: float = Field(0.15, ge=0.0, lt=1.0)

    @field_validator("cache_budget", mode="before")
    @classmethod
    def _budget(cls, v):
        return _size_bytes(v)


class CheckpointConfig(Strict):
    every: Duration = Duration(value=1, unit="epochs")
    keep: int = Field(3, ge=1)

    @field_validator("every", mode="before")
    @classmethod
    def _duration(cls, v):
        return _parse_duration(v)


class EarlyStoppingConfig(Strict):
    monitor: str = "val_loss"
    patience: int = Field(5, ge=1)
    min_delta: float = Field(0.0, ge=0)
    restore_best_weights: bool = False


class EMAConfig(Strict):
    """An exponential moving average of the weights (see `tftrain/optim/averaging.py`)."""
    decay: float = Field(0.999, gt=0, lt=1)
    recalibrate_batches: int = Field(20, ge=0)   # batch-norm statistics for the averages


class RecomputeEvery(Strict):
    """Activations recomputed over segments of `every` layers each."""
    every: int = Field(ge=1)


class FreezeConfig(Strict):
    """A frozen-backbone phase before training (fine-tuning a pretrained model)."""
    layers: list[str] = []            # name / regex rules; empty: all but the output layer
    epochs: int = Field(1, ge=1)
    learning_rate: Optional[float] = Field(None, gt=0)   # default: training's


class TrainConfig(Strict):
    # 0: no training; the model as built or loaded (model.name: file:PATH) is evaluated,
    # its batch-norm statistics re-estimated if asked, and handed to the later stages
    epochs: int = Field(10, ge=0)
    accumulation_steps: int = Field(1, ge=1)
    global_batch_size: Optional[int] = Field(None, ge=1)
    # steps per tf.function call: auto sizes it after a few steps so that host work per
    # call stays under 2% of the step time (and a call under a second)
    steps_per_execution: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    # XLA for the replica gradients: auto measures both on one batch and keeps the faster
    jit_compile: Union[Literal["auto"], bool] = "auto"
    # the run's checks (non-finite loss, stop signal; one small all-reduce in a cluster)
    # at the first call's end at or after every N updates
    check_every: int = Field(1, ge=1)
    # training metrics and the learning rate every N updates, into updates.csv and
    # TensorBoard: auto about 100 points a stage (every update under --smoke)
    log_every: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ConstantSchedule()
    loss: str = "sparse_categorical_crossentropy"
    metrics: list[str] = ["accuracy"]
    early_stopping: Optional[EarlyStoppingConfig] = None
    checkpoint: CheckpointConfig = CheckpointConfig()
    on_nan: Literal["stop", "rollback"] = "stop"
    nan_retries: int = Field(3, ge=0)
    nan_lr_factor: float = Field(0.5, gt=0, le=1)
    smoke_steps: int = Field(3, ge=1)
    verbose: Literal[0, 1, 2] = 2
    ema: Optional[EMAConfig] = None
    freeze: Optional[FreezeConfig] = None    # a frozen-backbone phase before training
    # re-estimate batch-norm moving statistics at the end of each stage (PreciseBN):
    # auto (about 2,000 examples, at most an epoch), a number of batches, or off (YAML's
    # bare off/on read as false/true)
    recalibrate_batch_norm: Union[Literal["auto", "off"], bool, Annotated[int, Field(ge=1)]] = "auto"
    # activations recomputed in the backward pass (tftrain/training/recompute.py): none,
    # blocks (segments between single tensors: residual blocks, transformer layers), every
    # K layers ({every: K}), or auto (the planner adds blocks where the step would not fit
    # distribute.device_memory otherwise and recomputing is the fastest way that fits)
    recompute: Union[Literal["none", "blocks", "auto"], RecomputeEvery] = "none"

    def segmenting(self) -> tuple[str, int | None] | None:
        """How `recompute` cuts the model (`tftrain.runtime.segments`): ("blocks", None)
        (also for auto, where the planner adds it), ("every", K), or None for none."""
        if self.recompute == "none":
            return None
        if isinstance(self.recompute, RecomputeEvery):
            return "every", self.recompute.every
        return "blocks", None

    @field_validator("schedule", mode="before")
    @classmethod
    def _constant_by_default(cls, v):
        return {**v, "name": "constant"} if isinstance(v, dict) and "name" not in v else v

    @model_validator(mode="after")
    def _monitors(self):
        known = self.monitors()
        watched = [("train.early_stopping.monitor", self.early_stopping)] + (
            [("train.schedule.monitor", self.schedule)] if self.schedule.name == "plateau" else [])
        for key, section in watched:
            if section is not None and section.monitor not in known:
                raise ValueError(f"{key}: '{section.monitor}' is not a logged metric; use one "
                                 f"of {', '.join(known)}")
        if self.ema and self.early_stopping and self.early_stopping.restore_best_weights:
            # both choose the weights training ends with: the average would silently
            # replace the best epoch's weights that early stopping restored
            raise ValueError("train.ema: the weight average replaces the final weights, so "
                             "train.early_stopping.restore_best_weights would be undone; set "
                             "restore_best_weights: false to keep the average (early stopping "
                             "still ends training), or remove train.ema to keep the best epoch")
        return self

    def monitors(self) -> list[str]:
        """The epoch-log names a callback can monitor: the loss and each metric, on the
        training data and (val_) on the validation data."""
        names = ["loss", *self.metrics]
        return names + [f"val_{n}" for n in names]


class MlflowConfig(Strict):
    uri: str = Field(..., min_length=1)  # tracking URI: sqlite:///mlflow.db, http://host:5000
    experiment: str = Field("tftrain", min_length=1)
    # where a new experiment keeps its artifacts; null: the server's choice, or for a
    # sqlite:///PATH store, mlartifacts/ beside the database (not the working directory)
    artifact_location: Optional[str] = None


class TrackingConfig(Strict):
    # the chief logs the run once: config as params, per-epoch metrics, summary, artifacts
    mlflow: Optional[MlflowConfig] = None


class Config(Strict):
    run: RunConfig = RunConfig()
    distribute: DistributeConfig = DistributeConfig()
    precision: PrecisionConfig = PrecisionConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    compression: CompressionConfig = CompressionConfig()
    export: ExportConfig = ExportConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="before")
    @classmethod
    def _int8_after_qat(cls, data):
        """A quantization-aware trained model exports int8 TFLite unless told otherwise."""
        if isinstance(data, dict):
            quantization = (data.get("compression") or {}).get("quantization") or {}
            export = data.get("export") or {}
            if isinstance(quantization, dict) and quantization.get("enabled") is True \
                    and isinstance(export, dict) and "tflite" not in export:
                data = {**data, "export": {**export, "tflite": "int8"}}
        return data

    @model_validator(mode="after")
    def _combinations(self):
        placement = self.model.placement
        if self.compression.quantization.enabled and self.export.tflite not in ("none", "int8"):
            raise ValueError(f"export.tflite: a quantization-aware trained model exports as "
                             f"int8, not {self.export.tflite}; set export.tflite: int8 (or "
                             "disable compression.quantization)")
        if self.export.int8_fallback == "auto" and not (
                self.compression.quantization.enabled and self.export.tflite == "int8"):
            raise ValueError("export.int8_fallback: auto falls back layers of a "
                             "quantization-aware trained model's int8 TFLite file; enable "
                             "compression.quantization with export.tflite: int8, or set "
                             "export.int8_fallback: off")
        if placement is not None and self.distribute.strategy not in ("auto", "default"):
            raise ValueError(f"distribute.strategy: model.placement places one model copy over "
                             f"its devices and cannot be combined with "
                             f"'{self.distribute.strategy}'; set distribute.strategy: auto")
        if placement is not None and self.train.recompute not in ("none", "auto"):
            raise ValueError("train.recompute: a placed model's stages run on devices of their "
                             "own, and a segment recomputed in the backward pass would not "
                             "stay on its stage's device; set train.recompute: none (or auto) "
                             "or remove model.placement")
        if placement is not None and (self.compression.pruning.enabled
                                      or self.compression.quantization.enabled):
            raise ValueError("model.placement: compression stages run on one device or data "
                             "parallel; remove model.placement or disable compression")
        return self
