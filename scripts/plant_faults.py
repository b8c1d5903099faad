"""Plant realistic faults in tftrain, one at a time, and name the tests that catch each.

Each fault is an edit of one source line, of the kind a refactoring could make by
mistake. For each, the tree is copied to a temporary directory, the edit applied there
(the original text must be found exactly once, so a fault that no longer applies fails
loudly), and the tests listed for it are run against the copy; a fault is caught when at
least one of them fails that passes on the tree as it is (the control: every listed test
run once with nothing planted). Prints a table (markdown) and exits 1 if a fault went
uncaught.

    python scripts/plant_faults.py                    # every fault (about 20 minutes)
    python scripts/plant_faults.py --fault accumulation_short
    python scripts/plant_faults.py --list
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def matrix_row(**wanted) -> str:
    """The node id of the first feature-matrix row that runs with these values (each a
    value or a tuple of values). The rows are re-chosen whenever the matrix's cost model
    or dimensions change, so a fault names what its row must hold, not a pinned id."""
    for folder in (ROOT / "tests", ROOT / "tests" / "e2e"):     # (once, however often called)
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    import test_matrix
    for row in test_matrix.ROWS:
        if all(row[k] in (v if isinstance(v, tuple) else (v,)) for k, v in wanted.items()):
            return ("tests/e2e/test_matrix.py::test_every_combination_works_or_is_refused_"
                    f"before_training[{test_matrix._id(row)}]")
    raise LookupError(f"no row of the feature matrix holds {wanted}")


REPLICAS = ("mirrored", "multi_worker")


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    path: str             # the file edited
    old: str              # the text replaced (exactly once)
    new: str
    tests: tuple[str, ...]


FAULTS = [
    Fault("gradients_not_divided_by_replicas",
          "gradients not divided by the replica count (each replica's loss scaled back up)",
          "tftrain/training/train_step.py",
          "loss = self.compute_loss(x, y, y_pred, sample_weight) / self.accumulation_steps",
          "loss = self.compute_loss(x, y, y_pred, sample_weight) / self.accumulation_steps"
          " * tf.distribute.get_replica_context().num_replicas_in_sync",
          ("tests/training/test_train_step.py::test_mirrored_two_replicas_equals_one_device_double_batch",
           matrix_row(strategy="mirrored", optimizer="sgd"))),
    Fault("accumulation_short",
          "gradient accumulation one micro-batch short",
          "tftrain/training/train_step.py",
          "_, grads = tf.while_loop(lambda i, _: i < n, accumulate, start, parallel_iterations=1)",
          "_, grads = tf.while_loop(lambda i, _: i < n - 1, accumulate, start, parallel_iterations=1)",
          ("tests/training/test_train_step.py::test_accumulation_equals_large_batch",)),
    Fault("padding_in_metrics",
          "padding slots counted in the metrics (plain metrics instead of weighted ones)",
          "tftrain/training/train_step.py",
          "self.compile(optimizer=optimizer, loss=loss, weighted_metrics=list(metrics),",
          "self.compile(optimizer=optimizer, loss=loss, metrics=list(metrics),",
          ("tests/training/test_train_step.py::test_training_metrics_leave_out_the_padding_slots",)),
    Fault("int8_scale_x8",
          "one layer's int8 kernel scale 8x too large in the int8 SavedModel",
          "tftrain/export/int8_saved_model.py",
          'getattr(target, f"{attr}_scale").assign(codes.scale)',
          'getattr(target, f"{attr}_scale").assign(codes.scale * (8 if not described else 1))',
          ("tests/export/test_int8_saved_model.py",)),
    Fault("batch_norm_not_re_estimated",
          "batch-norm re-estimation skipped at a stage's end",
          "tftrain/stages/runner.py",
          "        if stage.recalibrates and n and has_batch_norm(built.net):",
          "        if False and stage.recalibrates and n and has_batch_norm(built.net):",
          ("tests/stages/test_stages.py",)),
    Fault("resume_one_batch_off",
          "a resumed run's data one batch ahead of its checkpoint",
          "tftrain/stages/runner.py",
          "self.cfg.run.seed, start, plan.layout.streams)",
          "self.cfg.run.seed, start + (start > 0), plan.layout.streams)",
          ("tests/e2e/test_run.py::test_killed_augmented_run_resumes_exactly",)),
    Fault("validation_subset_after_resume",
          "validation on one batch per call once the calls are resized (Keras' one-step "
          "test function kept)",
          "tftrain/training/train_step.py",
          "        if not self._traced_once(self.resizable_calls):\n            return super().make_test_function(force)",
          "        if not self._traced_once(False):\n            return super().make_test_function(force)",
          ("tests/training/test_train_step.py::test_calls_resized_after_the_first_validation_still_evaluate_every_batch",)),
    Fault("epoch_metrics_lost_on_resume",
          "an epoch's running training metrics not carried across a mid-epoch resume",
          "tftrain/training/callbacks.py",
          "        for variable, value in self.values:\n            variable.assign(value)",
          "        for variable, value in self.values:\n            pass",
          ("tests/e2e/test_elastic.py::test_a_run_resumed_on_another_topology_reports_what_the_uninterrupted_run_reports",)),
    Fault("skipped_update_counted",
          "an update skipped by float16 loss scaling counted as one",
          "tftrain/training/train_step.py",
          "            optimizer.iterations.assign_sub(tf.cast(skipped, tf.int64))",
          "            optimizer.iterations.assign_sub(tf.cast(skipped, tf.int64) * 0)",
          ("tests/training/test_train_step.py::test_an_update_skipped_at_the_loss_scale_floor_is_not_counted",)),
    Fault("learning_rate_step_after_resume",
          "the schedule one update ahead after a resume",
          "tftrain/stages/runner.py",
          "        start = self._rebatch(stage, ckpt, optimizer) if restored else 0\n",
          "        start = self._rebatch(stage, ckpt, optimizer) if restored else 0\n"
          "        if restored:\n            optimizer.iterations.assign_add(1)\n",
          ("tests/e2e/test_run.py::test_killed_augmented_run_resumes_exactly",)),
    Fault("wrong_channels_kept",
          "channel pruning keeps the least important channels",
          "tftrain/compress/channels.py",
          "np.argsort(-scores[g], kind=\"stable\")",
          "np.argsort(scores[g], kind=\"stable\")",
          ("tests/compress/test_channels.py",)),
    Fault("mixup_across_micro_batches",
          "mixup pairs examples across the replica batch, not within each micro-batch",
          "tftrain/data/pipeline.py",
          "            for k in range(b // micro):",
          "            micro = b\n            for k in range(b // micro):",
          ("tests/data/test_data.py::test_batch_augmentation_pairs_within_micro_batches_alike_on_replicas_or_accumulating",)),
    # the code behind "verified"
    Fault("accuracy_drop_sign",
          "a reduced-precision file's accuracy drop counted the wrong way round",
          "tftrain/export/verification.py",
          '            drop = accuracy - entry["accuracy"]',
          '            drop = entry["accuracy"] - accuracy',
          ("tests/export/test_verification.py::test_verification_has_teeth",)),
    Fault("layers_judged_by_the_floor_alone",
          "a layer's noise no longer held to what its 8-bit steps allow",
          "tftrain/export/layer_noise.py",
          '    if row.get("tensors", 1) == 1 and local < row.get("allowed_sqnr_db", float("-inf")) - LEEWAY_DB:',
          '    if row.get("tensors", 1) == 1 and local < row.get("allowed_sqnr_db", float("-inf")) - 10 * LEEWAY_DB:',
          ("tests/export/test_layer_noise.py",
           "tests/export/test_fidelity.py::test_a_layer_is_held_to_what_its_own_8_bit_steps_allow")),
    Fault("local_noise_accumulated",
          "a layer's added noise measured against the model's own values, not against what "
          "the file fed it",
          "tftrain/export/fidelity.py",
          '           "local_sqnr_db": round(sqnr_db(local, got), 2),',
          '           "local_sqnr_db": round(sqnr_db(reference[name], got), 2),',
          ("tests/export/test_fidelity.py::test_every_layer_of_the_int8_file_is_compared_and_a_widened_range_is_named_worst",)),
    Fault("tensor_named_by_a_suffix",
          "a TFLite tensor matched to a layer whose name is only part of its own",
          "tftrain/export/file_tensors.py",
          "                     if not any(a <= i and j <= b and (a, b) != (i, j) for a, b in spans))",
          "                     if True)",
          ("tests/export/test_fidelity.py::test_layers_whose_names_hold_a_slash_are_each_compared",)),
    Fault("logit_noise_not_centred",
          "logit SQNR taken without removing each example's mean (which a softmax ignores)",
          "tftrain/export/measures.py",
          "    noise = diff - diff.mean(axis=-1, keepdims=True)",
          "    noise = diff",
          ("tests/export/test_measures.py",)),
    Fault("loss_scale_not_removed",
          "float16 gradients applied still multiplied by the loss scale",
          "tftrain/training/train_step.py",
          "                    unscaled.append(self.precision.unscale(optimizer, g))",
          "                    unscaled.append(g)",
          ("tests/training/test_train_step.py::test_mirrored_float16_with_loss_scaling_equals_one_device_within_float16_rounding",)),
    Fault("hard_sigmoid_range_wrong",
          "QAT's hard-sigmoid gate quantized on [0, 6] where the int8 file holds [0, 1]",
          "tftrain/compress/qat_configs.py",
          "        return _UNIT(six * (1.0 / 6.0), False, {})",
          "        return _RELU6(six * (1.0 / 6.0), False, {})",
          ("tests/compress/test_compression.py::test_hard_swish_and_squeeze_excite_quantize_to_int8_ops_xnnpack_runs",)),
    Fault("preflight_skips_onnx",
          "the export preflight converts every export but ONNX",
          "tftrain/export/preflight.py",
          "            report = exports.export_all(model, cfg, Path(tmp), sample, ExportFlags(",
          "            report = exports.export_all(model, cfg.model_copy(update={'export': "
          "cfg.export.model_copy(update={'onnx': False})}), Path(tmp), sample, ExportFlags(",
          ("tests/export/test_preflight.py::test_an_op_onnx_runtime_cannot_run_is_refused_naming_the_onnx_export",)),
    Fault("reference_timed_twice",
          "an int8 file's speed-up measured with the float file timed in its place",
          "tftrain/export/speed.py",
          "    times, float_times = round_times(tflite_makers([blob, beside], x), x, 0.05, 3)",
          "    times, float_times = round_times(tflite_makers([beside, beside], x), x, 0.05, 3)",
          ("tests/export/test_speed.py::test_files_timed_in_turn_keep_their_order_of_speed",)),
    Fault("qat_range_frozen",
          "QAT's activation ranges left at tfmot's [-6, 6] when calibrated (the upper end frozen)",
          "tftrain/compress/quantization.py",
          "        high_var.assign(np.maximum(high, 0.0).astype(np.float32).reshape(high_var.shape))",
          "        high_var.assign(high_var)",
          ("tests/compress/test_compression.py::test_calibrated_ranges_are_the_min_and_max_each_quantizer_sees",)),
    Fault("layer_compared_with_itself",
          "each layer's own noise measured against the model's layer itself (always none)",
          "tftrain/export/fidelity.py",
          '           "local_sqnr_db": round(sqnr_db(local, got), 2),',
          '           "local_sqnr_db": round(sqnr_db(local, local), 2),',
          ("tests/export/test_fidelity.py",)),
    Fault("calibration_ranges_not_remeasured",
          "int8 calibration keeps the ranges LiteRT's memory plan wrote over",
          "tftrain/export/calibration.py",
          "        return remeasured(original(self, dataset_gen), dataset_gen)",
          "        return original(self, dataset_gen)",
          ("tests/export/test_calibration.py::test_a_gate_of_the_features_shape_keeps_its_own_range",
           "tests/export/test_export.py::test_post_training_int8_of_hard_swish_is_int8_ops_xnnpack_runs")),
    Fault("uncompared_layers_ignored",
          "a layer the per-layer comparison did not find in the file counted as compared",
          "tftrain/export/fidelity.py",
          "        return (layer.name not in moved and len(readers) == 1 and depth < len(layers)",
          "        return True or (layer.name not in moved and len(readers) == 1 and depth < len(layers)",
          ("tests/export/test_fidelity.py::test_a_layer_with_weights_the_file_has_no_tensor_of_is_named_uncompared",)),
    Fault("private_read_through_self",
          "an optimizer's momentum slot read through its private index (`self._index_dict`, "
          "`self._var_key`) outside `core/internals.py`",
          "tftrain/optim/fused.py",
          '        momentum, = internals.optimizer_slots(self, variable, "momentums")',
          "        momentum = self.momentums[self._index_dict[self._var_key(variable)]]",
          ("tests/core/test_internals.py::test_no_private_framework_attribute_is_read_through_self_outside_the_door",)),
    Fault("dry_run_exports_short",
          "the dry run's exports line leaves out the last artifact the run makes",
          "tftrain/export/kinds.py",
          "    known = [kind.title for kind in KINDS if kind.planned(cfg, qat)]",
          "    known = [kind.title for kind in KINDS if kind.planned(cfg, qat)][:-1]",
          ("tests/export/test_kinds.py::test_before_the_model_is_built_the_dry_run_names_what_the_model_decides",
           # a row that runs and exports two artifacts (a refused row's errors alone are compared)
           matrix_row(export="tflite_int8"))),
    Fault("qat_gradient_off_with_replicas",
          "the QAT stage's gradients 0.5% too large where replicas train (one device unchanged)",
          "tftrain/training/train_step.py",
          "loss = self.compute_loss(x, y, y_pred, sample_weight) / self.accumulation_steps",
          "loss = self.compute_loss(x, y, y_pred, sample_weight) / self.accumulation_steps"
          " * (1.005 if self.unroll and tf.distribute.get_replica_context().num_replicas_in_sync > 1 else 1.0)",
          (matrix_row(strategy=REPLICAS, optimizer="sgd", stages="prune+qat"),
           matrix_row(strategy=REPLICAS, optimizer="sgd", stages="channels+qat"))),
    Fault("clipping_excused",
          "a layer whose 8-bit ranges clip its values excused from the per-layer check",
          "tftrain/export/layer_noise.py",
          '    local = row["local_sqnr_db"]\n    if row.get("tensors", 1) == 1',
          '    local = row["local_sqnr_db"]\n    if row.get("saturated", 0.0) >= SATURATED:\n'
          '        return False\n    if row.get("tensors", 1) == 1',
          ("tests/export/test_fidelity.py::test_a_range_too_narrow_for_a_trained_layers_values_fails_the_layer",
           "tests/export/test_layer_noise.py::test_a_layer_fails_beyond_its_steps_or_below_the_floor_unless_rounding_limited")),
    Fault("sublayers_not_walked",
          "a layer whose kernels are its sublayers' (attention, a nested model) never named uncompared",
          "tftrain/export/fidelity.py",
          "    return any(hasattr(part, weight) for part in (inner, *inner.submodules)",
          "    return any(hasattr(part, weight) for part in (inner,)",
          ("tests/export/test_fidelity.py::test_layers_whose_weights_are_in_sublayers_are_named_uncompared_too",)),
]


def planted(fault: Fault | None, tmp: Path) -> Path:
    """A copy of the tree in `tmp` with `fault` applied (None: as it is)."""
    copy = tmp / "tree"
    skipped = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache",
                                     "*.egg-info")
    shutil.copytree(ROOT, copy, ignore=lambda where, names: set(skipped(where, names)) | (
        {"runs", "data", "sweeps", "mlruns"} & set(names) if Path(where) == ROOT else set()))
    if fault is None:
        return copy
    target = copy / fault.path
    text = target.read_text()
    if text.count(fault.old) != 1:
        raise SystemExit(f"fault {fault.name}: the text it edits is in {fault.path} "
                         f"{text.count(fault.old)} times (expected once): update the fault")
    target.write_text(text.replace(fault.old, fault.new))
    return copy


def run(fault: Fault | None, tests=()) -> tuple[list[str], float]:
    """The tests that failed with `fault` planted (None: the control, nothing planted,
    running `tests`), and the seconds it took."""
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="tftrain-fault-") as tmp:
        copy = planted(fault, Path(tmp))
        tests = fault.tests if fault else tests
        env = {**os.environ, "PYTHONPATH": str(copy)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-o", "addopts=", "-n", "2", "-rf", *tests], cwd=copy,
                              env=env, capture_output=True, text=True, timeout=3600)
        failed = sorted(set(re.findall(r"^FAILED (.+?)(?: - .*)?$", proc.stdout, re.M)))
        if proc.returncode not in (0, 1):      # not a test failing: a test not found, say
            raise SystemExit(f"fault {fault.name if fault else '(control)'}: pytest exited {proc.returncode} (its tests "
                             f"did not run as listed: update the fault): {proc.stdout[-500:]}")
    return failed, time.time() - began


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", action="append", help="plant only this fault (repeatable)")
    p.add_argument("--list", action="store_true", help="list the faults")
    args = p.parse_args(argv)
    chosen = [f for f in FAULTS if not args.fault or f.name in args.fault]
    if args.list:
        for f in FAULTS:
            print(f"{f.name}: {f.what} ({f.path})")
        return 0
    rows, missed = [], []
    # the control: every listed test on the tree as it is; a test failing there catches
    # nothing (it would fail whatever was planted)
    every = sorted({t for f in chosen for t in f.tests})
    broken, seconds = run(None, every)
    print(f"control: {len(broken)} of the listed tests fail with nothing planted "
          f"({seconds:.0f} s)" + (f": {', '.join(broken)}" if broken else ""), flush=True)
    for fault in chosen:
        failed, seconds = run(fault)
        failed = [t for t in failed if t not in broken]
        print(f"{fault.name}: {len(failed)} failing test(s) in {seconds:.0f} s", flush=True)
        rows.append(f"| `{fault.name}` | {fault.what} | `{fault.path}` | "
                    + ("<br>".join(f"`{t}`" for t in failed) or "**none**") + " |")
        if not failed:
            missed.append(fault.name)
    print("\n| fault | what | file | tests that fail |\n|---|---|---|---|")
    print("\n".join(rows))
    if missed:
        print(f"\nnot caught: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
