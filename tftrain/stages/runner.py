"""The shared runner: fits one stage from its latest checkpoint to its last update.

Each stage fits with checkpoints (its own directory), SIGTERM handling, non-finite-loss
rollback and logs, then is evaluated; the results of finished stages are kept in
`stages.json`, so a resumed run continues in the stage it was in and reports the ones it
does not redo.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from tftrain.config import ConfigError
from tftrain.core import console, internals
from tftrain.training.preemption import Preempted, Preemption  # noqa: F401  (Preempted: re-exported)
from tftrain.training.callbacks import ResumePoint
from tftrain.runtime.strategy import cluster_spec
import tensorflow as tf
from tftrain import data
from tftrain.training.tracking import Tracker
from tftrain.training import callbacks as cb
from tftrain.optim import rates
from tftrain.training.rundir import atomic_write
from tftrain.training import epoch_logs, heap, input_wait, memory, progress, xla
from tftrain.core.keras import keras
from tftrain.training.profiling import ProfileWindow
from tftrain.optim.averaging import has_batch_norm, recalibrate_batch_norm
from tftrain.data import augment, feed, train_dataset


class StageRunner:
    """Fits each stage from its latest checkpoint to its last update: checkpoints,
    SIGTERM, non-finite losses, logs; then evaluates it. Stage results are kept in
    `stages.json` so a resumed run reports the stages it does not redo."""

    def __init__(self, *, plan, run, stop: Preemption | None = None, profile=None,
                 tracker=None):
        """`plan`: the run's plan (`tftrain.plan.RunPlan`); `run`: its `RunDir`; `stop`:
        the run's `Preemption` flag; `profile`: (START, STOP) updates of the first stage
        to trace with the profiler (`--profile`); `tracker`: the run's
        `tftrain.training.tracking.Tracker` (each epoch's metrics, on the chief)."""
        self.plan, self.cfg, self.run, self.profile = plan, plan.cfg, run, profile
        self.tracker = tracker or Tracker()
        self.stop = stop or Preemption()
        self.strat, self.chief = plan.parallel.strategy, plan.chief
        self.steps_per_epoch, self.smoke = plan.steps_per_epoch, plan.smoke
        self.val = data.val_dataset(plan.training_source, plan.batches, self.cfg.data)
        self.labels = data.label_spec(plan.training_source, self.cfg.data)   # training's
        if int(self.val.cardinality()) == tf.data.UNKNOWN_CARDINALITY:   # TFRecord: count once;
            # Keras needs the size to run several steps per call (validation is cached)
            batches = int(self.val.reduce(0, lambda count, *_: count + 1))
            self.val = self.val.apply(tf.data.experimental.assert_cardinality(batches))
        self.agree = plan.parallel.agree
        # Every worker saves (the collective runtime needs all of them); only the chief's
        # checkpoints are kept, the others write to a scratch directory removed at the end.
        self.scratch = None if self.chief else scratch_dir(run.path)
        self.record = run.path / "stages.json"
        self.jit: dict = {}         # each stage's XLA decision
        self.loss_scale = []        # the stage's dynamic loss-scale variables, if any
        try:
            self.results = json.loads(self.record.read_text())
        except (OSError, json.JSONDecodeError):
            self.results = {}
        try:      # resumes that changed the global batch (`run.allow_batch_change`)
            self.batch_changes = json.loads((run.path / "batch_changes.json").read_text())
        except (OSError, json.JSONDecodeError):
            self.batch_changes = []

    def run_stage(self, stage, previous):
        """(the model the next stage gets, the stage's results): `stage` built from
        `previous` (the last stage's model), fitted, evaluated and finalized."""
        cfg = self.cfg
        self.stop.rearm()
        self.stop.check("before stage " + stage.name, self.agree)
        with self.strat.scope():
            built = stage.build(previous, self.plan)
            model, optimizer = stage.compile(built, self.plan)
            generators = cb.random_generators(model)
            model.build_metrics(self.labels)     # before the step is traced (traced once), and
            # checkpointed: a stage resumed mid-epoch continues the epoch's running metrics
            metrics = cb.metric_variables(model)
        position = tf.Variable(0, dtype=tf.int64, trainable=False)   # training batches done
        jit = tf.Variable(xla.UNDECIDED, dtype=tf.int64, trainable=False)   # kept on resume
        # the examples per update the position counts (a checkpoint from before it: as now)
        per_update = tf.Variable(self.plan.batches.global_batch, dtype=tf.int64, trainable=False)
        ckpt = tf.train.Checkpoint(model=model, optimizer=optimizer, rng=generators,
                                   position=position, jit_compile=jit, global_batch=per_update,
                                   learning_rate=rates.learning_rate_state(optimizer),
                                   callbacks=[c.state for c in built.stateful],
                                   average=built.average.variables if built.average else {},
                                   epoch_metrics=metrics)
        scale = internals.loss_scale(optimizer)      # a LossScaleOptimizer's, dynamic
        self.loss_scale = [scale.current_loss_scale, scale.counter] if scale else []
        directory = stage.checkpoint_dir(self.run.checkpoints)
        save_dir = directory if self.chief else self.scratch / stage.name
        manager = tf.train.CheckpointManager(ckpt, str(save_dir), cfg.train.checkpoint.keep)
        restored = self._restore(ckpt, directory, optional=list(metrics.values()))
        missing = stage.name not in self.results   # a stage that ended (early or not) is done
        if not (self.agree(missing) if self.agree else missing):    # on every worker
            result = self.results[stage.name]
            self._settle(stage, built)
            return stage.finalize(built, result, self.plan), result
        start = self._rebatch(stage, ckpt, optimizer) if restored else 0
        # the epoch's running sums as the checkpoint holds them (mid-epoch: the batches
        # trained since the epoch began; read before `fit` resets them, put back after)
        carried = cb.CarriedMetrics(model, self.strat, restored and start % self.steps_per_epoch
                                    and not self._batch_changed(stage))
        self._compile_choice(stage, model, jit)
        if restored:
            print(f"resuming from {restored} at update {start}/{stage.updates} of stage {stage.name}",
                  flush=True)
        else:
            if stage.name != "train":
                print(f"{stage.describe(self.plan)}", flush=True)
            begun = stage.begin(built, lambda n=None: self._micro_batches(
                self.auto_batches() if n is None else n))
            if begun:
                print(f"stage {stage.name}: {begun}", flush=True)
        what = (f"{stage.epochs} epochs x {self.steps_per_epoch} updates" if stage.updates
                else "evaluating the starting model")
        with console.phase(stage.name, what) as note:
            result = self._fit(stage, built, model, optimizer, Saved(ckpt, manager, directory),
                               start, carried)
            note["detail"] = ", ".join(f"{k} {v:.4f}" for k, v in result["metrics"].items())
        net = stage.finalize(built, result, self.plan)
        self._record(stage, result)
        return net, result

    def _batch_changed(self, stage) -> bool:
        return any(change["stage"] == stage.name for change in self.batch_changes)

    def _restore(self, ckpt, directory, optional=()) -> str | None:
        """Restore the stage's newest readable checkpoint; in a cluster the chief chooses
        it and the others load the same one (one small all-reduce tells them which).
        `optional`: what a checkpoint of an earlier version may lack."""

        workers = self.plan.parallel.info.workers
        optional = [ckpt.global_batch, *optional]
        if workers == 1 or self.plan.parallel.mean is None:
            return cb.restore_latest(ckpt, directory, self.loss_scale, optional)
        mine = cb.restore_latest(ckpt, directory, self.loss_scale, optional) if self.chief else None
        # the mean over the cluster's replicas of (the chief's number, 0 elsewhere)
        chosen = round(self.plan.parallel.mean([float(cb.checkpoint_number(mine))])[0] * workers)
        if self.chief:
            return mine
        resolver = getattr(self.strat, "cluster_resolver", None)
        return cb.restore_chosen(ckpt, directory, chosen, self.loss_scale,
                                 getattr(resolver, "task_id", None) or 0, optional)

    def _rebatch(self, stage, ckpt, optimizer) -> int:
        """The update to resume at. A checkpoint written under another global batch
        (`run.allow_batch_change`) resumes at the same example of the same epoch (rounded
        down to a whole update of the new batch: at most a batch less one is trained
        again), the optimizer's update count moves with it (the schedule stays at the same
        point of the stage), and the learning rate is scaled by new / old batch (the
        linear scaling rule). Recorded in `batch_changes.json` and `summary.json`."""
        from dataclasses import replace


        start, new = int(ckpt.position.numpy()), self.plan.batches.global_batch
        old = int(ckpt.global_batch.numpy())
        ckpt.global_batch.assign(new)
        if old == new:
            return start
        if not self.cfg.run.allow_batch_change:
            raise ConfigError(f"the checkpoint of stage {stage.name} counts updates of {old} "
                              f"examples, this run's global batch is {new}; set "
                              f"train.global_batch_size: {old}, or run.allow_batch_change: true")
        epoch, done = divmod(start, replace(self.plan.layout, global_batch=old).steps())
        examples = done * old                    # into the epoch, all trained on
        moved = epoch * self.steps_per_epoch + examples // new
        ckpt.position.assign(moved)
        optimizer.iterations.assign(max(0, int(optimizer.iterations.numpy()) + moved - start))
        factor = rates.learning_rate_state(optimizer)
        factor.assign(factor * (new / old))
        change = {"stage": stage.name, "from_global_batch": old, "to_global_batch": new,
                  "epoch": epoch, "examples_into_epoch": examples,
                  "from_update": start, "to_update": moved,
                  "examples_trained_again": examples % new,
                  "learning_rate_scale": new / old}
        self.batch_changes.append(change)
        if self.chief:
            atomic_write(self.run.path / "batch_changes.json",
                         json.dumps(self.batch_changes, indent=2) + "\n")
        print(f"global batch {old} -> {new} (run.allow_batch_change): update {start} of "
              f"{old} becomes update {moved} of {new}, at example {examples} of epoch "
              f"{epoch + 1} ({change['examples_trained_again']} trained again); learning rate "
              f"x {new / old:g}; the result is not the uninterrupted run's", flush=True)
        return moved

    def _compile_choice(self, stage, model, jit) -> None:
        """`train.jit_compile` for this stage (`tftrain.training.xla.for_stage`)."""
        decision = xla.for_stage(stage, model, jit, self.plan,
                                 lambda: next(iter(self._batches(1))))
        model.jit_compile_gradients = decision.compiled
        self.jit[stage.name] = {"compiled": decision.compiled, "reason": decision.reason,
                                "speedup": decision.speedup}

    def _fit(self, stage, built, model, optimizer, saved: "Saved", start, carried) -> dict:
        """Train `model` from update `start` to the stage's end, checkpointed in `saved`;
        `carried`: the epoch's running metrics the checkpoint holds."""
        ckpt, manager, directory = saved
        cfg, spe, position = self.cfg, self.steps_per_epoch, ckpt.position
        every = cfg.train.checkpoint.every.steps(spe, stage.updates)
        checkpointer = cb.Checkpointer(manager, every, spe, start, self.agree, self.stop,
                                       position, cfg.train.check_every)
        throughput = epoch_logs.Throughput(self.plan.batches.global_batch)
        flops = epoch_logs.FlopsLogger(self.plan.flops_per_example, self.plan.peak.flops)
        waiting = input_wait.input_wait(self.plan)
        sizer = (epoch_logs.ExecutionSizer(spe, self.plan.parallel.mean, most=every,
                                           updates=stage.updates)
                 if cfg.train.steps_per_execution == "auto" else None)
        tracked = self.tracker.callback(stage.name, checkpointer, spe, stage.updates)
        # The global metrics first (Keras appends its history and progress bar after
        # these), and the checkpointer after every callback whose state it saves at an
        # epoch's end (and after the tracker: an epoch is logged before it is saved).
        callbacks = [carried, epoch_logs.GlobalMetrics(), throughput, waiting, flops,
                     *([sizer] if sizer else []), epoch_logs.LearningRateLogger(), *built.callbacks,
                     *built.stateful, *([tracked] if tracked else []), checkpointer]
        csv, logs = stage.log_names()
        every = cfg.train.log_every if cfg.train.log_every != "auto" else \
            1 if self.smoke else max(1, stage.updates // 100)
        callbacks.insert(1, progress.UpdateLog(        # after the carried metrics are back
            every, spe, start, **({"path": self.run.path / csv.replace("metrics", "updates"),
                                   "tensorboard": self.run.path / "tensorboard" / logs / "updates"}
                                  if self.chief else {})))
        if self.chief:
            # a resumed stage trains its last epoch again from the checkpoint: its row, if
            # the kill came after it was written, is written again
            progress.keep_rows(self.run.path / csv, lambda row: int(row["epoch"]) < start // spe)
            callbacks += [keras.callbacks.CSVLogger(str(self.run.path / csv), append=start > 0),
                          epoch_logs.EpochTensorBoard(str(self.run.path / "tensorboard" / logs))]
            if self.profile and stage is self.plan.stages[0]:
                callbacks.append(ProfileWindow(*self.profile, str(self.run.path / "tensorboard"),
                                               spe))
        if cfg.train.verbose == 2:        # tftrain's epoch lines (Keras' own at verbose 1)
            callbacks.append(progress.EpochLine(stage.name, stage.epochs, spe))
        if cfg.train.on_nan == "rollback" and start == 0:
            manager.save(checkpoint_number=0)            # something to roll back to
        peaks = memory.Peaks(self.plan.parallel.training_devices()).started()
        began, model.history = time.perf_counter(), None   # (this fit's history, read after it)
        for attempt in range(cfg.train.nan_retries + 1):
            try:
                with stage.training():
                    fit(model, self._training_input(model, start), self.val, start,
                        stage.epochs, spe, callbacks,
                        {"validation_steps": cfg.train.smoke_steps if self.smoke else None,
                         "verbose": 1 if cfg.train.verbose == 1 else 0})
                break
            except cb.NonFiniteLoss as err:
                if cfg.train.on_nan == "stop" or attempt == cfg.train.nan_retries:
                    raise RuntimeError(f"{err}; lower train.optimizer.learning_rate, add clipping "
                                       "(train.optimizer.global_clipnorm) or set train.on_nan: "
                                       "rollback") from None
                factor = rates.learning_rate_state(optimizer)
                lowered = float(factor.numpy()) * cfg.train.nan_lr_factor
                cb.restore_latest(ckpt, directory, self.loss_scale)
                factor.assign(lowered)   # cumulative over retries
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
        # read before evaluating: Keras' evaluate replaces the model's history
        trained = dict(getattr(getattr(model, "history", None), "history", None) or {})
        result = {"updates": int(optimizer.iterations.numpy()),   # made (skipped ones not)
                  "batches": checkpointer.update, "epochs": -(-checkpointer.update // spe),
                  "metrics": epoch_logs.validated(trained, built.callbacks) or self._evaluate(model),
                  "examples_per_sec": throughput.steady_rate(),
                  "model_flops_per_sec": flops.rate(throughput.steady_rate()),
                  "mfu": flops.utilisation(throughput.steady_rate()),
                  "input_wait": waiting.fraction(), **waiting.figures(),
                  "host": epoch_logs.host_figures(model, checkpointer, sizer, callbacks),
                  "jit_compile": self.jit.get(stage.name),
                  "memory": peaks.read(self.plan.parallel.estimated_bytes()),
                  "seconds": time.perf_counter() - began}    # of this session of the stage
        settled = self._settle(stage, built)
        if settled:               # evaluated again, beside the weights as trained
            result["raw_metrics"], result["metrics"] = result["metrics"], self._evaluate(model)
            result["settled"] = settled
        gap = epoch_logs.generalisation_gap(model, trained, result["metrics"])
        if gap:
            console.warn(f"stage {stage.name}: {gap}")
        return result

    def _training_input(self, model, start: int):
        """What `fit` trains on from update `start`: the host pipeline, or a device feed's
        stand-in (`plan.feed`; the model gathers its batches on the devices)."""
        plan = self.plan
        if plan.feed is None or not plan.feed.device:
            return data.distribute(self.strat, plan.training_source, plan.batches, self.cfg.data,
                                   self.cfg.run.seed, start, plan.layout.streams)
        fed = feed.DeviceFeed(plan.training_source, plan.batches, self.cfg.data, self.cfg.run.seed,
                              devices=plan.parallel.input_devices(), strategy=self.strat,
                              start_update=start)
        model.feed_from(fed)
        return fed.stand_in()

    def _settle(self, stage, built) -> str:
        """Swap in the weight average and re-estimate batch-norm statistics, alike
        whether the stage trained now or before a restart; what was done ("": nothing)."""

        if built.average is not None:
            built.average.apply(built.net, self._micro_batches(self.cfg.train.ema.recalibrate_batches))
            return "averaged"
        n = self.recalibration_batches()
        if stage.recalibrates and n and has_batch_norm(built.net):
            with stage.recalibrating():
                recalibrate_batch_norm(built.net, self._micro_batches(n))
            return "recalibrated"
        return ""

    def recalibration_batches(self) -> int:
        """Micro-batches `train.recalibrate_batch_norm` asks for (0: off)."""
        setting = self.cfg.train.recalibrate_batch_norm
        if setting in ("off", False):
            return 0
        if setting in ("auto", True):
            return self.auto_batches()
        return int(setting)

    def auto_batches(self) -> int:
        """Micro-batches of about 2,000 examples in all, at most an epoch's."""
        b = self.plan.batches
        per_epoch = self.steps_per_epoch * b.replicas * b.accumulation
        return max(1, min(-(-2048 // b.per_replica), per_epoch))

    def _micro_batches(self, n: int):
        """n micro-batches to re-estimate batch norm or calibrate ranges with, in update
        order: the same groups on any topology of one global batch (docs/training.md)."""
        b = self.plan.batches
        if self.smoke:
            n = min(n, self.cfg.train.smoke_steps * b.replicas * b.accumulation)
        whole = -(-n // b.accumulation)                    # replica batches holding them
        return self._batches(whole).unbatch().batch(b.per_replica).take(n)

    def _batches(self, n: int):
        """n replica batches in order, through `data.augment`'s deterministic steps only
        (the same on every worker and rerun); under --smoke, at most its updates'."""
        if self.smoke:
            n = min(n, self.cfg.train.smoke_steps * self.plan.batches.replicas)
        steps = [op for op in augment.build(self.cfg.data.augment) if op.deterministic]
        return train_dataset(self.plan.training_source, self.plan.batches, self.cfg.data,
                             self.cfg.run.seed, ops=steps).take(n)

    def _evaluate(self, model) -> dict:
        metrics = model.evaluate(self.val, steps=self.cfg.train.smoke_steps if self.smoke else None,
                                 return_dict=True, verbose=0)
        return {f"val_{k}": float(v) for k, v in metrics.items()}

    def _record(self, stage, result: dict) -> None:
        self.results[stage.name] = result
        if self.chief:
            atomic_write(self.record, json.dumps(self.results, indent=2) + "\n")

    def clean_up(self) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


class Saved(NamedTuple):
    """Where a stage is checkpointed: checkpoint, its manager, the directory restored from."""
    ckpt: object
    manager: object
    directory: object


def fit(model, train, val, start, epochs, steps_per_epoch, callbacks, options: dict) -> None:
    """fit from optimizer update `start` (mid-epoch if need be) to the end of the stage;
    `options`: Keras' `validation_steps` and `verbose`."""
    if start >= epochs * steps_per_epoch:
        return
    internals.start_fit_at(model, ResumePoint(start))   # fit starts at (epoch, step) of `start`
    held = heap.FrozenWhileFitting(epochs * steps_per_epoch - start)   # (collections' work)
    try:
        model.fit(train, epochs=epochs, steps_per_epoch=steps_per_epoch, validation_data=val,
                  callbacks=[*callbacks, held], **options)
    finally:
        internals.start_fit_at(model, None)
        held.release()


def scratch_dir(run_path: Path) -> Path:
    """A non-chief worker's checkpoint directory: named after the run and the worker, so
    a relaunch after a crash clears what the crashed worker left."""
    key = hashlib.sha256(str(run_path.resolve()).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"tftrain-worker-{key}-{cluster_spec()[2]}"
    shutil.rmtree(path, ignore_errors=True)
    return path
