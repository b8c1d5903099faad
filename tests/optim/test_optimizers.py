"""Optimizers and schedules: values at given updates, warmup, params checks."""

import numpy as np
import pytest
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.config import ConfigError, load_config
from tftrain.optim.optimizers import build_optimizer, build_schedule
from tftrain.optim.rates import current_lr
from tftrain.training.callbacks import plateau_callback

SPE, TOTAL = 10, 100


def sched(*sets, lr=1.0):
    return build_schedule(load_config(None, list(sets)).train.schedule, lr, SPE, TOTAL)


def at(schedule, step):
    return float(schedule(tf.constant(step)))


def test_constant_with_warmup():
    s = sched("train.schedule.warmup_steps=4")
    assert [at(s, k) for k in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_warmup_in_epochs_counts_updates():
    s = sched("train.schedule.name=cosine", "train.schedule.warmup_steps=1 epochs")
    assert at(s, 9) == pytest.approx(1.0)
    assert at(s, 10) == pytest.approx(1.0)                    # cosine starts after warmup
    assert at(s, 10 + 45) == pytest.approx(0.5, abs=1e-6)     # half of the 90 decay updates
    assert at(s, TOTAL) == pytest.approx(0.0, abs=1e-6)


def test_step_and_multistep():
    s = sched("train.schedule.name=step", "train.schedule.step_size=2 epochs", "train.schedule.gamma=0.5")
    assert [at(s, k) for k in (0, 19, 20, 40)] == pytest.approx([1, 1, 0.5, 0.25])
    m = sched("train.schedule.name=multistep", "train.schedule.milestones=[30, '5 epochs']")
    assert [at(m, k) for k in (29, 30, 49, 50)] == pytest.approx([1, 0.1, 0.1, 0.01])


def test_exponential_and_polynomial():
    e = sched("train.schedule.name=exponential", "train.schedule.decay_rate=0.5")
    assert at(e, 20) == pytest.approx(0.25)
    p = sched("train.schedule.name=polynomial", "train.schedule.end_learning_rate=0.1")
    assert at(p, 50) == pytest.approx(0.55) and at(p, 100) == pytest.approx(0.1)


def test_plateau_is_a_float_and_a_callback():
    cfg = load_config(None, ["train.schedule.name=plateau", "train.schedule.patience=2"]).train.schedule
    assert build_schedule(cfg, 0.01, SPE, TOTAL) == 0.01
    cb = plateau_callback(cfg)
    assert isinstance(cb, keras.callbacks.ReduceLROnPlateau) and cb.patience == 2


@pytest.mark.parametrize("name,cls,params", [
    ("sgd", keras.optimizers.SGD, {"momentum": 0.9, "nesterov": True}),
    ("adam", keras.optimizers.Adam, {"beta_1": 0.8}),
    ("adamw", keras.optimizers.AdamW, {}),
    ("rmsprop", keras.optimizers.RMSprop, {"rho": 0.8}),
])
def test_optimizers(name, cls, params):
    cfg = load_config(None, [f"train.optimizer.name={name}", f"train.optimizer.params={params}",
                             "train.optimizer.weight_decay=0.01", "train.optimizer.global_clipnorm=1.0"]).train.optimizer
    opt = build_optimizer(cfg, 0.5)
    assert isinstance(opt, cls)
    assert opt.weight_decay == 0.01 and opt.global_clipnorm == 1.0
    for key, value in params.items():
        assert getattr(opt, key) == value


def test_clipping_applies_to_the_gradient():
    cfg = load_config(None, ["train.optimizer.name=sgd", "train.optimizer.clipnorm=1.0"]).train.optimizer
    opt = build_optimizer(cfg, 1.0)
    v = tf.Variable([0.0, 0.0])
    opt.apply_gradients([(tf.constant([30.0, 40.0]), v)])
    np.testing.assert_allclose(v.numpy(), [-0.6, -0.8], rtol=1e-6)


def test_optimizer_param_errors():
    with pytest.raises(ConfigError, match=r"train\.optimizer\.params\.learning_rate: set it as train\.optimizer\.learning_rate"):
        build_optimizer(load_config(None, ["train.optimizer.params={learning_rate: 1}"]).train.optimizer, 0.1)


def test_current_lr_follows_iterations():
    opt = keras.optimizers.SGD(sched("train.schedule.warmup_steps=4"))
    assert current_lr(opt) == pytest.approx(0.25)
    opt.iterations.assign(2)
    assert current_lr(opt) == pytest.approx(0.75)


def test_the_rollback_factor_scales_the_schedule_and_a_plain_rate():
    from tftrain.optim.rates import Scaled, learning_rate_state
    opt = keras.optimizers.SGD(Scaled(sched("train.schedule.warmup_steps=4")))
    learning_rate_state(opt).assign(0.1)
    assert current_lr(opt) == pytest.approx(0.025)
    plain = keras.optimizers.SGD(0.5)
    plain.build([tf.Variable([1.0])])
    state = learning_rate_state(plain)
    state.assign(state * 0.5)
    assert current_lr(plain) == pytest.approx(0.25)