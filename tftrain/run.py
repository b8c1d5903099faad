"""`python -m tftrain.run CONFIG`: the whole pipeline, top to bottom.

config -> plan -> strategy -> precision -> data -> model -> optimizer -> fit ->
evaluate -> export -> verify -> summary.json and a report table.

Exit codes: 0 done, 2 bad config or arguments, 1 runtime failure (a failed export check
included), 42 stopped by SIGTERM or SIGINT at a safe point (rerun the same command to
resume).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import traceback

import tftrain  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
from tftrain.config import Config, ConfigError, json_schema, load_config
from tftrain.preemption import Preempted, Preemption
from tftrain.stages import StageRunner, compile_stage, plan_stages

EXIT_CONFIG, EXIT_RUNTIME, EXIT_PREEMPTED = 2, 1, 42


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
        with Preemption() as stop:      # SIGTERM/SIGINT from here on: stop at a safe point
            run(cfg, dry_run=args.dry_run, smoke=args.smoke, stop=stop)
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


def run(cfg: Config, dry_run: bool = False, smoke: bool = False,
        stop: Preemption | None = None) -> dict | None:
    """Run the pipeline for `cfg`; returns the summary (None for a dry run). `stop`: the
    flag SIGTERM/SIGINT set (`with Preemption() as stop`); the run raises `Preempted` at
    the next safe point after it is set; by default one is installed for the run."""
    if stop is None:
        with Preemption() as stop:
            return _pipeline(cfg, dry_run, smoke, stop)
    return _pipeline(cfg, dry_run, smoke, stop)


def _pipeline(cfg: Config, dry_run: bool, smoke: bool, stop: Preemption) -> dict | None:
    # TensorFlow is imported only once the config has parsed: a typo costs no TF start-up.
    import tensorflow as tf

    from tftrain import compression, data, export, placement, planner, precision, rundir, strategy
    from tftrain._keras import keras
    from tftrain.models import build_model

    # -- plan: devices, strategy, precision, data, batches, stages (nothing written yet) --
    _reject_unavailable(cfg)
    strategy.configure_devices(cfg)                  # logical devices first, before any op
    planned_here = not (smoke or strategy.cluster_spec()[1] > 1)
    if not planned_here:                             # then the collectives, before all else
        strat = strategy.build_strategy(cfg, force_one_device=smoke)
        stop.rearm()                                 # (the collectives' own SIGTERM handler)
    keras.backend.experimental.enable_tf_random_generator()   # RNG state checkpointable
    if cfg.run.deterministic:
        tf.config.experimental.enable_op_determinism()
    policy = precision.choose_policy(cfg.precision)
    precision.apply_policy(policy)
    source = data.load_source(cfg.data, cfg.run.seed)
    if source.num_val == 0:
        raise ConfigError(f"data.validation_fraction: {cfg.data.validation_fraction} leaves no "
                          "validation examples; raise it (e.g. 0.15) or give a validation split")
    placed, memory_plan = None, None
    if planned_here:        # one machine: the planner chooses data or model parallelism
        strat, placed, memory_plan = _parallelism(cfg, policy, source)
    info = strategy.describe(strat) if placed is None else strategy.StrategyInfo(
        "model_parallel", placed.devices, 1, 1)
    plan = data.plan_batches(cfg, info.replicas, memory_plan.accumulation
                             if memory_plan and cfg.train.global_batch_size else None)
    if placed and plan.per_replica % placed.microbatches:
        raise ConfigError(f"model.placement.microbatches: {placed.microbatches} does not divide "
                          f"the batch of {plan.per_replica}; use a divisor of it")
    layout = data.epoch_layout(source, plan, cfg.data, info.workers)
    steps_per_epoch = layout.steps(plan)
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
        model, optimizer = compile_stage(cfg, net, plan, policy, stages[0], steps_per_epoch,
                                         placed=placed)
    flops = sum(c.flops for c in placement.layer_costs(net))
    print(_plan_text(strat, info, policy, plan, source, steps_per_epoch, stages, pruning, model),
          flush=True)
    wire = precision.all_reduce_plan(cfg.distribute, strat, policy)
    if info.replicas > 1:
        print(wire.describe(), flush=True)
    print(data.describe(source, layout, cfg.data), flush=True)
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
    # Model FLOP utilisation is quoted against the training devices' measured peak.
    peak = planner.peak_flops(placed.devices if placed else strategy.local_devices(strat), policy,
                              info.workers)
    source = data.cached(source, cfg.data)     # the decoded set in memory when it fits
    runner = StageRunner(cfg, strat, info, plan, source, run, chief, steps_per_epoch, smoke,
                         flops, peak.flops, stop)

    # -- stages: train -> prune (+ fine-tune) -> QAT, each checkpointed and resumable --------
    results = {"train": runner.run_stage(stages[0], model, optimizer)}
    if len(stages) > 1 and chief and "float32_variables_gzip_bytes" not in results["train"]:
        results["train"]["float32_variables_gzip_bytes"] = export.saved_model_variables_gzip(net)
    for stage in stages[1:]:
        if stage.name == "prune":
            with strat.scope():
                net = compression.prune_model(net, cfg.compression.pruning, pruning)
                hooks = [compression.PruningHook(net)]
                model, optimizer = compile_stage(cfg, net, plan, policy, stage, steps_per_epoch,
                                                 hooks, placed=placed)
            extra = [compression.SparsityLogger(net)]
        else:
            # tfmot's fake-quant ops take float32 only: QAT runs on a float32 copy.
            precision.apply_policy("float32")
            base = compression.strip(net) if pruning else net
            with strat.scope():
                net = compression.quantize_model(
                    export.inference_model(base), cfg.compression.quantization,
                    preserve_sparsity=bool(pruning) and cfg.compression.quantization.preserve_sparsity)
                model, optimizer = compile_stage(cfg, net, plan, "float32", stage,
                                                 steps_per_epoch, unroll=True, placed=placed)
            extra = []
        results[stage.name] = runner.run_stage(stage, model, optimizer, extra)
        if stage.name == "prune":
            results["prune"]["sparsity"] = compression.sparsity(net)

    # -- export, verify, report ------------------------------------------------------------
    final = compression.strip(net) if stages[-1].name == "prune" else net
    qat = stages[-1].name == "qat"
    runner.stop.check("after the last stage", runner.agree)
    artifacts = export.export_all(final, cfg.export, run.export, source, qat=qat,
                                  data_cfg=cfg.data) if chief else {}
    runner.stop.check("after the export (the rerun exports again and reports)", runner.agree)
    bubble = {}
    if placed is not None:      # the pipeline's idle fraction, measured on one batch
        from tftrain.train_step import build_loss
        x, y = next(iter(source.calibration(plan.per_replica).batch(plan.per_replica)))
        bubble = placement.measure_bubble(net, placed, x, y, build_loss(cfg.train.loss))
    summary = {
        "status": "completed", "steps": results["train"]["updates"],   # updates made
        "epochs": results["train"]["epochs"], "steps_per_epoch": steps_per_epoch,
        "replicas": info.replicas, "workers": info.workers, "strategy": info.kind,
        "devices": list(info.devices), "precision": policy,
        "all_reduce": {"dtype": wire.dtype, "loss_scaled": wire.loss_scaled, "nccl": wire.nccl},
        "per_replica_batch_size": plan.per_replica, "accumulation_steps": plan.accumulation,
        "global_batch_size": plan.global_batch,
        "metrics": results[stages[-1].name]["metrics"],
        "throughput": {"examples_per_sec": results["train"]["examples_per_sec"],
                       "flops_per_example": flops,
                       "model_flops_per_sec": results["train"].get("model_flops_per_sec", 0.0),
                       "mfu": results["train"].get("mfu", 0.0),
                       "peak_flops_per_sec": peak.flops, "peak_device": peak.description,
                       "input_wait": results["train"].get("input_wait")},
        "placement": None if placed is None else {
            "devices": list(placed.devices), "microbatches": placed.microbatches,
            "balance": placed.balance, "stage_costs": list(placed.costs),
            "stages": [[n for n, s in zip(placed.layers, placed.stage) if s == k]
                       for k in range(placed.num_stages)],
            "bubble_formula": placed.bubble(), **bubble},
        "memory_plan": None if memory_plan is None else {
            "kind": memory_plan.kind, "stages": memory_plan.stages,
            "device_memory": memory_plan.memory,
            "bytes_per_device": [e.total for e in memory_plan.per_device]},
        "stages": results, "sparsity": results.get("prune", {}).get("sparsity", {}),
        "artifacts": artifacts, "smoke": smoke,
    }
    failed = export.failures(artifacts)
    if failed:     # the artifacts stay, marked failed; the run is not completed
        summary["status"] = "export verification failed"
    print(f"final weights sha256: {_weights_digest(model)}")
    if chief:
        rundir.write_summary(run, summary)
    runner.clean_up()
    print(rundir.report_table(summary))
    if failed:
        raise RuntimeError(f"export verification failed: {'; '.join(failed)}; the artifact is "
                           "marked failed in summary.json (loosen export.max_logit_diff or "
                           "export.max_accuracy_drop only if the difference is expected)")
    return summary


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
    base = placement.build(lambda: precision.float32_outputs(build_model(cfg.model, source.spec)))
    costs = placement.layer_costs(base)
    batch, acc = cfg.data.per_replica_batch_size, cfg.train.accumulation_steps
    if cfg.model.placement is not None:
        wanted = cfg.model.placement.devices
        missing = strategy.missing_devices(wanted)
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
