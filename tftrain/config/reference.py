"""What every config key means: one description per key, the single source of the
descriptions in `--schema` (`json_schema` puts them in) and of the table in
docs/config.md (`scripts/config_reference.py` writes it; a test holds the two to each
other and to the schema: every key described, no description of a key that is gone)."""
from __future__ import annotations

DESCRIPTIONS = {
    "run": "the run's name, directory, seed and determinism",
    "distribute": "devices and the tf.distribute strategy",
    "precision": "the mixed-precision policy",
    "model": "what is trained: a bundled family, your builder, or a saved model",
    "data": "the dataset, its batches and the input pipeline",
    "train": "the training stage: epochs, batches, optimizer, schedule, checkpoints, logs",
    "compression": "the stages after training: distillation, pruning, quantization-aware training",
    "export": "the deployment artifacts, each loaded back and checked",
    "tracking": "experiment tracking",
    # run
    "run.name": "the run directory's name: `<run.dir>/<run.name>/`",
    "run.dir": "where run directories go",
    "run.seed": "seeds the weights, the data split and each epoch's shuffle",
    "run.deterministic": "op determinism (`tf.config.experimental.enable_op_determinism`): the "
                         "same weights on every rerun; no clocks in the step (input wait not measured)",
    "run.allow_batch_change": "a resume may change the global batch (the learning rate scaled "
                              "to it, recorded in summary.json; not the same result)",
    # distribute
    "distribute.strategy": "`auto`, `default`, `one_device`, `mirrored`, `multi_worker`",
    "distribute.devices": "explicit device list, e.g. `[\"/gpu:0\", \"/gpu:1\"]`; checked to exist",
    "distribute.virtual_cpus": "split the CPU into N logical devices (data parallel without GPUs)",
    "distribute.gpu_memory_growth": "allocate GPU memory as needed",
    "distribute.gpu_memory_limit": "per-GPU memory cap (`\"8GB\"`)",
    "distribute.device_memory": "memory to plan for, per device (bytes or `\"16GB\"`); default: "
                                "the GPU's, or the host's available memory on CPUs",
    "distribute.cross_device_ops": "mirrored: `nccl`, `hierarchical_copy`, `reduce_to_one_device` "
                                   "(`auto`: NCCL on GPUs, else reduce to one device)",
    "distribute.peer_wait": "seconds a Kubernetes JobSet pod waits for every peer's name to "
                            "resolve and its port to answer before training; then exit 2 naming "
                            "the missing one",
    "distribute.communication": "multi-worker collectives: `ring`, `nccl`, `auto`",
    "distribute.all_reduce_dtype": "`float16` or `bfloat16` casts gradients for the all-reduce "
                                   "only (half the bytes on the wire)",
    "distribute.pack_bytes": "multi-worker: the gradient all-reduce in packs of about this size "
                             "(`4MiB`), launched as their gradients exist; null: one pack",
    # precision
    "precision.policy": "`float32`, `mixed_float16`, `mixed_bfloat16`, `auto` (from the devices)",
    "precision.loss_scale": "float16 only: `dynamic` or a fixed number",
    "precision.initial_scale": "float16, dynamic loss scale: the scale it starts from",
    # model
    "model.name": "a bundled family (`mlp`, `cnn`, `resnet`, `transformer`, `embedding_bag`, `tfidf_linear`, "
                  "`ds_cnn`, `conv1d`), `keras_applications:NAME`, `package.module:function` "
                  "(tf_keras or Keras 3) or `file:PATH` (a `.keras`, `.h5` or Keras SavedModel): "
                  "see [bring your own model](bring_your_own_model.md)",
    "model.params": "the builder's keyword arguments, checked against its signature before "
                    "TensorFlow loads",
    "model.placement": "model parallelism, see [Model parallelism](model_parallelism.md)",
    "model.placement.devices": "one device per stage of layers",
    "model.placement.stages": "`auto`, or per-stage name/regex rules",
    "model.placement.balance": "`auto` stages balance `params`, `flops` or `memory`",
    "model.trust_code": "load a model file (`model.name: file:PATH`, a distillation teacher) that carries code: Lambda layers' bytecode, graph ops reaching outside the model (files, Python); `false` refuses such a file, naming what it found, before any of it runs",
    "model.placement.microbatches": "micro-batches each batch is split into along the pipeline; `auto`: 1, 2, 4 or 8, whichever step measured fastest on the placed model (the planner's own placement uses it)",
    # data
    "data.name": "`digits`, `synthetic`, `npz`, `tfrecord`, `image_folder`, `audio_folder`, "
                 "`text`, `tfds:NAME`, `keras:mnist` and the like, or `package.module:function` "
                 "(see [Data](data.md))",
    "data.params": "the loader's arguments (e.g. `path`), checked against its signature",
    "data.per_replica_batch_size": "examples per replica per micro-batch",
    "data.validation_fraction": "held-out fraction (a seeded split; whole files for record files)",
    "data.shuffle": "shuffle every epoch (a function of `run.seed` and the epoch)",
    "data.shuffle_buffer": "record files: the window of records permuted together",
    "data.cache": "`auto` (the decoded set in memory when it fits `cache_budget`), `memory`, `none`",
    "data.cache_budget": "bytes of decoded training data `auto` may hold in memory (`\"4GB\"`)",
    "data.feed": "`auto` (from the device when the training set is in memory, has no per-example augmentation or tf.data service, and a copy per device fits 1/8 of a device), `device` (batches gathered on each replica's device inside the step), `host` (the tf.data pipeline)",
    "data.remainder": "an epoch's last partial update: `drop`, or `pad` (padding weighs 0)",
    "data.shard_policy": "multi-worker: `file`, `data`, `auto` (file when the files suffice)",
    "data.augment": "augmentation and preprocessing, e.g. `[{random_crop: {padding: 4}}, "
                    "random_flip, {normalize: {mean: 0.5, std: 0.25}}]`; your own as "
                    "`{package.module:function: {params}}`, `function(x, seed, **params)`",
    "data.service": "run the input pipeline on tf.data service workers",
    "data.service.dispatchers": "the dispatchers' addresses, `grpc://host:port`",
    "data.on_bad_record": "an unreadable file or record: `fail` (a config error naming it) or "
                          "`skip` (counted)",
    # train
    "train.epochs": "epochs of training; 0 evaluates the starting model and hands it on",
    "train.accumulation_steps": "micro-batches per optimizer update",
    "train.global_batch_size": "if set, per-replica batch = global / (replicas x accumulation)",
    "train.steps_per_execution": "steps per `tf.function` call; `auto` sizes calls so the host's "
                                 "work stays under 2% of the step time",
    "train.jit_compile": "XLA for each replica's gradients: `auto` (measured, within 10% of the "
                         "planned steps, cached per model and machine), `true`, `false`",
    "train.check_every": "the run's checks (non-finite loss, a stop) every N updates",
    "train.log_every": "training metrics and learning rate every N updates into updates.csv and "
                       "TensorBoard; `auto` about 100 points a stage, every update under --smoke",
    "train.optimizer": "the optimizer",
    "train.optimizer.name": "`sgd`, `adam`, `adamw`, `rmsprop`",
    "train.optimizer.learning_rate": "the peak learning rate (the schedule scales it)",
    "train.optimizer.weight_decay": "decoupled weight decay",
    "train.optimizer.clipnorm": "clip each gradient to this norm",
    "train.optimizer.global_clipnorm": "clip all gradients together to this norm",
    "train.optimizer.params": "the optimizer's other arguments, e.g. `{momentum: 0.9}`",
    "train.schedule": "the learning-rate schedule, in optimizer updates",
    "train.schedule.name": "`constant`, `step`, `multistep`, `exponential`, `polynomial`, "
                           "`cosine`, `plateau` (each takes its own fields)",
    "train.schedule.warmup_steps": "linear warmup from 0 (all but plateau); a duration",
    "train.schedule.step_size": "step: updates between decays (a duration)",
    "train.schedule.gamma": "step, multistep: the factor of each decay",
    "train.schedule.milestones": "multistep: the updates the rate decays at (increasing durations)",
    "train.schedule.decay_steps": "exponential, polynomial, cosine: the decay's length (a duration)",
    "train.schedule.decay_rate": "exponential: the factor per `decay_steps`",
    "train.schedule.staircase": "exponential: decay in steps rather than continuously",
    "train.schedule.end_learning_rate": "polynomial: the rate it ends at",
    "train.schedule.power": "polynomial: the curve's power",
    "train.schedule.alpha": "cosine: the final rate as a fraction of the peak",
    "train.schedule.factor": "plateau: the factor a plateau cuts the rate by",
    "train.schedule.patience": "plateau: epochs without improvement before a cut",
    "train.schedule.min_lr": "plateau: the lowest rate",
    "train.schedule.min_delta": "plateau: the least change that counts as improvement",
    "train.schedule.monitor": "plateau: the logged metric watched (e.g. `val_loss`)",
    "train.loss": "the loss (models output logits); `sparse_categorical_crossentropy` and others",
    "train.metrics": "metrics logged per epoch and update, e.g. `[accuracy]`",
    "train.early_stopping": "stop when a metric stops improving",
    "train.early_stopping.monitor": "the logged metric watched",
    "train.early_stopping.patience": "epochs without improvement before stopping",
    "train.early_stopping.min_delta": "the least change that counts as improvement",
    "train.early_stopping.restore_best_weights": "end with the best epoch's weights",
    "train.checkpoint": "checkpoints of every stage (resume after a stop or a kill)",
    "train.checkpoint.every": "updates between checkpoints (a duration: `1 epochs`)",
    "train.checkpoint.keep": "checkpoints kept",
    "train.on_nan": "non-finite loss: `stop` (exit 1) or `rollback` to the last good checkpoint",
    "train.nan_retries": "rollback: retries before giving up",
    "train.nan_lr_factor": "rollback: the learning-rate multiplier per rollback",
    "train.smoke_steps": "batches per stage under `--smoke` (which keeps the configured strategy)",
    "train.verbose": "0 quiet, 1 Keras' progress bar, 2 one line per epoch (and progress with an "
                     "ETA inside a long epoch)",
    "train.ema": "an exponential moving average of the weights, used at the end",
    "train.ema.decay": "the average's decay per update",
    "train.ema.recalibrate_batches": "micro-batches (data.per_replica_batch_size examples) the averages' batch-norm statistics are re-estimated on",
    "train.freeze": "a frozen-backbone stage before training",
    "train.freeze.layers": "name/regex rules of the frozen layers (default: all but the output)",
    "train.freeze.epochs": "epochs of the frozen stage",
    "train.freeze.learning_rate": "its constant learning rate (default: training's)",
    "train.recalibrate_batch_norm": "re-estimate batch-norm statistics at a stage's end: `auto` "
                                    "(about 2,048 examples), N micro-batches, or `off`",
    "train.recompute": "activations recomputed in the backward pass: `none`, `blocks` (segments "
                       "between single tensors, about sqrt(layers) each), `{every: K}` layers, or "
                       "`auto` (the planner adds it where the step would not fit otherwise and it "
                       "is the fastest way that fits; see [Activation recomputation]"
                       "(training.md#activation-recomputation))",
    "train.recompute.every": "layers per recomputed segment",
    # compression
    "compression.pruning": "pruning as a stage after training (see [Compression](compression.md))",
    "compression.pruning.enabled": "run the pruning stage",
    "compression.pruning.final_sparsity": "fraction of each pruned weight tensor left zero",
    "compression.pruning.initial_sparsity": "fraction zero when pruning begins",
    "compression.pruning.schedule": "`polynomial` or `constant` sparsity over the stage",
    "compression.pruning.begin": "when masks start being updated (a duration of the stage)",
    "compression.pruning.end": "when the final sparsity is reached (a duration or fraction)",
    "compression.pruning.frequency": "updates between mask updates",
    "compression.pruning.power": "the polynomial schedule's power",
    "compression.pruning.structure": "`unstructured`, `\"M:N\"` (e.g. `\"2:4\"`), or `channels` "
                                     "(a narrower model)",
    "compression.pruning.block": "block sparsity, e.g. `[1, 4]`",
    "compression.pruning.block_pooling": "how a block's magnitude is taken: `avg` or `max`",
    "compression.pruning.layers": "name/regex rules of the layers pruned (default: every one)",
    "compression.pruning.epochs": "epochs of the pruning stage",
    "compression.pruning.learning_rate": "a constant rate (default: training's / 10; channels: "
                                         "training's schedule)",
    "compression.pruning.target_flops": "channels: the share of the dense model's FLOPs kept",
    "compression.pruning.importance": "channels: `l1`, `l2` (filter norms), `bn` (batch-norm scales) or `auto` (`bn` where a group has a batch norm, else `l1`)",
    "compression.pruning.min_channels": "channels: the fewest a group keeps",
    "compression.pruning.channel_multiple": "channels: kept channels rounded to a multiple of this",
    "compression.pruning.distill": "channels: the narrowed model also learns the wide model's logits",
    "compression.quantization": "quantization-aware training as a stage after pruning",
    "compression.quantization.enabled": "run QAT (then `export.tflite` is `int8`)",
    "compression.quantization.preserve_sparsity": "keep pruning's zeros (prune-preserving QAT)",
    "compression.quantization.epochs": "epochs of QAT",
    "compression.quantization.learning_rate": "its constant rate (default: training's / 10)",
    "compression.quantization.skip_unsupported": "leave layers tfmot cannot quantize float",
    "compression.quantization.calibration_batches": "activation ranges from training batches "
                                                    "before the first update: `auto` or N micro-batches (0: [-6, 6])",
    "compression.quantization.ranges": "activation ranges during QAT: `moving` (tfmot's EMA "
                                       "of each batch's) or `fixed` (the calibrated ones held; "
                                       "replicas and accumulation agree exactly)",
    "compression.distillation": "a smaller student learns from the trained model (see "
                                "[Distillation](training.md#distillation))",
    "compression.distillation.enabled": "run the distillation stage",
    "compression.distillation.student": "the student model",
    "compression.distillation.student.name": "the student's builder (as `model.name`)",
    "compression.distillation.student.params": "the student builder's arguments",
    "compression.distillation.teacher": "a SavedModel to learn from (default: this run's model)",
    "compression.distillation.temperature": "the softmax temperature of the soft targets",
    "compression.distillation.alpha": "the weight of the hard labels' loss",
    "compression.distillation.epochs": "epochs of distillation",
    "compression.distillation.learning_rate": "a constant rate (default: training's schedule)",
    "compression.target": "the deployment budget `python -m tftrain.search RUN_DIR` compresses "
                          "to (see [compression to a budget](compression_search.md))",
    "compression.target.max_accuracy_drop": "accuracy the deployed file may lose against the dense "
                                            "model's float file",
    "compression.target.max_bytes": "the deployed file's size at most, e.g. `300KB`",
    "compression.target.max_latency_ms": "ms per example at most, as `latency` runs it",
    "compression.target.max_latency_ratio": "latency at most this share of the dense float file's "
                                            "(of the same runtime, timed in turn)",
    "compression.target.latency": "how a deployment runs the file, for the latency targets",
    "compression.target.latency.runtime": "`tflite` (LiteRT, XNNPack) or `onnx` (ONNX Runtime)",
    "compression.target.latency.batch": "examples per call: 1 or 32",
    "compression.target.latency.threads": "1, or 0 for every core",
    "compression.target.size": "what `max_bytes` counts: the `file`, or the file `gzip`ped",
    "compression.target.objective": "among candidates meeting the target, the one chosen: least "
                                    "`latency`, fewest `bytes` or most `accuracy`",
    "compression.target.candidates": "the most candidates the search fine-tunes and measures",
    "compression.target.time_budget": "the search stops starting candidates after this long "
                                      "(seconds, or `30min`, `2h`)",
    "compression.target.fine_tune_epochs": "epochs each pruning candidate fine-tunes from the dense "
                                           "model (unset: the run's pruning epochs if it pruned, "
                                           "else half its training epochs)",
    "compression.target.qat_epochs": "epochs of each candidate's quantization-aware training "
                                     "(unset: `compression.quantization.epochs`)",
    "compression.target.refine": "of `candidates`, those Optuna's multi-objective sampler proposes "
                                 "after the ordered list",
    "compression.target.seed": "the sampler's seed",
    # export
    "export.saved_model": "a SavedModel with a `serving_default` signature (`inputs` -> `logits`)",
    "export.saved_model_int8": "also a SavedModel whose kernels are int8 codes with scales",
    "export.tflite": "`none`, `float`, `dynamic`, `float16`, `int8` (calibrated on training examples)",
    "export.tflite_sparse": "also the float TFLite file with pruned weights stored sparse (XNNPack)",
    "export.onnx": "also ONNX (extra `[onnx]`): float, and int8 where there is an int8 TFLite file",
    "export.onnx_int8_layout": "`auto`, `U8S8`, `U8U8`, `S8S8`: the int8 ONNX file's codes",
    "export.calibration_examples": "training examples int8 post-training quantization calibrates on",
    "export.preflight": "convert and check every export from the untrained model before training "
                        "(a converter refusing it: exit 2, nothing written)",
    "export.min_layer_sqnr": "dB: an int8 artifact's layer adding more noise is named (and fails "
                             "an untrained or --smoke model's check)",
    "export.max_logit_diff": "largest logit difference a float artifact may show from the model (times its largest logit, when above 1)",
    "export.max_accuracy_drop": "accuracy a reduced-precision artifact may lose against the model",
    "export.int8_fallback": "`auto`: a QAT model's int8 file beyond `max_accuracy_drop` keeps its "
                            "noisiest layers float, one at a time, until within it; `off`; "
                            "unset: `auto` for a QAT run's int8 TFLite file",
    "export.int8_fallback_layers": "the most layers `int8_fallback` tries",
    "export.latency_reference": "a `.tflite` or `.onnx` file each artifact of its runtime is "
                                "timed against, in turn (`speedup_vs_reference` in the summary)",
    # tracking
    "tracking.mlflow": "log the run to MLflow (extra `[mlflow]`)",
    "tracking.mlflow.uri": "the tracking URI (`sqlite:///mlflow.db`, `http://host:5000`)",
    "tracking.mlflow.experiment": "the experiment's name",
    "tracking.mlflow.artifact_location": "where a new experiment keeps its artifacts",
}


