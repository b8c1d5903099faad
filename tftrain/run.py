"""`python -m tftrain.run CONFIG`: the whole pipeline, top to bottom.

config -> plan -> strategy -> precision -> data -> model -> optimizer -> fit ->
evaluate -> export -> verify -> summary.json and a report table.

Exit codes: 0 done, 2 bad config or arguments, 1 runtime failure, 42 stopped by
SIGTERM after saving a checkpoint (rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import tftrain  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
from tftrain.config import Config, ConfigError, json_schema, load_config

EXIT_CONFIG, EXIT_RUNTIME, EXIT_PREEMPTED = 2, 1, 42


class Preempted(Exception):
    """Training stopped by SIGTERM after a checkpoint was saved."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"arguments: {message}; see python -m tftrain.run --help")


def parse_args(argv):
    p = _Parser(prog="python -m tftrain.run", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key by dotted path (repeatable)")
    p.add_argument("--run-dir", help="parent directory of the run (overrides run.dir)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--smoke", action="store_true",
                   help="whole pipeline on a few batches on one device")
    p.add_argument("--schema", action="store_true", help="print the config JSON Schema")
    return p.parse_args(argv)


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.schema:
            print(json.dumps(json_schema(), indent=2))
            return 0
        if not args.config:
            raise ConfigError("arguments: CONFIG is required, e.g. python -m tftrain.run "
                              "configs/quickstart.yaml")
        overrides = args.set + ([f"run.dir={args.run_dir}"] if args.run_dir else [])
        cfg = load_config(args.config, overrides)
        run(cfg, dry_run=args.dry_run, smoke=args.smoke)
        return 0
    except ConfigError as err:
        for problem in err.problems:
            print(f"tftrain: config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    except Preempted as err:
        print(f"tftrain: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("tftrain: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_RUNTIME
    except Exception as err:  # runtime failure: one clear line, details after it
        traceback.print_exc()
        print(f"tftrain: error: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_RUNTIME


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: `train`, then `prune` and `qat` when enabled."""
    name: str
    epochs: int
    updates: int
    learning_rate: float | None = None    # None: train's schedule


def plan_stages(cfg: Config, steps_per_epoch: int, smoke: bool = False) -> list[Stage]:
    """The stages this config runs, each with its length in optimizer updates."""
    comp, lr = cfg.compression, cfg.train.optimizer.learning_rate

    def epochs(n):
        return 1 if smoke else n

    stages = [Stage("train", epochs(cfg.train.epochs), epochs(cfg.train.epochs) * steps_per_epoch)]
    if comp.pruning.enabled:
        n = epochs(comp.pruning.epochs)
        stages.append(Stage("prune", n, n * steps_per_epoch, comp.pruning.learning_rate or lr / 10))
    if comp.quantization.enabled:
        n = epochs(comp.quantization.epochs)
        stages.append(Stage("qat", n, n * steps_per_epoch,
                            comp.quantization.learning_rate or lr / 10))
    return stages


def run(cfg: Config, dry_run: bool = False, smoke: bool = False) -> dict | None:
    """Run the pipeline for `cfg`; returns the summary (None for a dry run)."""
    # TensorFlow is imported only once the config has parsed: a typo costs no TF start-up.
    import tensorflow as tf

    from tftrain import compression, data, export, placement, planner, precision, rundir, strategy
    from tftrain._keras import keras
    from tftrain.models import build_model

    # -- plan: devices, strategy, precision, data, batches, stages (nothing written yet) --
    _reject_unavailable(cfg)
    strategy.configure_devices(cfg)                  # logical devices first, before any op
    if smoke or strategy.cluster_spec()[1] > 1:      # then the collectives, before all else
        strat = strategy.build_strategy(cfg, force_one_device=smoke)
    keras.backend.experimental.enable_tf_random_generator()   # RNG state checkpointable
    if cfg.run.deterministic:
        tf.config.experimental.enable_op_determinism()
    policy = precision.choose_policy(cfg.precision)
    precision.apply_policy(policy)
    source = data.load_source(cfg.data, cfg.run.seed)
    placed, memory_plan = None, None
    if not (smoke or strategy.cluster_spec()[1] > 1):
        strat, placed, memory_plan = _parallelism(cfg, policy, source)
    info = strategy.describe(strat) if placed is None else strategy.StrategyInfo(
        "model_parallel", placed.devices, 1, 1)
    plan = data.plan_batches(cfg, info.replicas, memory_plan.accumulation
                             if memory_plan and cfg.train.global_batch_size else None)
    if placed and plan.per_replica % placed.microbatches:
        raise ConfigError(f"model.placement.microbatches: {placed.microbatches} does not divide "
                          f"the batch of {plan.per_replica}; use a divisor of it")
    steps_per_epoch = plan.steps_per_epoch(source.num_train)
    if smoke:
        steps_per_epoch = min(steps_per_epoch, cfg.train.smoke_steps)
    stages = plan_stages(cfg, steps_per_epoch, smoke)
    pruning = next((compression.plan_pruning(cfg.compression.pruning, steps_per_epoch, s.updates)
                    for s in stages if s.name == "prune"), None)

    # -- the training stage's model and optimizer, built inside the strategy scope -------
    keras.utils.set_random_seed(cfg.run.seed)    # the same initial weights on every path
    with strat.scope():
        net = precision.float32_outputs(build_model(cfg.model, source.spec)) if placed is None \
            else placement.build_placed(
                lambda: precision.float32_outputs(build_model(cfg.model, source.spec)), placed)
        if pruning:     # check what tfmot will be asked to do before any training
            compression.select_layers(net, cfg.compression.pruning.layers,
                                      "compression.pruning.layers",
                                      compression.pruning_refusal(cfg.compression.pruning))
        if cfg.compression.quantization.enabled:
            compression.unquantizable(net, cfg.compression.quantization)
        model, optimizer = _compile(cfg, net, plan, policy, stages[0], steps_per_epoch,
                                    placed=placed)
    flops = sum(c.flops for c in placement.layer_costs(net))
    print(_plan_text(strat, info, policy, plan, source, steps_per_epoch, stages, pruning, model),
          flush=True)
    for part in (memory_plan, placed):
        if part is not None:
            print(part.describe(), flush=True)
    if dry_run:
        return None

    # -- run directory -----------------------------------------------------------------------
    chief = strategy.is_chief()
    path = rundir.run_path(cfg, smoke)
    done = rundir.read_summary(path)
    if done is not None:
        print(f"{path} already completed; use another run.name to train again")
        print(rundir.report_table(done))
        return done
    run = rundir.open_run_dir(cfg, smoke, write=chief)
    # Model FLOP utilisation is quoted against a matmul measured here, times the devices.
    peak = planner.matmul_peak_flops() * (len(placed.devices) if placed else info.replicas)
    runner = _StageRunner(cfg, strat, info, plan, source, run, chief, steps_per_epoch, smoke,
                          flops, peak)

    # -- stages: train -> prune (+ fine-tune) -> QAT, each checkpointed and resumable --------
    results = {"train": runner.run_stage(stages[0], model, optimizer)}
    if len(stages) > 1 and chief and "float32_variables_gzip_bytes" not in results["train"]:
        results["train"]["float32_variables_gzip_bytes"] = export.saved_model_variables_gzip(net)
    for stage in stages[1:]:
        if stage.name == "prune":
            with strat.scope():
                net = compression.prune_model(net, cfg.compression.pruning, pruning)
                hooks = [compression.PruningHook(net)]
                model, optimizer = _compile(cfg, net, plan, policy, stage, steps_per_epoch, hooks,
                                            placed=placed)
            extra = [compression.SparsityLogger(net)]
        else:
            # tfmot's fake-quant ops take float32 only: QAT runs on a float32 copy.
            precision.apply_policy("float32")
            base = compression.strip(net) if pruning else net
            with strat.scope():
                net = compression.quantize_model(
                    export.inference_model(base), cfg.compression.quantization,
                    preserve_sparsity=bool(pruning) and cfg.compression.quantization.preserve_sparsity)
                model, optimizer = _compile(cfg, net, plan, "float32", stage, steps_per_epoch,
                                            unroll=True, placed=placed)
            extra = []
        results[stage.name] = runner.run_stage(stage, model, optimizer, extra)
        if stage.name == "prune":
            results["prune"]["sparsity"] = compression.sparsity(net)

    # -- export, verify, report ------------------------------------------------------------
    final = compression.strip(net) if stages[-1].name == "prune" else net
    qat = stages[-1].name == "qat"
    artifacts = export.export_all(final, cfg.export, run.export, source, qat=qat) if chief else {}
    summary = {
        "status": "completed", "steps": stages[0].updates,
        "epochs": stages[0].epochs, "steps_per_epoch": steps_per_epoch,
        "replicas": info.replicas, "workers": info.workers, "strategy": info.kind,
        "devices": list(info.devices), "precision": policy,
        "per_replica_batch_size": plan.per_replica, "accumulation_steps": plan.accumulation,
        "global_batch_size": plan.global_batch,
        "metrics": results[stages[-1].name]["metrics"],
        "throughput": {"examples_per_sec": results["train"]["examples_per_sec"],
                       "flops_per_example": flops,
                       "model_flops_per_sec": results["train"].get("model_flops_per_sec", 0.0),
                       "mfu": results["train"].get("mfu", 0.0)},
        "placement": None if placed is None else {
            "devices": list(placed.devices), "microbatches": placed.microbatches,
            "balance": placed.balance, "stage_costs": list(placed.costs),
            "stages": [[n for n, s in zip(placed.layers, placed.stage) if s == k]
                       for k in range(placed.num_stages)],
            "bubble_formula": placed.bubble()},
        "memory_plan": None if memory_plan is None else {
            "kind": memory_plan.kind, "stages": memory_plan.stages,
            "device_memory": memory_plan.memory,
            "bytes_per_device": [e.total for e in memory_plan.per_device]},
        "stages": results, "sparsity": results.get("prune", {}).get("sparsity", {}),
        "artifacts": artifacts, "smoke": smoke,
    }
    print(f"final weights sha256: {_weights_digest(model)}")
    if chief:
        rundir.write_summary(run, summary)
    runner.clean_up()
    print(rundir.report_table(summary))
    return summary


def _compile(cfg, net, plan, policy, stage, steps_per_epoch, hooks=(), unroll=False, placed=None):
    """The stage's training model (tftrain's train step around `net`) and optimizer:
    train's schedule for `train`, a constant rate of its own for the later stages. A
    placed model splits each batch into its pipeline's micro-batches (an unrolled loop,
    so stage k can work on micro-batch i while stage k+1 works on i-1)."""
    from tftrain import optim, precision, train_step

    micro = placed.microbatches if placed else 1
    model = train_step.TrainModel.wrap(net, plan.accumulation * micro,
                                       cfg.distribute.all_reduce_dtype, update_hooks=hooks,
                                       unroll=unroll or micro > 1,
                                       colocate_gradients=placed is not None)
    if stage.learning_rate is None:
        lr = optim.build_schedule(cfg.train.schedule, cfg.train.optimizer.learning_rate,
                                  steps_per_epoch, stage.updates)
    else:
        lr = optim.Constant(stage.learning_rate)
    optimizer = precision.wrap_optimizer(optim.build_optimizer(cfg.train.optimizer, lr),
                                         policy, cfg.precision)
    model.compile(optimizer=optimizer, loss=train_step.build_loss(cfg.train.loss),
                  metrics=_metrics(cfg.train.metrics),
                  steps_per_execution=cfg.train.steps_per_execution)
    optimizer.build(model.trainable_variables)   # slots exist before a restore
    return model, optimizer


class _StageRunner:
    """Fits one stage from its latest checkpoint to its last update: checkpoints,
    SIGTERM, non-finite losses, logs; then evaluates it. Stage results are kept in
    `stages.json` so a resumed run reports the stages it does not redo."""

    def __init__(self, cfg, strat, info, plan, source, run, chief, steps_per_epoch, smoke,
                 flops_per_example=0.0, peak_flops=0.0):
        from tftrain import data, strategy

        self.flops_per_example, self.peak_flops = flops_per_example, peak_flops
        self.cfg, self.strat, self.plan, self.source = cfg, strat, plan, source
        self.run, self.chief, self.steps_per_epoch, self.smoke = run, chief, steps_per_epoch, smoke
        self.val = data.val_dataset(source, plan)
        self.agree = strategy.any_worker(strat) if info.workers > 1 else None
        # Every worker saves (the collective runtime needs all of them); only the chief's
        # checkpoints are kept, the others write to a scratch directory removed at the end.
        self.scratch = None if chief else _scratch_dir(run.path)
        self.record = run.path / "stages.json"
        try:
            self.results = json.loads(self.record.read_text())
        except (OSError, json.JSONDecodeError):
            self.results = {}

    def checkpoints(self, stage: Stage) -> Path:
        return self.run.checkpoints if stage.name == "train" else self.run.checkpoints / stage.name

    def run_stage(self, stage: Stage, model, optimizer, extra_callbacks=()) -> dict:
        import tensorflow as tf

        from tftrain import callbacks as cb
        from tftrain import data, optim
        from tftrain._keras import keras

        cfg, spe = self.cfg, self.steps_per_epoch
        with self.strat.scope():
            generators = cb.random_generators(model)
        ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, rng=generators)
        directory = self.checkpoints(stage)
        save_dir = directory if self.chief else self.scratch / stage.name
        manager = tf.train.CheckpointManager(ckpt, str(save_dir), cfg.train.checkpoint.keep)
        restored = cb.restore_latest(ckpt, directory)
        start = int(optimizer.iterations.numpy())
        if start >= stage.updates:                   # done before: nothing to redo
            missing = stage.name not in self.results
            if not (self.agree(missing) if self.agree else missing):   # every worker agrees
                return self.results[stage.name]
        if restored:
            print(f"resuming from {restored} at update {start}/{stage.updates} of stage {stage.name}")
        elif stage.name != "train":
            print(f"stage {stage.name}: {stage.updates} updates at learning rate "
                  f"{stage.learning_rate:g}", flush=True)

        checkpointer = cb.Checkpointer(manager, cfg.train.checkpoint.every.steps(spe, stage.updates),
                                       spe, start, self.agree)
        throughput = cb.Throughput(self.plan.global_batch)
        flops = cb.FlopsLogger(self.flops_per_example, self.peak_flops)
        callbacks = [cb.NaNGuard(spe, self.agree), checkpointer, throughput, flops,
                     cb.LearningRateLogger(), *extra_callbacks]
        if stage.name == "train":
            callbacks += [c for c in [optim.plateau_callback(cfg.train.schedule),
                                      _early_stopping(cfg)] if c]
        if self.chief:
            suffix = "" if stage.name == "train" else f"-{stage.name}"
            logs = self.run.path / "tensorboard" / ("" if stage.name == "train" else stage.name)
            callbacks += [keras.callbacks.CSVLogger(str(self.run.path / f"metrics{suffix}.csv"),
                                                       append=start > 0),
                          keras.callbacks.TensorBoard(str(logs), update_freq="epoch")]
        if cfg.train.on_nan == "rollback" and start == 0:
            manager.save(checkpoint_number=0)            # something to roll back to
        began = time.perf_counter()
        for attempt in range(cfg.train.nan_retries + 1):
            try:
                _fit(model, data.train_dataset(self.source, self.plan, cfg.data, cfg.run.seed, start),
                     self.val, start, stage.epochs, spe, callbacks, cfg, self.smoke)
                break
            except cb.NonFiniteLoss as err:
                if cfg.train.on_nan == "stop" or attempt == cfg.train.nan_retries:
                    raise RuntimeError(f"{err}; lower train.optimizer.learning_rate, add clipping "
                                       "(train.optimizer.global_clipnorm) or set train.on_nan: "
                                       "rollback") from None
                cb.restore_latest(ckpt, directory)
                start = int(optimizer.iterations.numpy())
                checkpointer.resume_at(start)
                optim.scale_learning_rate(model, cfg.train.nan_lr_factor)
                print(f"tftrain: {err}; rolled back to update {start}, learning rate x "
                      f"{cfg.train.nan_lr_factor} (retry {attempt + 1}/{cfg.train.nan_retries})",
                      flush=True)
        if checkpointer.preempted:
            self.clean_up()
            where = "" if stage.name == "train" else f" in stage {stage.name}"
            raise Preempted(f"stopped by SIGTERM{where} at update {checkpointer.update}/"
                            f"{stage.updates}; checkpoint saved, rerun the same command to resume")
        metrics = model.evaluate(self.val, steps=cfg.train.smoke_steps if self.smoke else None,
                                 return_dict=True, verbose=0)
        result = {"updates": int(optimizer.iterations.numpy()), "epochs": stage.epochs,
                  "metrics": {f"val_{k}": float(v) for k, v in metrics.items()},
                  "examples_per_sec": throughput.steady_rate(),
                  "model_flops_per_sec": flops.rate(throughput.steady_rate()),
                  "mfu": flops.utilisation(throughput.steady_rate()),
                  "seconds": time.perf_counter() - began}    # of this session of the stage
        self.results[stage.name] = result
        if self.chief:
            from tftrain.rundir import atomic_write
            atomic_write(self.record, json.dumps(self.results, indent=2) + "\n")
        return result

    def clean_up(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _fit(model, train, val, start, epochs, steps_per_epoch, callbacks, cfg, smoke) -> None:
    """fit from optimizer update `start` (mid-epoch if need be) to the end of the stage."""
    from tftrain.callbacks import ResumePoint

    if start >= epochs * steps_per_epoch:
        return
    model._training_state = ResumePoint(start)   # fit starts at (epoch, step) of `start`
    try:
        model.fit(train, epochs=epochs, steps_per_epoch=steps_per_epoch, validation_data=val,
                  validation_steps=cfg.train.smoke_steps if smoke else None,
                  callbacks=callbacks, verbose=cfg.train.verbose)
    finally:
        model._training_state = None


def _scratch_dir(run_path: Path) -> Path:
    """A non-chief worker's checkpoint directory: named after the run and the worker, so
    a relaunch after a crash clears what the crashed worker left."""
    from tftrain.strategy import cluster_spec

    key = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"tftrain-worker-{key}-{cluster_spec()[2]}"
    shutil.rmtree(path, ignore_errors=True)
    return path


def _weights_digest(model) -> str:
    """A fingerprint of the weights: equal on every worker of a data-parallel run."""
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(w.tobytes())
    return digest.hexdigest()[:16]


def _reject_unavailable(cfg: Config) -> None:
    if cfg.compression.quantization.enabled and cfg.export.tflite not in ("none", "int8"):
        raise ConfigError(f"export.tflite: a quantization-aware trained model exports as int8, "
                          f"not {cfg.export.tflite}; set export.tflite: int8 (or disable "
                          "compression.quantization)")
    if cfg.model.placement is not None and cfg.distribute.strategy not in ("auto", "default"):
        raise ConfigError(f"distribute.strategy: model.placement places one model copy over "
                          f"its devices and cannot be combined with "
                          f"'{cfg.distribute.strategy}'; set distribute.strategy: auto")
    if cfg.model.placement is not None:
        from tftrain.strategy import cluster_spec
        if cluster_spec()[1] > 1:
            raise ConfigError("model.placement: model parallelism runs on one machine; "
                              "remove it to train data parallel over the cluster's workers")
    if cfg.model.placement is not None and (cfg.compression.pruning.enabled
                                            or cfg.compression.quantization.enabled):
        raise ConfigError("model.placement: compression stages run on one device or data "
                          "parallel; remove model.placement or disable compression")


def _parallelism(cfg: Config, policy: str, source):
    """(strategy, placement or None, memory plan) on one machine: the configured placement,
    else the planner's choice for `distribute.strategy: auto` (data parallel when the model
    fits one device, else the fewest stages that fit)."""
    import tensorflow as tf

    from tftrain import placement, planner, precision, strategy
    from tftrain.config import PlacementConfig
    from tftrain.models import build_model

    devices = strategy.resolve_devices(cfg.distribute)
    base = precision.float32_outputs(build_model(cfg.model, source.spec))   # for its costs
    costs = placement.layer_costs(base)
    batch, acc = cfg.data.per_replica_batch_size, cfg.train.accumulation_steps
    if cfg.model.placement is not None:
        wanted = cfg.model.placement.devices
        missing = [d for d in wanted if not _device_exists(d)]
        if missing:
            raise ConfigError(f"model.placement.devices: {', '.join(missing)} does not exist; set "
                              "distribute.virtual_cpus to split the CPU into more devices")
        memory_plan = planner.choose(cfg, costs, wanted, policy, batch, acc,
                                     force_stages=len(wanted))
        return (tf.distribute.get_strategy(), placement.plan(base, cfg.model.placement, batch),
                memory_plan)
    copies = len(devices) if strategy.resolve_kind(cfg.distribute, devices) == "mirrored" else 1
    memory_plan = planner.choose(cfg, costs, devices, policy, batch, acc, replicas=copies)
    if memory_plan.kind == "model":
        if cfg.distribute.strategy != "auto":
            raise ConfigError(
                f"distribute.strategy: the model needs {memory_plan.per_device[0].total / 2**20:,.1f}"
                f" MiB per stage and does not fit one device with '{cfg.distribute.strategy}'; "
                "set distribute.strategy: auto (model parallel) or model.placement")
        layout = PlacementConfig(devices=devices[:memory_plan.stages], balance="memory")
        return tf.distribute.get_strategy(), placement.plan(base, layout, batch), memory_plan
    return strategy.build_strategy(cfg), None, memory_plan


def _device_exists(name: str) -> bool:
    import tensorflow as tf

    from tftrain.strategy import _canonical
    return _canonical(name) in {_canonical(d.name) for d in tf.config.list_logical_devices()}


def _metrics(names):
    from tftrain._keras import keras

    for name in names:
        try:
            known = name in ("accuracy", "acc") or callable(keras.metrics.get(name))
        except ValueError:
            known = False
        if not known:
            raise ConfigError(f"train.metrics: unknown metric '{name}'; use Keras metric names "
                              "such as accuracy, sparse_top_k_categorical_accuracy")
    return list(names)


def _early_stopping(cfg: Config):
    from tftrain._keras import keras

    es = cfg.train.early_stopping
    if es is None:
        return None
    return keras.callbacks.EarlyStopping(monitor=es.monitor, patience=es.patience,
                                         min_delta=es.min_delta,
                                         restore_best_weights=es.restore_best_weights, verbose=1)


def _plan_text(strat, info, policy, plan, source, steps_per_epoch, stages, pruning, model) -> str:
    from tftrain.strategy import device_table

    has_bn = any("BatchNormalization" in type(layer).__name__ for layer in model.layers)
    train = stages[0]
    lines = [
        device_table(strat),
        f"precision: {policy}",
        f"data: {source.num_train} train / {source.num_val} validation examples, input "
        f"{source.spec.shape} {source.spec.dtype}, {source.spec.num_classes} classes",
        f"batch: {plan.per_replica} per replica x {plan.replicas} replicas x "
        f"{plan.accumulation} accumulation steps = global batch {plan.global_batch}",
        f"training: {train.epochs} epochs x {steps_per_epoch} updates = {train.updates} updates",
        f"model: {model.name}, {model.count_params():,} parameters",
    ]
    for stage in stages[1:]:
        line = (f"stage {stage.name}: {stage.epochs} epochs = {stage.updates} updates at "
                f"learning rate {stage.learning_rate:g}")
        if stage.name == "prune":
            line += (f"; sparsity reaches its target at update {pruning.end} (from "
                     f"{pruning.begin}, masks updated every {pruning.frequency} updates)")
        else:
            line += "; in float32 (tfmot's fake-quant ops take no bfloat16/float16)"
        lines.append(line)
    if has_bn and plan.accumulation > 1:
        lines.append("note: batch norm computes statistics per micro-batch of "
                     f"{plan.per_replica} examples, not over the whole global batch")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
