"""The planner: memory estimates, data vs model parallel, batch choice, impossible plans."""
import pytest

from helpers import ROOT, cli
from tftrain.runtime import placement
from tftrain.runtime import planner
from tftrain.config import ConfigError, load_config
from tftrain.data import InputSpec
from tftrain.models import MODELS

SPEC = InputSpec((8, 8, 1), "float32", 10)
MIB = 2**20


def costs():
    return placement.layer_costs(MODELS.get("mlp")(SPEC, hidden=[128] * 6))


def cfg(*sets):
    return load_config(None, list(sets))


def fitting(step_bytes: float) -> int:
    """The device memory whose share a step may take (`planner.USABLE`) is `step_bytes`."""
    return int(step_bytes / planner.USABLE) + 1


@pytest.mark.parametrize("sets,slots", [
    ([], 2), (["train.optimizer.name=sgd"], 1),      # tf_keras' SGD keeps momentum at 0 too
    (["train.optimizer={name: adam, params: {amsgrad: true}}"], 3),
    (["train.optimizer={name: sgd, params: {momentum: 0.9}}"], 1),
    (["train.optimizer.name=rmsprop"], 1),
    (["train.optimizer={name: rmsprop, params: {momentum: 0.9, centered: true}}"], 3),
])
def test_optimizer_slots(sets, slots):
    assert planner.optimizer_slots(cfg(*sets)) == slots


def test_estimate_counts_each_part():
    c = costs()
    params = sum(x.params for x in c)
    assert params == 64 * 128 + 128 + 5 * (128 * 128 + 128) + 128 * 10 + 10
    acts = sum(x.activation_bytes for x in c)
    e = planner.estimate(c, micro_batch=32, slots=2, policy="float32")
    assert (e.params, e.gradients, e.slots) == (params * 4, params * 4, params * 8)
    assert e.activations == acts * 32 * planner.ACTIVATION_FACTOR
    half = planner.estimate(c, micro_batch=32, slots=2, policy="mixed_bfloat16")
    assert half.activations == e.activations / 2 and half.params == e.params


def test_ample_memory_is_data_parallel():
    plan = planner.choose(cfg("distribute.device_memory=16GB"), costs(), ["/cpu:0", "/cpu:1"],
                          "float32", 32, 1)
    assert plan.kind == "data" and plan.stages == 1 and plan.memory == 16 * 10**9


def test_a_model_too_big_for_one_device_is_split_in_the_fewest_stages():
    c = costs()
    whole = planner.estimate(c, 32, 2, "float32").total
    devices = [f"/cpu:{i}" for i in range(4)]
    plan = planner.choose(cfg(f"distribute.device_memory={fitting(whole * 0.8)}"), c, devices,
                          "float32", 32, 1)
    assert plan.kind == "model" and plan.stages == 2
    assert all(e.total <= whole * 0.8 for e in plan.per_device)
    tighter = planner.choose(cfg(f"distribute.device_memory={fitting(whole * 0.4)}"), c, devices,
                             "float32", 32, 1)
    assert tighter.stages == 3 and all(e.total <= whole * 0.4 for e in tighter.per_device)


def test_global_batch_takes_more_accumulation_when_the_micro_batch_does_not_fit():
    c = costs()
    at_64 = planner.estimate(c, 64, 2, "float32").total
    plan = planner.choose(cfg("train.global_batch_size=256", f"distribute.device_memory={fitting(at_64)}"),
                          c, ["/cpu:0", "/cpu:1"], "float32", 32, 1, replicas=2)
    assert (plan.per_replica, plan.accumulation, plan.kind) == (64, 2, "data")   # 64 x 2 x 2 = 256
    roomy = planner.choose(cfg("train.global_batch_size=256"), c, ["/cpu:0", "/cpu:1"],
                           "float32", 32, 1, replicas=2)
    assert (roomy.per_replica, roomy.accumulation) == (128, 1)


def test_the_training_sets_copy_on_the_device_leaves_less_room_for_the_step():
    c = costs()
    at_64 = planner.estimate(c, 64, 2, "float32").total
    sets = ("train.global_batch_size=256", f"distribute.device_memory={fitting(at_64)}",
            "distribute.strategy=mirrored")
    free = planner.choose(cfg(*sets), c, ["/cpu:0", "/cpu:1"], "float32", 32, 1, replicas=2)
    copy = planner.Resident(at_64 * 0.01, "the training set's copy")  # 0.99 of 64's step left
    held = planner.choose(cfg(*sets), c, ["/cpu:0", "/cpu:1"], "float32", 32, 1, replicas=2,
                          resident=copy)
    assert (free.per_replica, free.accumulation) == (64, 2)
    assert (held.per_replica, held.accumulation) == (32, 4)
    assert held.room == pytest.approx(at_64 * 0.99, abs=1) and held.room >= held.per_device[0].total
    assert "of it the training set's copy" in held.describe()


