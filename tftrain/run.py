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
import traceback
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


def run(cfg: Config, dry_run: bool = False, smoke: bool = False) -> dict | None:
    """Run the pipeline for `cfg`; returns the summary (None for a dry run)."""
    # TensorFlow is imported only once the config has parsed: a typo costs no TF start-up.
    import tensorflow as tf

    from tftrain import callbacks as cb
    from tftrain import data, export, optim, precision, rundir, strategy, train_step
    from tftrain._keras import keras
    from tftrain.models import build_model

    # -- plan: devices, strategy, precision, data, batches (nothing written yet) ---------
    strategy.configure_devices(cfg)                  # logical devices first, before any op
    strat = strategy.build_strategy(cfg, force_one_device=smoke)   # then the collectives
    keras.utils.set_random_seed(cfg.run.seed)
    keras.backend.experimental.enable_tf_random_generator()   # RNG state checkpointable
    if cfg.run.deterministic:
        tf.config.experimental.enable_op_determinism()
    info = strategy.describe(strat)
    policy = precision.choose_policy(cfg.precision)
    precision.apply_policy(policy)
    source = data.load_source(cfg.data, cfg.run.seed)
    plan = data.plan_batches(cfg, info.replicas)
    steps_per_epoch = plan.steps_per_epoch(source.num_train)
    epochs = cfg.train.epochs
    if smoke:
        steps_per_epoch, epochs = min(steps_per_epoch, cfg.train.smoke_steps), 1
    total_updates = steps_per_epoch * epochs
    _reject_unavailable(cfg)

    # -- model, optimizer and schedule, built inside the strategy scope ------------------
    with strat.scope():
        model = precision.float32_outputs(build_model(cfg.model, source.spec))
        model = train_step.TrainModel.wrap(model, plan.accumulation,
                                           cfg.distribute.all_reduce_dtype)
        lr = optim.build_schedule(cfg.train.schedule, cfg.train.optimizer.learning_rate,
                                  steps_per_epoch, total_updates)
        optimizer = precision.wrap_optimizer(
            optim.build_optimizer(cfg.train.optimizer, lr), policy, cfg.precision)
        model.compile(optimizer=optimizer, loss=train_step.build_loss(cfg.train.loss),
                      metrics=_metrics(cfg.train.metrics),
                      steps_per_execution=cfg.train.steps_per_execution)
        optimizer.build(model.trainable_variables)   # slots exist before a restore
    print(_plan_text(strat, info, policy, plan, source, steps_per_epoch, epochs, model), flush=True)
    if dry_run:
        return None

    # -- run directory, resume point -------------------------------------------------------
    chief = strategy.is_chief()
    path = rundir.run_path(cfg, smoke)
    done = rundir.read_summary(path)
    if done is not None:
        print(f"{path} already completed; use another run.name to train again")
        print(rundir.report_table(done))
        return done
    run = rundir.open_run_dir(cfg, smoke, write=chief)
    with strat.scope():
        generators = cb.random_generators(model)
    ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, rng=generators)
    # Every worker saves (the collective runtime needs all of them); only the chief's
    # checkpoints are kept, the others write to a scratch directory removed at the end.
    save_dir = run.checkpoints if chief else _scratch_dir(run.path)
    manager = tf.train.CheckpointManager(ckpt, str(save_dir), cfg.train.checkpoint.keep)
    restored = cb.restore_latest(ckpt, run.checkpoints)
    start = int(optimizer.iterations.numpy())
    if restored:
        print(f"resuming from {restored} at update {start}/{total_updates}")

    # -- fit ---------------------------------------------------------------------------------
    agree = strategy.any_worker(strat) if info.workers > 1 else None
    checkpointer = cb.Checkpointer(manager, cfg.train.checkpoint.every.steps(steps_per_epoch),
                                   steps_per_epoch, start, agree)
    throughput = cb.Throughput(plan.global_batch)
    callbacks = [cb.NaNGuard(steps_per_epoch, agree), checkpointer, throughput,
                 cb.LearningRateLogger()]
    callbacks += [c for c in [optim.plateau_callback(cfg.train.schedule), _early_stopping(cfg)] if c]
    if chief:
        callbacks += [keras.callbacks.CSVLogger(str(run.path / "metrics.csv"), append=start > 0),
                      keras.callbacks.TensorBoard(str(run.path / "tensorboard"), update_freq="epoch")]
    val = data.val_dataset(source, plan)
    if cfg.train.on_nan == "rollback" and start == 0:
        manager.save(checkpoint_number=0)            # something to roll back to
    for attempt in range(cfg.train.nan_retries + 1):
        try:
            _fit(model, data.train_dataset(source, plan, cfg.data, cfg.run.seed, start), val,
                 start, epochs, steps_per_epoch, callbacks, cfg, smoke)
            break
        except cb.NonFiniteLoss as err:
            if cfg.train.on_nan == "stop" or attempt == cfg.train.nan_retries:
                raise RuntimeError(f"{err}; lower train.optimizer.learning_rate, add clipping "
                                   "(train.optimizer.global_clipnorm) or set train.on_nan: "
                                   "rollback") from None
            cb.restore_latest(ckpt, run.checkpoints)
            start = int(optimizer.iterations.numpy())
            checkpointer.resume_at(start)
            optim.scale_learning_rate(model, cfg.train.nan_lr_factor)
            print(f"tftrain: {err}; rolled back to update {start}, learning rate x "
                  f"{cfg.train.nan_lr_factor} (retry {attempt + 1}/{cfg.train.nan_retries})",
                  flush=True)
    if checkpointer.preempted:
        if not chief:
            shutil.rmtree(save_dir, ignore_errors=True)
        raise Preempted(f"stopped by SIGTERM at update {checkpointer.update}/{total_updates}; "
                        "checkpoint saved, rerun the same command to resume")

    # -- evaluate, export, verify, report --------------------------------------------------------
    metrics = model.evaluate(val, steps=cfg.train.smoke_steps if smoke else None,
                             return_dict=True, verbose=0)
    artifacts = export.export_all(model, cfg.export, run.export, source) if chief else {}
    summary = {
        "status": "completed", "steps": int(optimizer.iterations.numpy()),
        "epochs": epochs, "steps_per_epoch": steps_per_epoch,
        "replicas": info.replicas, "workers": info.workers, "strategy": info.kind,
        "devices": list(info.devices), "precision": policy,
        "per_replica_batch_size": plan.per_replica, "accumulation_steps": plan.accumulation,
        "global_batch_size": plan.global_batch,
        "metrics": {f"val_{k}": float(v) for k, v in metrics.items()},
        "throughput": {"examples_per_sec": throughput.steady_rate()},
        "artifacts": artifacts, "smoke": smoke,
    }
    print(f"final weights sha256: {_weights_digest(model)}")
    if chief:
        rundir.write_summary(run, summary)
    else:
        shutil.rmtree(save_dir, ignore_errors=True)
    print(rundir.report_table(summary))
    return summary


