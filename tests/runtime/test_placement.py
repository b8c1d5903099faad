"""Model parallelism: placed models equal unplaced ones, ops and variables on their stage's
device, balanced contiguous partitions, stage rules."""
import itertools
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from helpers import ROOT, VIRTUAL_CPUS, quick_config
from tftrain.runtime import placement
from tftrain.runtime import precision
from tftrain.core.keras import keras
from tftrain.config import ConfigError, load_config
from tftrain.data import InputSpec
from tftrain.models import MODELS

SPECS = {"mlp": InputSpec((8, 8, 1), "float32", 10), "cnn": InputSpec((8, 8, 1), "float32", 10),
         "resnet": InputSpec((8, 8, 3), "float32", 10),
         "transformer": InputSpec((16,), "int32", 4, 50)}
PARAMS = {"mlp": {}, "cnn": {}, "resnet": {"depth": 8, "width": 8},
          "transformer": {"embed_dim": 16, "num_heads": 2, "num_layers": 2, "mlp_dim": 32}}


def builder(name):
    return lambda: precision.float32_outputs(MODELS.get(name)(SPECS[name], **PARAMS[name]))


def batch(name, n=6):
    spec, rng = SPECS[name], np.random.default_rng(0)
    if spec.vocab_size:
        return tf.constant(rng.integers(0, spec.vocab_size, (n, *spec.shape)), tf.int32)
    return tf.constant(rng.normal(size=(n, *spec.shape)), tf.float32)


def _device(op_device: str) -> str:
    """'CPU:1' from '/job:localhost/replica:0/task:0/device:CPU:1' or '/cpu:1'."""
    found = re.search(r"(CPU|GPU):\d+", op_device.upper())
    return found.group(0) if found else ""


def equivalence(name: str, devices: int) -> dict:
    """Largest output and gradient differences between the placed and unplaced model, and
    the devices of each layer's forward and backward ops in the traced graph."""
    keras.utils.set_random_seed(0)
    reference = builder(name)()
    cfg = load_config(None, [f"model.placement={{devices: {[f'/cpu:{i}' for i in range(devices)]}, "
                             "balance: flops}"]).model.placement
    layout = placement.plan(reference, cfg)
    placed = placement.build_placed(builder(name), layout)
    placed.set_weights(reference.get_weights())
    x = batch(name)

    @tf.function
    def forward_backward(model):
        y = model(x, training=True)
        return y, tf.gradients(tf.reduce_sum(y * y), model.trainable_variables)

    y0, g0 = forward_backward(reference)
    y1, g1 = forward_backward(placed)
    graph = forward_backward.get_concrete_function(placed).graph
    ops = {}
    for op in graph.get_operations():
        parts = op.name.split("/")
        grad = parts[0] == "gradients"
        layer = parts[2 if grad else 1] if len(parts) > (2 if grad else 1) else None
        if layer in layout.layers and op.device and op.type not in ("ReadVariableOp", "Const"):
            ops.setdefault(f"{layer}:{'backward' if grad else 'forward'}", set()).add(_device(op.device))
    scale = max(float(tf.reduce_max(tf.abs(y0))), 1.0)
    return {
        "output": float(tf.reduce_max(tf.abs(y1 - y0))) / scale,
        "gradient": max(float(tf.reduce_max(tf.abs(tf.convert_to_tensor(a) - tf.convert_to_tensor(b))))
                        / max(float(tf.reduce_max(tf.abs(tf.convert_to_tensor(a)))), 1e-3)
                        for a, b in zip(g0, g1)),
        "ops": {k: sorted(v) for k, v in ops.items()},
        "expected": {n: _device(layout.device_of(n)) for n in layout.layers},
        "variables": {v.name: _device(v.device) for v in placed.weights},
        "stages": len(set(layout.stage)),
    }


def check(report: dict) -> None:
    assert report["output"] < 1e-5 and report["gradient"] < 1e-5, report
    assert report["stages"] > 1
    for key, found in report["ops"].items():
        layer = key.split(":")[0]
        assert found == [report["expected"][layer]], (key, found)
    assert any(k.endswith(":backward") for k in report["ops"])      # the backward pass was seen
    for name, device in report["variables"].items():
        assert device == report["expected"][name.split("/")[0]], name


@pytest.mark.parametrize("name", list(SPECS))
def test_placed_on_two_devices_equals_unplaced(name):
    check(equivalence(name, VIRTUAL_CPUS))