def leaves(schema: dict) -> dict[str, dict]:
    """{dotted key: its schema} of every key of `schema` (a section and its keys both)."""
    defs = schema.get("$defs", {})
    found: dict[str, dict] = {}

    def resolve(node):
        return defs[node["$ref"].split("/")[-1]] if "$ref" in node else node

    def walk(node, prefix):
        if _duration(node):
            return                   # a duration is one value (`2 epochs`, `0.7`, `100`)
        node = resolve(node)
        sections = [resolve(x) for x in node.get("anyOf", []) + node.get("oneOf", [])
                    if "properties" in resolve(x)]
        for sub in ([node] if "properties" in node else sections):
            for key, value in sub["properties"].items():
                path = f"{prefix}.{key}" if prefix else key
                found.setdefault(path, value)
                walk(value, path)
    walk(schema, "")
    return found


def _duration(node: dict) -> bool:
    refs = [node.get("$ref", "")] + [x.get("$ref", "") for x in node.get("anyOf", [])]
    return any(r.endswith("/Duration") for r in refs)


def describe(schema: dict) -> dict:
    """`schema` with each key's description (in place, and returned)."""
    defs = schema.get("$defs", {})

    def walk(node, prefix):
        if "$ref" in node:
            node = defs[node["$ref"].split("/")[-1]]
        for sub in [node, *node.get("anyOf", []), *node.get("oneOf", [])]:
            if "$ref" in sub:
                sub = defs[sub["$ref"].split("/")[-1]]
            for key, value in sub.get("properties", {}).items():
                path = f"{prefix}.{key}" if prefix else key
                if path in DESCRIPTIONS:
                    value["description"] = DESCRIPTIONS[path]
                walk(value, path)
    walk(schema, "")
    return schema