def _fit(model, train, val, start, epochs, steps_per_epoch, callbacks, cfg, smoke) -> None:
    """fit from optimizer update `start` (mid-epoch if need be) to the end of training."""
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
    if cfg.compression.pruning.enabled or cfg.compression.quantization.enabled:
        key = "pruning" if cfg.compression.pruning.enabled else "quantization"
        raise ConfigError(f"compression.{key}.enabled: compression stages are not available "
                          "in this version of tftrain; set it to false")
    if cfg.model.placement is not None:
        raise ConfigError("model.placement: model parallelism is not available in this "
                          "version of tftrain; remove model.placement")


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


def _plan_text(strat, info, policy, plan, source, steps_per_epoch, epochs, model) -> str:
    from tftrain.strategy import device_table

    has_bn = any("BatchNormalization" in type(layer).__name__ for layer in model.layers)
    lines = [
        device_table(strat),
        f"precision: {policy}",
        f"data: {source.num_train} train / {source.num_val} validation examples, input "
        f"{source.spec.shape} {source.spec.dtype}, {source.spec.num_classes} classes",
        f"batch: {plan.per_replica} per replica x {plan.replicas} replicas x "
        f"{plan.accumulation} accumulation steps = global batch {plan.global_batch}",
        f"training: {epochs} epochs x {steps_per_epoch} updates = {epochs * steps_per_epoch} updates",
        f"model: {model.name}, {model.count_params():,} parameters",
    ]
    if has_bn and plan.accumulation > 1:
        lines.append("note: batch norm computes statistics per micro-batch of "
                     f"{plan.per_replica} examples, not over the whole global batch")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