@pytest.mark.slow
def test_placed_on_four_devices_equals_unplaced():
    # four logical devices need a fresh process (devices are configured once per process)
    proc = subprocess.run([sys.executable, __file__, "4"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(reports) == set(SPECS)
    for report in reports.values():
        check(report)


def test_a_pinned_op_that_moves_is_caught():
    report = equivalence("mlp", VIRTUAL_CPUS)
    layer = next(k for k in report["ops"] if k.endswith(":forward")).split(":")[0]
    report["expected"][layer] = "CPU:9"
    with pytest.raises(AssertionError):
        check(report)


def _best_by_exhaustion(costs, k):
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_partition_is_the_best_contiguous_split():
    rng = np.random.default_rng(1)
    for n, k in [(7, 2), (9, 3), (10, 4), (5, 5)]:
        costs = list(rng.uniform(0, 10, n))
        stage = placement.partition(costs, k)
        assert stage == sorted(stage) and stage[0] == 0            # contiguous, ordered
        largest = max(sum(c for c, s in zip(costs, stage) if s == j) for j in set(stage))
        assert largest == pytest.approx(_best_by_exhaustion(costs, k))


@pytest.mark.parametrize("name,params", [("resnet", {"depth": 20, "width": 16}),
                                         ("transformer", {"num_layers": 4})])
@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("balance", ["params", "flops"])
def test_auto_partition_is_balanced(name, params, devices, balance):
    model = MODELS.get(name)(SPECS[name], **params)
    costs = [placement.stage_cost(c, balance) for c in placement.layer_costs(model)]
    stage = placement.partition(costs, devices)
    totals = [sum(c for c, s in zip(costs, stage) if s == k) for k in range(devices)]
    if max(totals) > 1.15 * np.mean(totals):       # layer granularity: must be the optimum
        assert max(totals) == pytest.approx(_best_by_exhaustion(costs, devices))


def test_stage_rules():
    model = builder("cnn")()
    names = [c.name for c in placement.layer_costs(model)]
    assert names == ["conv_0", "relu_0", "pool_0", "conv_1", "relu_1", "pool_1", "flatten",
                     "dense_0", "logits"]
    order = placement.stages_from_rules(names, [["conv_0", "relu_0", "pool_0"],
                                                ["conv_1", "relu_1", "pool_1", "flatten",
                                                 "dense_0", "logits"]])
    assert order == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    with pytest.raises(ConfigError, match=r"stages\[1\]\[0\]: rule 'nope' matches no layer"):
        placement.stages_from_rules(names, [[".*"], ["nope"]])
    with pytest.raises(ConfigError, match=r"stages\[1\]\[0\]: layer conv_0 is already in stage 0"):
        placement.stages_from_rules(names, [["conv_0"], ["conv_0"]])
    with pytest.raises(ConfigError, match=r"layers .* are in no stage"):
        placement.stages_from_rules(names, [["conv_0"], ["relu_0"]])
    with pytest.raises(ConfigError, match=r"contiguous .* layer pool_0 goes back"):
        placement.stages_from_rules(names, [["conv_0", "pool_0"], ["relu_0", "conv_1", "relu_1",
                                                                   "pool_1", "flatten", "dense_0",
                                                                   "logits"]])


@pytest.mark.slow
def test_placed_quickstart_trains_like_data_parallel(tmp_path):
    from tftrain.run import run
    common = ["train.epochs=6", "export.tflite=none", "export.saved_model=false"]
    placed = run(quick_config(tmp_path, *common, "run.name=placed", "distribute.strategy=auto",
                              "data.per_replica_batch_size=64",
                              "model.placement={devices: ['/cpu:0', '/cpu:1'], microbatches: 4}"))
    mirrored = run(quick_config(tmp_path, *common, "run.name=mirrored"))
    assert placed["strategy"] == "model_parallel" and placed["global_batch_size"] == 64
    assert placed["placement"]["microbatches"] == 4 and len(placed["placement"]["stages"]) == 2
    layout = placed["placement"]
    assert layout["bubble_formula"] == pytest.approx(1 / 5)
    assert 0 <= layout["bubble_measured"] < 1 and layout["step_ms_pipelined"] > 0
    # the measurement's definition: busy time (one batch, stages in turn) over K x step time
    assert layout["bubble_measured"] == pytest.approx(
        max(0.0, 1 - layout["step_ms_one_batch"] / (2 * layout["step_ms_pipelined"])))
    assert placed["metrics"]["val_accuracy"] >= 0.95
    assert abs(placed["metrics"]["val_accuracy"] - mirrored["metrics"]["val_accuracy"]) <= 0.015


@pytest.mark.slow
def test_placed_with_bfloat16_and_accumulation_trains(tmp_path):
    from tftrain.run import run
    summary = run(quick_config(tmp_path, "train.epochs=4", "export.tflite=none", "run.name=bf16",
                               "distribute.strategy=auto", "precision.policy=mixed_bfloat16",
                               "train.accumulation_steps=2",
                               "model.placement={devices: ['/cpu:0', '/cpu:1'], microbatches: 2}"))
    assert summary["strategy"] == "model_parallel" and summary["precision"] == "mixed_bfloat16"
    assert summary["global_batch_size"] == 64 and summary["accumulation_steps"] == 2
    assert summary["metrics"]["val_accuracy"] > 0.9
    assert summary["artifacts"]["saved_model"]["max_abs_logit_diff"] < 0.05   # bf16 vs float32 export
    assert summary["throughput"]["flops_per_example"] > 0 and 0 < summary["throughput"]["mfu"] < 1


def test_float16_placed_gradients_equal_unplaced():
    precision.apply_policy("mixed_float16")
    check(equivalence("cnn", VIRTUAL_CPUS))


# Ops that need no device of ours: the step's inputs and its grouping of updates, and
# variable reads, which TensorFlow's placer always puts beside their variable (a resource
# op runs on its resource's device).
HOST_SIDE = ("Placeholder", "NoOp", "ReadVariableOp")


def placed_step(devices: int, policy: str = "float32", accumulation: int = 2) -> dict:
    """Trace a placed model's whole train step (forward, loss, backward, accumulation,
    unscaling, optimizer update) and report ops without a device, and the device of each
    gradient sum next to its variable's."""
    from types import SimpleNamespace

    from tftrain.config import load_config as load
    from tftrain.data import BatchPlan
    from tftrain.runtime.parallelism import Placed
    from tftrain.stages import Built
    from tftrain.stages.train import Train

    precision.apply_policy(policy)
    cfg = load(None, [f"model.placement={{devices: {[f'/cpu:{i}' for i in range(devices)]}}}",
                      f"precision.policy={policy}", "train.optimizer.name=adam"])
    net = placement.build(builder("cnn"))
    layout = placement.plan(net, cfg.model.placement, 6)
    parallel = Placed(placement=layout)
    placed = parallel.build(builder("cnn"))
    ctx = SimpleNamespace(parallel=parallel, batches=BatchPlan(6, 1, accumulation),
                          precision=precision.Precision(policy=policy, config=cfg.precision))
    model, _ = Train(cfg=cfg, steps_per_epoch=10).compile(Built(placed), ctx)
    spec = (tf.TensorSpec((6 * accumulation, 8, 8, 1), tf.float32), tf.TensorSpec((6 * accumulation,), tf.int32))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    definition = graph.as_graph_def()   # the step and every function it calls (conditions)
    nodes = [*definition.node, *(n for f in definition.library.function for n in f.node_def)]
    returned = {t.op.name for t in graph.outputs}       # the function's own output copies
    unplaced = sorted({f"{n.op} {n.name}" for n in nodes
                       if not n.device and n.op not in HOST_SIDE and n.name not in returned})
    variables = model.trainable_variables
    sums = {n.name: (_device(n.device), _device(variables[int(m.group(1))].device))
            for n in nodes for m in [re.search(r"gradient_sum_(\d+)$", n.name)] if m}
    # the optimizer's update of a weight: one fused ResourceApplyAdam on it
    # (`tftrain.optim.fused`), or a plain op path's AssignSubVariableOp (w -= step)
    updates = {n.name: _device(n.device) for n in nodes
               if n.op in ("ResourceApplyAdam", "AssignSubVariableOp") and "iterations" not in n.name}
    precision.apply_policy("float32")
    return {"unplaced": unplaced, "sums": sums, "stages": len(set(layout.stage)),
            "update_devices": sorted(set(updates.values())),
            "owners": sorted({_device(v.device) for v in variables})}


def check_step(report: dict, devices: int) -> None:
    assert report["unplaced"] == [], report["unplaced"]
    assert len(report["sums"]) >= 1 and report["stages"] == devices
    for name, (device, owner) in report["sums"].items():
        assert device == owner, (name, device, owner)
    assert len(report["owners"]) >= 2
    assert sorted({owner for _, owner in report["sums"].values()}) == report["owners"]
    assert report["update_devices"] == report["owners"]       # each update beside its variable


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_every_op_of_the_placed_train_step_has_a_device(policy):
    check_step(placed_step(VIRTUAL_CPUS, policy), VIRTUAL_CPUS)


def test_the_step_check_catches_an_op_without_a_device():
    report = placed_step(VIRTUAL_CPUS)
    report["unplaced"] = ["AddV2"]
    with pytest.raises(AssertionError):
        check_step(report, VIRTUAL_CPUS)
    report = placed_step(VIRTUAL_CPUS)
    name = next(iter(report["sums"]))
    report["sums"][name] = ("CPU:7", report["sums"][name][1])
    with pytest.raises(AssertionError):
        check_step(report, VIRTUAL_CPUS)


def anonymous(spec):
    """A user builder whose layers Keras names (conv2d, conv2d_1, dense, ...)."""
    inputs = keras.Input(spec.shape)
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(8, 3, activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))


def test_a_builder_with_auto_named_layers_is_placed():
    build = lambda: anonymous(SPECS["cnn"])  # noqa: E731
    keras.layers.Dense(3)             # names taken before: the builds must not depend on it
    base = placement.build(build)
    cfg = load_config(None, ["model.placement={devices: ['/cpu:0', '/cpu:1']}"]).model.placement
    layout = placement.plan(base, cfg)
    keras.layers.Conv2D(1, 1)         # ... nor on names taken between them
    placed = placement.build_placed(build, layout)
    assert [l.name for l in placed.layers[1:]] == list(layout.layers)
    for layer in placed.layers[1:]:
        for variable in layer.weights:
            assert _device(variable.device) == _device(layout.device_of(layer.name))
    assert {_device(layout.device_of(n)) for n in layout.layers} == {"CPU:0", "CPU:1"}


def test_a_placement_that_matches_nothing_fails_loudly():
    cfg = load_config(None, ["model.placement={devices: ['/cpu:0', '/cpu:1']}"]).model.placement
    layout = placement.plan(placement.build(lambda: anonymous(SPECS["cnn"])), cfg)
    renamed = lambda: keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(name="f"),  # noqa: E731
                                        keras.layers.Dense(10, name="d")])
    with pytest.raises(RuntimeError, match="model placement matched nothing for layers conv2d"):
        placement.build_placed(renamed, layout)