def test_impossible_plan_says_what_to_change():
    with pytest.raises(ConfigError, match=r"distribute\.device_memory: the model needs .* MiB on one "
                                          r"device .* lower data\.per_replica_batch_size"):
        planner.choose(cfg("distribute.device_memory=1000"), costs(), ["/cpu:0", "/cpu:1"],
                       "float32", 32, 1)


def test_device_memory_defaults_to_available_ram():
    assert 0 < planner.device_memory("/cpu:0", None) <= 64 * 2**30
    assert planner.device_memory("/gpu:0", 123) == 123


def test_matmul_peak_is_measured():
    assert planner.matmul_peak_flops(n=256, repeats=2) > 1e8


@pytest.mark.slow
def test_auto_chooses_model_parallel_when_memory_is_short(tmp_path):
    args = [ROOT / "configs" / "quickstart.yaml", "--run-dir", tmp_path, "--dry-run",
            "--full", "--set", "distribute.strategy=auto"]
    roomy = cli(*args)
    assert roomy.returncode == 0 and "planner: data parallel" in roomy.stdout
    short = cli(*args, "--set", "distribute.device_memory=2MiB")
    assert short.returncode == 0, short.stderr[-2000:]
    assert "planner: model parallel over 2 stages (the model does not fit one device)" in short.stdout
    # a CPU's memory is the host's: the digits' arrays and the pipeline's buffers hold some
    assert "MiB of it the host's data: arrays and input buffers)" in " ".join(
        short.stdout.split())
    assert "strategy: default" in short.stdout and "stage 1 /device:CPU:1" in short.stdout
    impossible = cli(*args, "--set", "distribute.device_memory=100KB")
    assert impossible.returncode == 2
    assert "tftrain: config error: distribute.device_memory: the model needs" in impossible.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_step_that_does_not_fit_takes_the_fastest_way_that_fits():
    """Micro-batches of 128 do not fit without recompute; recompute at 128 and
    accumulation at 32 x 4 both fit: the estimates decide, and the plan lists each way."""
    c = costs()
    every = sum(x.activation_bytes for x in c)
    at_128 = planner.estimate(c, 128, 2, "float32").total
    limit = (at_128 + planner.estimate(c, 64, 2, "float32").total) / 2     # a step's room
    sets = ["train.global_batch_size=256", f"distribute.device_memory={fitting(limit)}",
            "distribute.strategy=mirrored"]
    plan = planner.choose(cfg(*sets, "train.recompute=auto"), c, ["/cpu:0", "/cpu:1"],
                          "float32", 128, 1, replicas=2, kept=every / 4)
    ways = {(w.recompute, w.per_replica, w.accumulation): w for w in plan.considered}
    assert (True, 128, 1) in ways and (False, 64, 2) in ways
    assert all(w.bytes <= limit for w in ways.values())
    fastest = min(ways.values(), key=lambda w: w.seconds)
    assert (plan.recompute, plan.per_replica, plan.accumulation) == \
        (fastest.recompute, fastest.per_replica, fastest.accumulation)
    # the estimates: recomputation adds a forward pass (4 passes for 3), accumulation the
    # launches of a second micro-batch
    flops = sum(x.flops for x in c)
    peak = planner._peak("/cpu:0", "float32")
    launch = len(c) * planner.LAUNCH_SECONDS
    assert ways[(True, 128, 1)].seconds == pytest.approx(4 * (launch + flops * 128 / peak))
    assert ways[(False, 64, 2)].seconds == pytest.approx(2 * 3 * (launch + flops * 64 / peak))
    text = plan.describe()
    assert f"the configured step does not fit the {limit / MIB:.2f} MiB a step may take (85% of the " \
        "device); the ways compared:" in text
    assert text.count("chosen, the fastest that fits") == 1
    # without auto, recomputation is not a way
    plain = planner.choose(cfg(*sets), c, ["/cpu:0", "/cpu:1"], "float32", 128, 1,
                           replicas=2, kept=every / 4)
    assert not plain.recompute and (plain.per_replica, plain.accumulation) == (64, 2)


def test_explicit_recompute_is_planned_with_what_it_keeps():
    c = costs()
    every = sum(x.activation_bytes for x in c)
    plan = planner.choose(cfg("train.recompute=blocks", "distribute.device_memory=16GB"), c,
                          ["/cpu:0"], "float32", 32, 1, replicas=1, kept=every / 4)
    assert plan.recompute and plan.per_device[0].activations == every / 4 * 32


def test_recompute_with_placement_is_refused_at_plan_time():
    with pytest.raises(ConfigError, match="train.recompute: a placed model"):
        cfg("train.recompute={every: 4}", "model.placement={devices: ['/cpu:0', '/cpu:1']}")
