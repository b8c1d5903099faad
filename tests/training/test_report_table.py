"""The printed report: metrics, each stage's cost and gain, artifacts with their paths,
sizes and speed, the input row with the machine's load, rows within 120 columns."""
from tftrain.training.report_table import report_table


def test_report_table_lists_metrics_and_artifacts():
    table = report_table({"status": "completed", "strategy": "mirrored", "replicas": 2,
                          "precision": "float32", "global_batch_size": 64, "epochs": 1, "steps": 3,
                          "throughput": {"examples_per_sec": 10.0}, "metrics": {"val_accuracy": 0.5},
                          "artifacts": {"saved_model": {"size_bytes": 10, "gzip_bytes": 5, "accuracy": 0.5}}})
    assert "val_accuracy" in table and "0.5000" in table and "export saved_model" in table


def test_report_table_shows_what_each_stage_cost_and_gained():
    stage = lambda updates, seconds, acc: {"updates": updates, "seconds": seconds,  # noqa: E731
                                           "metrics": {"val_accuracy": acc}}
    table = report_table({"status": "completed", "strategy": "mirrored", "replicas": 2,
                          "precision": "float32", "global_batch_size": 64, "epochs": 1, "steps": 3,
                          "throughput": {"examples_per_sec": 10.0}, "metrics": {"val_accuracy": 0.97},
                          "stages": {"train": stage(3, 12.2, 0.99), "prune": stage(4, 5.0, 0.9725),
                                     "qat": stage(2, 3.0, 0.97)},
                          "sparsity": {"dense": 0.8},
                          "artifacts": {"tflite_int8": {"size_bytes": 10, "gzip_bytes": 5,
                                                        "accuracy": 0.97, "latency_ms": 0.0123}}})
    lines = table.splitlines()
    assert any(l.split() == ["stage", "train", "3", "updates,", "12", "s,", "val_accuracy", "0.9900"] for l in lines)
    assert any("stage prune" in l and "0.9725 (-1.75 pt)" in l for l in lines)
    assert any("stage qat" in l and "(-0.25 pt)" in l for l in lines)
    assert any(l.split() == ["sparsity", "dense", "0.800"] for l in lines)
    assert "0.012 ms/example" in table


def _rows(table: str) -> list[str]:
    """The table's rows, a row wrapped over several lines joined again."""
    rows = []
    for line in table.splitlines():
        if line.startswith(" " * 10) and rows:
            rows[-1] += " " + line.strip()
        else:
            rows.append(line)
    return rows


def test_report_table_prints_the_speedup_beside_the_float_file_or_leaves_it_out():
    grid = {"batch1_threads1": 1.0, "batch32_threads1": 0.5, "batch1_threadsall": 0.8,
            "batch32_threadsall": 0.4}
    beside = {k: 3 * v for k, v in grid.items()}
    art = {"size_bytes": 10, "gzip_bytes": 5, "accuracy": 0.97, "latency_grid": grid,
           "float_latency_grid": beside, "speedup_vs_float": {k: 2.5 for k in grid}}
    summary = {"status": "completed", "strategy": "mirrored", "replicas": 2,
               "precision": "float32", "global_batch_size": 64, "epochs": 1, "steps": 3,
               "throughput": {"examples_per_sec": 10.0}, "metrics": {"val_accuracy": 0.97},
               "artifacts": {"tflite_int8": art}}
    row = [l for l in _rows(report_table(summary)) if "tflite_int8 vs float" in l]
    # the median of the rounds' ratios (2.5), not the ratio of the medians (3.0)
    assert len(row) == 1 and "1 thread 3.000 / 1.500" in row[0]
    assert row[0].endswith("runs 2.50x / 2.50x as fast on 1 thread (the median of rounds "
                           "timed in turn)")
    del art["speedup_vs_float"]            # a summary written before the field existed
    row = [l for l in _rows(report_table(summary)) if "tflite_int8 vs float" in l]
    assert len(row) == 1 and row[0].endswith("every core 2.400 / 1.200")


def test_the_input_row_names_other_processes_load():
    base = {"status": "completed", "strategy": "mirrored", "replicas": 2, "global_batch_size": 64,
            "precision": "float32", "epochs": 3, "steps": 69, "metrics": {}, "artifacts": {}}
    busy = {"examples_per_sec": 1000.0, "input_wait": 0.55, "input_wait_ms_per_batch": 1.9,
            "host_ms_per_call": 3.0, "host": {"steps_per_execution": 23, "checks": 2},
            "others_cores": 1.04}
    row = [line for line in _rows(report_table({**base, "throughput": busy}))
           if line.startswith("input")]
    assert row == ["input       waits 1.90 ms per batch (55.0% of the time); host 3.0 ms "
                   "per call of 23 steps (2 checks); other processes kept 1.0 cores busy meanwhile"]
    idle = {**busy, "others_cores": 0.02}
    row = [line for line in _rows(report_table({**base, "throughput": idle})) if line.startswith("input")]
    assert row[0].endswith("(2 checks)")


def test_ops_xnnpack_leaves_to_the_cpu_are_counted_by_kind_not_named_one_by_one():
    fused = ("mobilenetv2/block_{0}_depthwise_relu/Relu6;mobilenetv2/block_{0}_depthwise_BN/"
             "FusedBatchNormV3;mobilenetv2/block_{0}_depthwise/depthwise1")
    art = {"size_bytes": 10, "gzip_bytes": 5, "accuracy": 0.1,
           "latency_grid": {"batch1_threads1": 0.059, "batch32_threads1": 0.05,
                            "batch1_threadsall": 0.075, "batch32_threadsall": 0.048},
           "xnnpack": {"delegated": 56,
                       "fallback": [f"DEPTHWISE_CONV_2D ({fused.format(i)})" for i in range(7, 17)]
                       + ["MEAN (mobilenetv2/global_average_pooling2d/Mean)"]}}
    table = report_table({"status": "completed", "strategy": "one_device", "replicas": 1,
                          "precision": "float32", "global_batch_size": 64, "epochs": 1, "steps": 3,
                          "throughput": {"examples_per_sec": 10.0}, "metrics": {},
                          "artifacts": {"tflite_dynamic": art}})
    assert "mobilenetv2/" not in table
    words = " ".join(table.split())         # the row wraps at 120 columns
    assert "XNNPack runs 56 ops, not DEPTHWISE_CONV_2D x10, MEAN" in words
    assert sum("latency" in line for line in table.splitlines()) == 1


def test_layers_of_equal_sparsity_share_one_entry():
    """A pruned MobileNetV2 printed 36 layers at 0.500 over 9 lines: equal values are one
    entry with the count and the first and last layer, a value of its own stays named."""
    from tftrain.training.report_table import grouped
    sparsity = {f"block_{i}_project": 0.5 for i in range(36)}
    sparsity.update({"Conv1": 0.4999, "logits": 0.8})
    assert grouped(sparsity) == "logits 0.800, 0.500 x 37 layers (block_0_project ... Conv1)"
    assert grouped({"dense": 0.8, "conv": 0.25}) == "dense 0.800, conv 0.250"
