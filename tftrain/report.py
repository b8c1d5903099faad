"""summary.json: what the run did, from its plan, each stage's results and the exported
artifacts (the printed table is `training.report_table`)."""
from __future__ import annotations

import hashlib

from tftrain.core.exit_codes import BUDGET_MISSED, COMPLETED, EXPORT_FAILED
from tftrain.export import kinds


def _recompute(how) -> str:
    return "none" if how is None else how[0] if how[1] is None else f"every {how[1]} layers"


def summary(plan, results: dict, artifacts: dict, net) -> dict:
    """The run's summary; `net` is the model the last stage finished with."""
    from tftrain.export.verification import best_within_budget, failures, only_budget_missed

    first = results.get("train", results[plan.stages[0].name])     # training
    info, b, wire, peak = plan.parallel.info, plan.batches, plan.precision.wire, plan.peak
    out = {
        "status": (COMPLETED if not failures(artifacts) else
                   BUDGET_MISSED if only_budget_missed(artifacts) else EXPORT_FAILED),
        "steps": first["updates"], "epochs": first["epochs"],    # updates made
        "steps_per_epoch": plan.steps_per_epoch,
        "replicas": info.replicas, "workers": info.workers, "strategy": info.kind,
        "devices": list(info.devices), "precision": plan.precision.policy,
        "all_reduce": {"dtype": wire.dtype, "loss_scaled": wire.loss_scaled, "nccl": wire.nccl},
        "per_replica_batch_size": b.per_replica, "accumulation_steps": b.accumulation,
        "global_batch_size": b.global_batch,
        "metrics": results[plan.stages[-1].name]["metrics"],
        "throughput": {"examples_per_sec": first["examples_per_sec"],
                       "flops_per_example": plan.flops_per_example,
                       "model_flops_per_sec": first.get("model_flops_per_sec", 0.0),
                       "mfu": first.get("mfu", 0.0),
                       "peak_flops_per_sec": peak.flops, "peak_device": peak.description,
                       "peak_flops_measured": peak.measured,
                       "peak_flops_theoretical": peak.theoretical,
                       "input_wait": first.get("input_wait"),
                       "input_wait_ms_per_batch": first.get("input_wait_ms_per_batch"),
                       "host_ms_per_call": first.get("host_ms_per_call"),
                       "others_cores": first.get("others_cores"),
                       "host": first.get("host")},
        **plan.parallel.summary(net, lambda: _one_batch(plan), plan.stages[-1].loss()),
        # the training stage's allocator peak beside the planner's estimate (each stage's
        # under "stages"), and how it recomputed activations
        "memory": first.get("memory"),
        "recompute": _recompute(plan.stages[0].recompute(plan)),
        "stages": results, "sparsity": _sparsity(results),
        "artifacts": artifacts, "smoke": plan.smoke,
    }
    if out["status"] == BUDGET_MISSED:
        out["ship"] = best_within_budget(artifacts)       # what to deploy instead (or None)
    confusion = _confusion(plan, net)
    if confusion is not None:
        out["confusion"] = confusion
    source = _model_source(plan.cfg.model.name)
    if source:
        out["model_source"] = source
    headline = deployed_accuracy(out["metrics"], plan.stages[-1].name, artifacts)
    if headline is not None:
        out["accuracy"] = headline
    if plan.preflight is not None:
        out["preflight"] = {"seconds": plan.preflight.seconds,
                            "artifacts": list(plan.preflight.artifacts)}
    last = results[plan.stages[-1].name]
    if "raw_metrics" in last:
        out["raw_metrics"] = last["raw_metrics"]      # the weights before averaging
    return out


GAP_PT = 0.2         # a stage/artifact accuracy gap (points) the report explains


def deployed_accuracy(metrics: dict, stage: str, artifacts: dict) -> dict | None:
    """The run's headline accuracy: the deployed artifact's (what the run was compressed
    for first: `kinds.headline_order`), beside the last stage's evaluation of the same
    model; a gap above `GAP_PT` points comes with what differs (an int8 artifact's
    noisiest layers, or a float one's logits)."""
    name = next((n for n in kinds.headline_order() if "accuracy" in artifacts.get(n, {})), None)
    if name is None or "val_accuracy" not in metrics:
        return None
    art, evaluated = artifacts[name], metrics["val_accuracy"]
    out = {"value": art["accuracy"], "artifact": name, "stage": stage,
           "stage_value": evaluated, "gap_pt": round((evaluated - art["accuracy"]) * 100, 2)}
    if abs(out["gap_pt"]) > GAP_PT:
        if art.get("layers"):
            rows = {r["layer"]: r for r in art["layers"]}
            out["explanation"] = "noise added most at " + ", ".join(
                f"{n} ({rows[n]['local_sqnr_db']:.1f} dB, {rows[n]['op']})"
                for n in art["worst_layers"][:3]) + f"; {art.get('label', name)}"
        else:
            out["explanation"] = (f"its logits are up to {art.get('max_abs_logit_diff', 0):.3g} "
                                  "from the in-memory model's")
    return out


def _sparsity(results: dict) -> dict:
    """Each pruned layer's fraction of zeros in the final model: as the quantized kernels
    hold them after QAT, else as pruning left them."""
    pruned = results.get("prune", {}).get("sparsity", {})
    final = results.get("qat", {}).get("sparsity", {})
    return {name: final.get(name, value) for name, value in pruned.items()}


def _confusion(plan, net, most: int = 50) -> list[list[int]] | None:
    """The validation confusion matrix of the final model (rows: true class, columns:
    predicted), for up to `most` classes."""
    import numpy as np

    from tftrain.data import BatchPlan, val_dataset

    classes = plan.training_source.spec.num_classes
    if classes > most:
        return None
    matrix = np.zeros((classes, classes), np.int64)
    for x, y in val_dataset(plan.training_source, BatchPlan(256, 1, 1), plan.cfg.data):
        predicted = np.argmax(net(x, training=False).numpy(), axis=-1)
        np.add.at(matrix, (y.numpy().astype(int), predicted), 1)
    return matrix.tolist()


def _model_source(name: str) -> dict | None:
    """Where the model came from, when it is not one of tftrain's builders: a file (its
    writer, form, layers, the conversion's output difference) or a Keras 3 builder."""
    from dataclasses import asdict

    from tftrain.models import came_in_as_keras3
    from tftrain.models.files import origin

    found = origin(name)
    if found is not None:       # (lists, as summary.json reads them back)
        return {"kind": "file", **{k: list(v) if isinstance(v, tuple) else v
                                   for k, v in asdict(found).items()}}
    if came_in_as_keras3(name):
        from tftrain.models.keras3 import CONVERTED
        return {"kind": "keras3 builder", "builder": name, "converted_diff": CONVERTED.get(name)}
    return None


def _one_batch(plan):
    x, y = next(iter(plan.training_source.calibration(plan.batches.per_replica)
                     .batch(plan.batches.per_replica)))
    return x, y


def weights_digest(model) -> str:
    """A fingerprint of the weights: equal on every worker of a data-parallel run."""
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(w.tobytes())
    return digest.hexdigest()[:16]
