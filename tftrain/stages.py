"""The pipeline's stages: train, then prune and QAT when enabled.

Each stage fits from its latest checkpoint (its own directory) to its last update, with
checkpoints, SIGTERM handling, non-finite-loss rollback and logs, then is evaluated; the
results of finished stages are kept in `stages.json`, so a resumed run continues in the
stage it was in and reports the ones it does not redo.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tftrain.config import Config, ConfigError
from tftrain.preemption import Preempted, Preemption  # noqa: F401  (Preempted: re-exported)


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


def compile_stage(cfg, net, plan, policy, stage, steps_per_epoch, hooks=(), unroll=False, placed=None):
    """The stage's training model (tftrain's train step around `net`) and optimizer:
    train's schedule for `train`, a constant rate of its own for the later stages. A
    placed model splits each batch into its pipeline's micro-batches (an unrolled loop,
    so stage k can work on micro-batch i while stage k+1 works on i-1)."""
    import tensorflow as tf

    from tftrain import optim, precision, train_step

    micro = placed.microbatches if placed else 1
    wire = precision.all_reduce_plan(cfg.distribute, tf.distribute.get_strategy(), policy)
    # A placed model's step is unrolled: every op of every micro-batch in the step's own
    # graph, each on its stage's device (none hidden in a while loop's body).
    model = train_step.TrainModel.wrap(net, plan.accumulation * micro, wire.dtype,
                                       update_hooks=hooks, unroll=unroll or placed is not None,
                                       placed=placed is not None)
    if stage.learning_rate is None:
        lr = optim.build_schedule(cfg.train.schedule, cfg.train.optimizer.learning_rate,
                                  steps_per_epoch, stage.updates)
    else:
        lr = optim.Constant(stage.learning_rate)
    if not isinstance(lr, float):     # a factor the rollback can lower (and checkpoints keep)
        lr = optim.Scaled(lr)
    optimizer = precision.wrap_optimizer(optim.build_optimizer(cfg.train.optimizer, lr),
                                         policy, cfg.precision, loss_scaled=wire.loss_scaled)
    if placed is not None:
        from tftrain.placement import pin_updates
        pin_updates(optimizer)         # each variable's update on the variable's device
    model.compile(optimizer=optimizer, loss=train_step.build_loss(cfg.train.loss),
                  metrics=metrics(cfg.train.metrics),
                  steps_per_execution=cfg.train.steps_per_execution)
    optimizer.build(model.trainable_variables)   # slots exist before a restore
    return model, optimizer


class StageRunner:
    """Fits one stage from its latest checkpoint to its last update: checkpoints,
    SIGTERM, non-finite losses, logs; then evaluates it. Stage results are kept in
    `stages.json` so a resumed run reports the stages it does not redo."""

    def __init__(self, cfg, strat, info, plan, source, run, chief, steps_per_epoch, smoke,
                 flops_per_example=0.0, peak_flops=0.0, stop: Preemption | None = None):
        from tftrain import data, strategy

        self.stop = stop or Preemption()
        self.flops_per_example, self.peak_flops = flops_per_example, peak_flops
        self.cfg, self.strat, self.plan, self.source = cfg, strat, plan, source
        self.run, self.chief, self.steps_per_epoch, self.smoke = run, chief, steps_per_epoch, smoke
        self.val = data.val_dataset(source, plan, cfg.data)
        self.agree = strategy.any_worker(strat) if info.workers > 1 else None
        # Every worker saves (the collective runtime needs all of them); only the chief's
        # checkpoints are kept, the others write to a scratch directory removed at the end.
        self.scratch = None if chief else scratch_dir(run.path)
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
        self.stop.rearm()
        self.stop.check("before stage " + stage.name, self.agree)
        with self.strat.scope():
            generators = cb.random_generators(model)
        # Keras' own callbacks whose counters a resumed run needs (their state is saved)
        stateful = [c for c in [optim.plateau_callback(cfg.train.schedule),
                                early_stopping(cfg, model)] if c] if stage.name == "train" else []
        position = tf.Variable(0, dtype=tf.int64, trainable=False)   # training batches done
        ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, rng=generators,
                                   position=position,
                                   learning_rate=optim.learning_rate_state(optimizer),
                                   callbacks=[c.state for c in stateful])
        directory = self.checkpoints(stage)
        save_dir = directory if self.chief else self.scratch / stage.name
        manager = tf.train.CheckpointManager(ckpt, str(save_dir), cfg.train.checkpoint.keep)
        restored = cb.restore_latest(ckpt, directory)
        missing = stage.name not in self.results   # a stage that ended (early or not) is done
        if not (self.agree(missing) if self.agree else missing):    # on every worker
            return self.results[stage.name]
        start = int(position.numpy())
        if restored:
            print(f"resuming from {restored} at update {start}/{stage.updates} of stage {stage.name}")
        elif stage.name != "train":
            print(f"stage {stage.name}: {stage.updates} updates at learning rate "
                  f"{stage.learning_rate:g}", flush=True)

        checkpointer = cb.Checkpointer(manager, cfg.train.checkpoint.every.steps(spe, stage.updates),
                                       spe, start, self.agree, self.stop, position)
        throughput = cb.Throughput(self.plan.global_batch)
        flops = cb.FlopsLogger(self.flops_per_example, self.peak_flops)
        waiting = cb.InputWait()
        # The checkpointer comes after every callback whose state it saves at an epoch's end.
        callbacks = [cb.NaNGuard(spe, self.agree), throughput, waiting, flops,
                     cb.LearningRateLogger(), *extra_callbacks, *stateful, checkpointer]
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
                fit(model, data.distribute(self.strat, self.source, self.plan, cfg.data, cfg.run.seed,
                                           start),
                     self.val, start, stage.epochs, spe, callbacks, cfg, self.smoke)
                break
            except cb.NonFiniteLoss as err:
                if cfg.train.on_nan == "stop" or attempt == cfg.train.nan_retries:
                    raise RuntimeError(f"{err}; lower train.optimizer.learning_rate, add clipping "
                                       "(train.optimizer.global_clipnorm) or set train.on_nan: "
                                       "rollback") from None
                lowered = float(optim.learning_rate_state(optimizer).numpy()) * cfg.train.nan_lr_factor
                cb.restore_latest(ckpt, directory)
                optim.learning_rate_state(optimizer).assign(lowered)   # cumulative over retries
                start = int(position.numpy())
                checkpointer.resume_at(start)
                print(f"tftrain: {err}; rolled back to update {start}, learning rate x "
                      f"{cfg.train.nan_lr_factor} (retry {attempt + 1}/{cfg.train.nan_retries})",
                      flush=True)
        if checkpointer.preempted:
            self.clean_up()
            where = "" if stage.name == "train" else f" in stage {stage.name}"
            raise Preempted(f"stopped by {self.stop.requested or 'a signal to another worker'}"
                            f"{where} at update {checkpointer.update}/{stage.updates}; "
                            "checkpoint saved, rerun the same command to resume")
        metrics = model.evaluate(self.val, steps=cfg.train.smoke_steps if self.smoke else None,
                                 return_dict=True, verbose=0)
        result = {"updates": int(optimizer.iterations.numpy()),   # made (skipped ones not)
                  "batches": checkpointer.update, "epochs": -(-checkpointer.update // spe),
                  "metrics": {f"val_{k}": float(v) for k, v in metrics.items()},
                  "examples_per_sec": throughput.steady_rate(),
                  "model_flops_per_sec": flops.rate(throughput.steady_rate()),
                  "mfu": flops.utilisation(throughput.steady_rate()),
                  "input_wait": waiting.fraction(),
                  "seconds": time.perf_counter() - began}    # of this session of the stage
        self.results[stage.name] = result
        if self.chief:
            from tftrain.rundir import atomic_write
            atomic_write(self.record, json.dumps(self.results, indent=2) + "\n")
        return result

    def clean_up(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def fit(model, train, val, start, epochs, steps_per_epoch, callbacks, cfg, smoke) -> None:
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


def scratch_dir(run_path: Path) -> Path:
    """A non-chief worker's checkpoint directory: named after the run and the worker, so
    a relaunch after a crash clears what the crashed worker left."""
    from tftrain.strategy import cluster_spec

    key = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"tftrain-worker-{key}-{cluster_spec()[2]}"
    shutil.rmtree(path, ignore_errors=True)
    return path


def metrics(names):
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


def early_stopping(cfg: Config, model):
    """Keras' EarlyStopping with its counters (and best weights) kept in checkpoints."""
    from tftrain.callbacks import EarlyStopping

    es = cfg.train.early_stopping
    if es is None:
        return None
    return EarlyStopping(model, monitor=es.monitor, patience=es.patience, min_delta=es.min_delta,
                         restore_best_weights=es.restore_best_weights, verbose=1)
