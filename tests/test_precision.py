"""Precision policies: auto choice, loss scaling, float32 variables and outputs."""
import numpy as np
import pytest
import tensorflow as tf

from tftrain import precision
from tftrain._keras import keras
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
