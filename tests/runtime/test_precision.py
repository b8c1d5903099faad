"""Precision policies: auto choice, loss scaling, float32 variables and outputs."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain.runtime import precision
from tftrain.core.keras import keras
from tftrain.config import load_config
from tftrain.data import InputSpec
from tftrain.models import MODELS

SPEC = InputSpec((8, 8, 1), "float32", 10)


def pcfg(*sets):
    return load_config(None, list(sets)).precision


@pytest.mark.parametrize("cap,bf16_cpu,expected", [
    ((8, 0), False, "mixed_bfloat16"), ((9, 0), False, "mixed_bfloat16"),
    ((7, 5), False, "mixed_float16"), ((7, 0), True, "mixed_float16"),
    ((6, 1), False, "float32"), (None, True, "mixed_bfloat16"), (None, False, "float32"),
])
def test_auto_by_hardware(monkeypatch, cap, bf16_cpu, expected):
    monkeypatch.setattr(precision, "gpu_compute_capability", lambda: cap)
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: bf16_cpu)
    assert precision.choose_policy(pcfg()) == expected


def test_float16_on_cpu_warns(monkeypatch):
    monkeypatch.setattr(precision, "gpu_compute_capability", lambda: None)
    with pytest.warns(UserWarning, match="mixed_float16 on a CPU"):
        assert precision.choose_policy(pcfg("precision.policy=mixed_float16")) == "mixed_float16"


def test_loss_scale_optimizer():
    opt = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16", pcfg())
    assert isinstance(opt, keras.mixed_precision.LossScaleOptimizer) and opt.dynamic
    assert float(opt.loss_scale) == 2.0**15
    fixed = precision.wrap_optimizer(keras.optimizers.SGD(0.1), "mixed_float16",
                                     pcfg("precision.loss_scale=128"))
    assert not fixed.dynamic and float(fixed.loss_scale) == 128.0
    plain = keras.optimizers.SGD(0.1)
    assert precision.wrap_optimizer(plain, "mixed_bfloat16", pcfg()) is plain


@pytest.mark.parametrize("policy,compute", [("mixed_bfloat16", tf.bfloat16), ("mixed_float16", tf.float16)])
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet"])
def test_mixed_variables_and_outputs_are_float32(policy, compute, name):
    precision.apply_policy(policy)
    model = precision.float32_outputs(MODELS.get(name)(SPEC, **({"depth": 8} if name == "resnet" else {})))
    assert all(v.dtype == tf.float32 for v in model.variables)
    assert model.layers[1].compute_dtype == compute.name
    out = model(np.zeros((2, 8, 8, 1), np.float32))
    assert out.dtype == tf.float32 and out.shape == (2, 10)


def test_float32_outputs_is_noop_for_float32():
    model = MODELS.get("mlp")(SPEC)
    assert precision.float32_outputs(model) is model


def _dist(*sets):
    return load_config(None, list(sets)).distribute


def test_bfloat16_all_reduce_travels_as_float16_on_nccl():
    # NcclAllReduce can be configured on CPU devices; only running it needs GPUs.
    nccl = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                          cross_device_ops=tf.distribute.NcclAllReduce())
    plan = precision.all_reduce_plan(_dist("distribute.all_reduce_dtype=bfloat16"), nccl, "float32")
    assert (plan.dtype, plan.loss_scaled, plan.nccl) == ("float16", True, True)
    assert "NCCL has no bfloat16 all-reduce" in plan.describe()
    ring = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])       # reduction to one device
    plan = precision.all_reduce_plan(_dist("distribute.all_reduce_dtype=bfloat16"), ring, "float32")
    assert (plan.dtype, plan.loss_scaled, plan.nccl) == ("bfloat16", False, False)


@pytest.mark.parametrize("policy,wire,scaled", [
    ("float32", "float16", True),            # float16 on the wire: scaled whatever the policy
    ("mixed_bfloat16", "float16", True),
    ("mixed_float16", "float32", True),
    ("float32", "float32", False),
    ("mixed_bfloat16", "bfloat16", False),
])
def test_float16_on_the_wire_is_always_loss_scaled(policy, wire, scaled):
    model, optimizer = compiled(policy, wire)
    assert isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer) is scaled
    assert model.precision.loss_scaled is scaled
    assert model.all_reduce_dtype == tf.as_dtype(wire)


def compiled(policy, wire, stage_class=None):
    """A stage's training model and optimizer on 2 mirrored devices."""
    from types import SimpleNamespace

    from tftrain.data import BatchPlan
    from tftrain.runtime.parallelism import of_strategy
    from tftrain.stages import Built
    from tftrain.stages.train import Train
    cfg = load_config(None, [f"distribute.all_reduce_dtype={wire}", f"precision.policy={policy}"])
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ctx = SimpleNamespace(precision=precision.Precision.for_strategy(
        policy=policy, config=cfg.precision, distribute=cfg.distribute, strategy=strategy),
        parallel=of_strategy(strategy), batches=BatchPlan(4, 2, 1))
    stage = (stage_class or Train)(cfg=cfg, steps_per_epoch=4)
    with strategy.scope():
        net = stage.precision(ctx).build(lambda: MODELS.get("mlp")(InputSpec((4,), "float32", 3)))
        return stage.compile(Built(net), ctx)


def test_a_stage_precision_is_its_own_and_leaves_the_global_policy_alone():
    from tftrain.stages.qat import QAT
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model, optimizer = compiled("mixed_bfloat16", "float16", QAT)
        assert model.precision.policy == "float32" and model.precision.loss_scaled  # float16 wire
        assert {layer.compute_dtype for layer in model.layers} == {"float32"}
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
        model, _ = compiled("mixed_bfloat16", "float32")
        assert model.layers[1].compute_dtype == "bfloat16"
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.slow
def test_float32_outputs_are_named_after_the_layer_not_the_tensor(tmp_path):
    """Keras 3's MobileNetV3Small from a `.keras` file, built under mixed_bfloat16: its
    output tensor is named after a graph placeholder ("Placeholder:0"), no valid layer
    name; the float32 output layer is named after the layer that gives the output."""
    from tftrain.core.keras import keras3
    from tftrain.models import build_model

    path = tmp_path / "mobilenet_v3.keras"
    keras3().applications.MobileNetV3Small(input_shape=(32, 32, 3), alpha=0.75, weights=None,
                                           classes=10, dropout_rate=0.0,
                                           classifier_activation=None).save(str(path))
    cfg = load_config(None, [f"model={{name: 'file:{path}'}}"])
    mixed = precision.Precision(policy="mixed_bfloat16", config=cfg.precision)
    model = mixed.build(lambda: build_model(cfg.model, InputSpec((32, 32, 3), "float32", 10)))
    assert model.outputs[0].dtype == tf.float32
    assert model.layers[-1].name == f"{model.layers[-2].name}_float32"
    x = np.random.default_rng(0).uniform(0, 1, (2, 32, 32, 3)).astype("float32")
    assert model(x).shape == (2, 10)