@pytest.mark.slow
def test_placed_step_on_four_devices():
    proc = subprocess.run([sys.executable, __file__, "4", "step"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_step(json.loads(proc.stdout.strip().splitlines()[-1]), 4)


if __name__ == "__main__":   # python tests/runtime/test_placement.py N [step]: reports on N devices
    from tftrain.runtime.strategy import configure_devices
    configure_devices(load_config(None, [f"distribute.virtual_cpus={sys.argv[1]}"]))
    if sys.argv[2:] == ["step"]:
        print(json.dumps(placed_step(int(sys.argv[1]))))
    else:
        print(json.dumps({name: equivalence(name, int(sys.argv[1])) for name in SPECS}))


def test_auto_microbatches_keep_the_count_that_measured_fastest(monkeypatch):
    """`microbatches: auto` times each count dividing the batch on the placed model and
    keeps the fastest, whatever it is (here made 4 by the clock), and the plan says so."""
    from tftrain.runtime import parallelism
    timed = {}

    def clock(functions, repeats):
        timed.update({m: None for m in functions})
        return {m: {1: 0.03, 2: 0.02, 4: 0.01}.get(m, 0.05) for m in functions}
    monkeypatch.setattr(placement, "_median_times", clock)
    cfg = load_config(None, ["model.placement={devices: ['/cpu:0', '/cpu:1'], microbatches: auto}"])
    keras.utils.set_random_seed(0)
    placed = parallelism.placed(builder("mlp"), builder("mlp")(), cfg.model.placement, 12, None)
    assert sorted(timed) == [1, 2, 4]                       # 8 does not divide 12
    assert placed.microbatches == placed.placement.microbatches == 4
    assert "micro-batches: auto, the fastest of 1: 30.0 ms, 2: 20.0 ms, 4: 10.0 ms" in \
        placed.placement.describe()


def test_measured_microbatch_times_come_from_the_placed_models_gradients():
    keras.utils.set_random_seed(0)
    cfg = load_config(None, ["model.placement={devices: ['/cpu:0', '/cpu:1']}"]).model.placement
    net = placement.build_placed(builder("mlp"), placement.plan(builder("mlp")(), cfg))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    best, times = placement.fastest_microbatches(net, 8, loss, repeats=1)
    assert sorted(times) == [1, 2, 4, 8] and all(t > 0 for t in times.values())
    assert times[best] == min(times.values())
