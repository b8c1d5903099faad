"""Compression: update-driven pruning, structures, layer rules, prune-preserving QAT."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

from tftrain.compress import pruning, quantization
from tftrain.runtime import precision
from tftrain.core.keras import keras
from tftrain.config import ConfigError, load_config
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.training.losses import build_loss
from tftrain.training.train_step import TrainModel

SPEC = InputSpec((8, 8, 1), "float32", 10)
MIRRORED = ["/cpu:0", "/cpu:1"]


def mirrored():
    # Reduction to one device, as tftrain picks on CPUs: no collective instance keys, so
    # new strategies in this process cannot collide with other tests' collectives.
    return tf.distribute.MirroredStrategy(MIRRORED, cross_device_ops=tf.distribute.ReductionToOneDevice())


def pruning_cfg(*sets):
    return load_config(None, [f"compression.pruning.{s}" for s in sets]).compression.pruning


def cnn():
    return precision.float32_outputs(MODELS.get("cnn")(SPEC, filters=[16, 32], dense=[64]))


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, n)


def fit(model, updates, batch=64, callbacks=()):
    x, y = data(updates * batch)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))


def pruned_training(cfg, updates, accumulation=1, strategy=None, policy="float32"):
    """Train a pruned CNN for `updates` updates; returns (pruned net, train model, log)
    where log[k] = (iterations, pruning step, sparsity) after update k+1."""
    precision.apply_policy(policy)
    keras.utils.set_random_seed(3)
    strategy = strategy or mirrored()
    plan = pruning.PruningPlan(updates, *_schedule(cfg, updates))
    with strategy.scope():
        net = pruning.prune_model(cnn(), cfg, plan)
        model = TrainModel.wrap(net, accumulation, update_hooks=[pruning.PruningHook(net)])
        model.compile(keras.optimizers.Adam(0.01), build_loss("sparse_categorical_crossentropy"))
    log = []
    probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: log.append(
        (int(model.optimizer.iterations.numpy()),
         int(pruning.pruned_layers(net)[0].pruning_step.numpy()),
         pruning.sparsity(net))))
    fit(model, updates, callbacks=[probe])
    return net, model, log


def _schedule(cfg, updates):
    plan = pruning.plan_pruning(cfg.model_copy(update={"epochs": 1}), updates)
    return plan.begin, plan.end, plan.frequency


def test_plan_aligns_the_end_to_a_mask_update():
    plan = pruning.plan_pruning(pruning_cfg("epochs=4", "end=0.7", "frequency=10"), 23)
    assert plan == pruning.PruningPlan(updates=92, begin=0, end=60, frequency=10)
    plan = pruning.plan_pruning(pruning_cfg("epochs=2", "begin=1 epochs", "end=40",
                                                "frequency=4"), 23)
    assert plan == pruning.PruningPlan(updates=46, begin=23, end=39, frequency=4)
    with pytest.raises(ConfigError, match=r"compression\.pruning\.end: update 60 is after"):
        pruning.plan_pruning(pruning_cfg("epochs=1", "end=60"), 23)
    with pytest.raises(ConfigError, match=r"compression\.pruning\.begin: update 30 is outside"):
        pruning.plan_pruning(pruning_cfg("epochs=1", "begin=30"), 23)


def test_layer_rules():
    model = cnn()
    refusal = pruning.pruning_refusal(pruning_cfg())
    assert pruning.select_layers(model, [], "k", refusal) == [
        "conv_0", "conv_1", "dense_0", "logits"]
    assert pruning.select_layers(model, ["conv_.*", "logits"], "k", refusal) == \
        ["conv_0", "conv_1", "logits"]
    with pytest.raises(ConfigError, match=r"k\[1\]: rule 'dense_9' matches no layer; the model's "
                                          r"layers are: inputs, conv_0"):
        pruning.select_layers(model, ["conv_0", "dense_9"], "k", refusal)
    with pytest.raises(ConfigError, match=r"k: layer pool_0: tfmot cannot prune MaxPooling2D"):
        pruning.select_layers(model, ["pool_0"], "k", refusal)
    two_four = pruning.pruning_refusal(pruning_cfg("structure='2:4'"))
    # conv_0 has one input channel: no group of four along its input axis
    assert pruning.select_layers(model, [], "k", two_four) == ["conv_1", "dense_0", "logits"]
    with pytest.raises(ConfigError, match=r"layer conv_0: 2:4 sparsity groups .* 1 inputs"):
        pruning.select_layers(model, ["conv_0"], "k", two_four)
    block = pruning.pruning_refusal(pruning_cfg("block=[1, 4]"))
    with pytest.raises(ConfigError, match=r"layer conv_1: block sparsity needs a 2-D kernel"):
        pruning.select_layers(model, ["conv_1"], "k", block)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_pruning_step_counts_updates_and_weights_stay_sparse(accumulation):
    cfg = pruning_cfg("final_sparsity=0.75", "end=0.5", "frequency=2")
    net, model, log = pruned_training(cfg, 12, accumulation)
    assert [(it, step) for it, step, _ in log] == [(k, k) for k in range(1, 13)]
    # polynomial from 0 at update 2 (the first mask update) to 0.75 at update 6, then held
    sparsities = [s["dense_0"] for _, _, s in log]
    assert sparsities[0] == 0 and 0 < sparsities[1] < sparsities[3] < sparsities[5]
    for s in sparsities[5:]:
        assert s == pytest.approx(0.75, abs=0.01)
    stripped = pruning.strip(net)
    assert not pruning.pruned_layers(stripped)
    layers = ["conv_0", "conv_1", "dense_0", "logits"]
    for name, value in pruning.kernel_sparsity(stripped, layers).items():
        assert value == pytest.approx(0.75, abs=0.01 if name != "conv_0" else 0.02), name


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_pruning_under_mixed_precision(policy):
    net, model, log = pruned_training(pruning_cfg("final_sparsity=0.5", "end=0.5", "frequency=2"),
                                      8, policy=policy)
    assert model.get_layer("prune_by_update_dense_0").layer.compute_dtype == policy.split("_")[1]
    assert all(v.dtype == tf.float32 for v in net.weights if v.dtype.is_floating)
    assert [it for it, _, _ in log] == list(range(1, 9))
    assert log[-1][2]["dense_0"] == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_pruning_a_float32_layer_under_a_mixed_policy(policy):
    """A layer pinned to float32 (a float32 head) keeps its precision in the wrapper: the
    wrapper no longer casts its inputs to the policy's float16 for a float32 kernel."""
    precision.apply_policy(policy)
    try:
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, name="hidden")(inputs)
        head = keras.layers.Dense(3, dtype="float32", name="head")(hidden)
        cfg = pruning_cfg("final_sparsity=0.5")
        plan = pruning.plan_pruning(cfg.model_copy(update={"epochs": 1}), 4)
        pruned = pruning.prune_model(keras.Model(inputs, head), cfg, plan)
        wrapped = {layer.layer.name: layer for layer in pruning.pruned_layers(pruned)}
        assert wrapped["head"].compute_dtype == "float32"
        assert wrapped["hidden"].compute_dtype == policy.split("_")[1]
        out = pruned(np.ones((2, 6), np.float32))
        assert out.dtype == tf.float32 and out.shape == (2, 3)
    finally:
        precision.apply_policy("float32")


@pytest.mark.slow
def test_pruning_under_mirrored_equals_one_device():
    cfg = pruning_cfg("final_sparsity=0.6", "end=0.5", "frequency=2")
    mirrored, _, _ = pruned_training(cfg, 8)        # 2 replicas x 32
    single, _, _ = pruned_training(cfg, 8, strategy=tf.distribute.OneDeviceStrategy("/cpu:0"))
    for a, b in zip(mirrored.weights, single.weights):
        assert a.name == b.name
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)


def test_two_four_structure():
    net, _, _ = pruned_training(pruning_cfg("structure='2:4'", "end=0.5", "frequency=2"), 6)
    kernel = pruning.strip(net).get_layer("dense_0").get_weights()[0]        # (in, out)
    groups = kernel.reshape(kernel.shape[0] // 4, 4, kernel.shape[1])
    assert np.all(np.sum(groups == 0, axis=1) >= 2)          # every 4 along the input axis
    conv = pruning.strip(net).get_layer("conv_1").get_weights()[0]           # (h, w, in, out)
    groups = conv.reshape(3, 3, conv.shape[2] // 4, 4, conv.shape[3])
    assert np.all(np.sum(groups == 0, axis=3) >= 2)
    assert float(np.mean(conv == 0)) == pytest.approx(0.5, abs=0.01)


def test_block_sparsity():
    cfg = pruning_cfg("block=[1, 4]", "layers=[dense_0]", "final_sparsity=0.5", "end=0.5",
                      "frequency=2")
    net, _, _ = pruned_training(cfg, 6)
    kernel = pruning.strip(net).get_layer("dense_0").get_weights()[0]
    blocks = kernel.reshape(kernel.shape[0], kernel.shape[1] // 4, 4)
    zero_blocks = np.all(blocks == 0, axis=2)
    assert np.all(zero_blocks | np.all(blocks != 0, axis=2))     # whole blocks are pruned
    assert float(np.mean(zero_blocks)) == pytest.approx(0.5, abs=0.01)


def quantized(net, strategy, preserve=True, accumulation=2, updates=6):
    cfg = load_config(None, [])
    with strategy.scope():
        q = quantization.quantize_model(net, cfg.compression.quantization, preserve)
        model = TrainModel.wrap(q, accumulation, unroll=True)
        model.compile(keras.optimizers.Adam(0.01), build_loss("sparse_categorical_crossentropy"))
    fit(model, updates)
    return q


@pytest.mark.slow
@pytest.mark.parametrize("preserve", [True, False])
def test_prune_preserving_qat_keeps_every_zero(preserve):
    strategy = mirrored()
    net, _, _ = pruned_training(pruning_cfg("end=0.5", "frequency=2"), 6, strategy=strategy)
    stripped = pruning.strip(net)
    zeros = {n: stripped.get_layer(n).get_weights()[0] == 0 for n in ("conv_0", "conv_1", "dense_0", "logits")}
    q = quantized(stripped, strategy, preserve)
    kernels = quantization.quantized_kernels(q)
    assert set(kernels) == set(zeros)        # Conv2D -> ReLU kernels are quantized too
    kept = {n: bool(np.all(kernels[n][z] == 0)) for n, z in zeros.items()}
    assert all(kept.values()) if preserve else not any(kept.values())


def test_quantization_lists_unsupported_layers_or_skips_them():
    inputs = keras.Input((8, 16))
    h = keras.layers.Dense(16, name="proj")(inputs)
    h = keras.layers.UnitNormalization(name="norm")(h)
    outputs = keras.layers.Dense(4, name="head")(keras.layers.Flatten(name="flat")(h))
    net = keras.Model(inputs, outputs)
    cfg = load_config(None, []).compression.quantization
    with pytest.raises(ConfigError, match=r"compression\.quantization: tfmot cannot quantize "
                                          r"1 layer of 1 kind:\n  UnitNormalization x 1, e\.g\. "
                                          r"norm\n  skip_unsupported: true keeps them float "
                                          r"\(1 float island, "):
        quantization.quantize_model(net, cfg, preserve_sparsity=False)
    cfg = load_config(None, ["compression.quantization.skip_unsupported=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    assert type(q.get_layer("norm")).__name__ == "UnitNormalization"
    assert set(quantization.quantized_kernels(q)) == {"proj", "head"}


@pytest.mark.slow
@pytest.mark.parametrize("batch_norm", [False, True], ids=["relu", "batch_norm"])
def test_prune_preserving_qat_keeps_the_zeros_of_depthwise_kernels(tmp_path, batch_norm):
    """tfmot's prune-preserving scheme leaves DepthwiseConv2D kernels unmasked: QAT used to
    refill their zeros. The depthwise kernel's zeros after QAT equal the pruned ones, in
    the QAT model and in the int8 TFLite file; followed by a batch norm (ds_cnn,
    MobileNetV2) too, which tfmot refused once the depthwise had its own config."""
    from tftrain.export import artifacts
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="conv")(inputs)
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="depthwise")(h)
    if batch_norm:
        h = keras.layers.BatchNormalization(name="depthwise_bn")(h)
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    kernel = net.get_layer("depthwise").depthwise_kernel
    values = kernel.numpy()
    values[np.abs(values) < np.median(np.abs(values))] = 0             # pruned to 50%
    kernel.assign(values)
    zeros = values == 0
    q = quantized(net, mirrored(), preserve=True, updates=12)
    trained = quantization.quantized_kernels(q)["depthwise"]
    assert np.array_equal(trained == 0, zeros) and float(np.mean(zeros)) == 0.5
    saved = artifacts.save_saved_model(q, tmp_path / "saved_model")
    blob = artifacts.convert_tflite(saved, "int8", np.zeros((0, 8, 8, 1), np.float32), qat=True)
    depthwise, = [w for name, w in artifacts.tflite_weights(blob).items()
                  if "depthwise" in name and w.ndim == 4 and w.dtype == np.int8]
    assert float(np.mean(depthwise == 0)) == 0.5


@pytest.mark.parametrize("preserve", [True, False], ids=["pqat", "qat"])
def test_a_depthwise_batch_norm_relu_chain_is_rounded_once_as_in_the_int8_file(tmp_path, preserve):
    """TFLite runs DepthwiseConv2D -> BatchNormalization -> ReLU as one op with one output
    range, the ReLU's. Prune-preserving QAT gave the batch norm a range of its own too, so
    the QAT model rounded twice where the int8 file rounds once, and each depthwise layer
    departed from the file (local SQNR 44 dB here, 30-34 dB on MobileNetV2). Now the
    batch norm has no range before a ReLU, in both schemes, and the file's depthwise adds
    under 1/100,000 of the signal's power (> 50 dB; 56 dB measured)."""
    from tftrain.export import artifacts, fidelity
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv")(inputs)
    h = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="depthwise")(h)
    bn = keras.layers.BatchNormalization(name="depthwise_bn")
    h = keras.layers.ReLU(6.0, name="depthwise_relu")(bn(h))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    net(np.zeros((1, 8, 8, 3), np.float32))
    bn.gamma.assign(rng.uniform(0.5, 3, 16)), bn.beta.assign(rng.normal(size=16) * 3)
    cfg = load_config(None, []).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=preserve)
    assert type(q.get_layer("quant_depthwise_bn").quantize_config).__name__ == "NoOpQuantizeConfig"
    x = rng.normal(size=(128, 8, 8, 3)).astype(np.float32)
    quantization.calibrate_ranges(q, [x[:64], x[64:]])
    saved = artifacts.save_saved_model(q, tmp_path / "saved_model")
    blob = artifacts.convert_tflite(saved, "int8", x[:64], qat=True)
    row, = [r for r in fidelity.tflite_report(blob, q, x) if r["layer"] == "quant_depthwise_relu"]
    assert row["op"] == "DEPTHWISE_CONV_2D" and row["local_sqnr_db"] > 50, row


@pytest.mark.parametrize("batch", [32, 6])     # 3 batches eager; 16, most of them traced
def test_calibrated_ranges_are_the_min_and_max_each_quantizer_sees(batch):
    """Before the first QAT update every activation range (the input's, each layer's
    output) is the min and max, 0 included, of what the float model computes there on the
    calibration batches: not tfmot's [-6, 6], which would clip inputs scaled by 20.
    Calibration runs with float kernels, as post-training calibration does."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.Flatten(name="flat")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    x = data(96)[0] * 20.0
    assert quantization.calibrate_ranges(q, [x[i:i + batch] for i in range(0, 96, batch)]) == 96 // batch
    conv, logits = keras.Model(net.inputs, [net.get_layer("conv").output,
                                            net.get_layer("logits").output]).predict(x, verbose=0)
    expected = [(min(x.min(), 0), max(x.max(), 0)),          # the input (tfmot's QuantizeLayer)
                (0.0, conv.max()), (min(logits.min(), 0), logits.max())]
    ranges = quantization.range_variables(q)
    assert len(ranges) == 2 * len(expected)
    for layer, (low, high) in zip([q.layers[1], q.get_layer("quant_conv"),
                                   q.get_layer("quant_logits")], expected):
        found = [float(v.numpy()) for v in ranges if any(v is w for w in layer.weights)]
        np.testing.assert_allclose(found, [low, high], rtol=1e-5, atol=1e-6, err_msg=layer.name)


def test_calibration_sets_kernel_ranges_to_the_kernels_extent():
    """Kernel ranges start at tfmot's [-6, 6] too, and until a first update a kernel of
    small weights rounds to zero in them: calibration sets each to its kernel's extent,
    per output channel for the convolution, per tensor and symmetric for the dense layer,
    so the QAT model's logits before any update are the float model's within a step."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(inputs)
    h = keras.layers.Flatten(name="flat")(h)
    small = keras.initializers.RandomUniform(-0.004, 0.003, seed=1)
    net = keras.Model(inputs, keras.layers.Dense(10, kernel_initializer=small,
                                                 name="logits")(h))
    cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
    q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    x = data(32)[0]
    assert not q(x).numpy().any()                          # [-6, 6]: every weight rounds to 0
    quantization.calibrate_ranges(q, [x])
    dense = net.get_layer("logits").kernel.numpy()
    conv = net.get_layer("conv").kernel.numpy()
    lows = {v.name: v.numpy() for v in q.variables if "kernel_min" in v.name}
    highs = {v.name: v.numpy() for v in q.variables if "kernel_max" in v.name}
    assert len(lows) == len(highs) == 2
    np.testing.assert_allclose(highs["quant_logits/kernel_max:0"], np.abs(dense).max(), rtol=1e-6)
    np.testing.assert_allclose(lows["quant_logits/kernel_min:0"], -np.abs(dense).max(), rtol=1e-6)
    extent = np.abs(conv).max(axis=(0, 1, 2))
    np.testing.assert_allclose(highs["quant_conv/kernel_max:0"], extent, rtol=1e-6)
    np.testing.assert_allclose(lows["quant_conv/kernel_min:0"], -extent, rtol=1e-6)
    step = np.abs(net(x).numpy()).max() / 127 * 4
    np.testing.assert_allclose(q(x).numpy(), net(x).numpy(), atol=step)


@pytest.mark.parametrize("batches", [2, 16])     # eager; past `EAGER_BATCHES`, traced
def test_a_training_mode_pass_with_ranges_held_moves_batch_norm_statistics_and_no_range(batches):
    """Batch-norm re-estimation at the end of QAT, under MirroredStrategy: the statistics
    are those of the QAT model's own batch-norm inputs (fake-quantized as in inference)
    and every other variable, each range among them, stays as trained."""
    from tftrain.optim.averaging import recalibrate_batch_norm
    keras.utils.set_random_seed(0)
    with mirrored().scope():
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(4, 3, name="conv")(inputs)
        h = keras.layers.BatchNormalization(name="bn")(h)
        h = keras.layers.ReLU(name="relu")(keras.layers.Flatten(name="flat")(h))
        net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
        cfg = load_config(None, ["compression.quantization.enabled=true"]).compression.quantization
        q = quantization.quantize_model(net, cfg, preserve_sparsity=False)
    x = data(64)[0] * 3.0 + 1.0
    quantization.calibrate_ranges(q, [x])
    before = {v.name: v.numpy() for v in q.weights if "moving" not in v.name}
    with quantization.ranges_held():
        size = 64 // batches
        assert recalibrate_batch_norm(q, [x[i:i + size] for i in range(0, 64, size)]) == batches
    bn = [layer for layer in q._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
    seen = keras.Model(q.inputs, q.get_layer("quant_conv").output).predict(x, verbose=0)
    np.testing.assert_allclose(bn[0].moving_mean.numpy(), seen.mean(axis=(0, 1, 2)), rtol=0, atol=1e-5)
    assert len(before) > 10
    for name, value in before.items():
        np.testing.assert_array_equal([v for v in q.weights if v.name == name][0].numpy(), value,
                                      err_msg=name)


def test_a_prune_preserving_qat_model_clones_with_its_masks():
    """A cluster's export copy (`Parallelism.detach`) of a pruned, QAT-trained model: a
    clone from the config lost the sparsity masks prune-preserving QAT adds (36 weights
    for 40); `quantization.clone` keeps them and computes what the model computes."""
    from tftrain.compress import quantization
    from tftrain.config import load_config
    from tftrain.export.artifacts import inference_model
    from tftrain.models import MODELS
    cfg = load_config(None, ["compression.quantization={enabled: true}",
                             "compression.pruning={enabled: true}"])
    net = MODELS.get("cnn")(InputSpec((8, 8, 1), "float32", 10))
    for layer in net.layers:
        if layer.weights:
            layer.set_weights([np.where(np.abs(w) < 0.05, 0, w) for w in layer.get_weights()])
    q = quantization.quantize_configured(inference_model(net), cfg)
    copy = quantization.clone(q)
    assert len(copy.get_weights()) == len(q.get_weights()) == 40
    copy.set_weights(q.get_weights())
    x = np.random.default_rng(0).uniform(0, 1, (4, 8, 8, 1)).astype("float32")
    np.testing.assert_array_equal(copy(x).numpy(), q(x).numpy())


def test_hard_swish_and_squeeze_excite_quantize_to_int8_ops_xnnpack_runs(tmp_path):
    """MobileNetV3's block (hard-swish after conv and batch norm, a squeeze-excite gate
    of a hard sigmoid multiplied into the features) through QAT: the int8 file has no
    float op between its input QUANTIZE and output DEQUANTIZE, no HARD_SWISH (XNNPack has
    no int8 kernel for it: the converter fuses one when the expression is written whole),
    XNNPack runs every op, and the file computes what the QAT model does."""
    from tftrain.export import artifacts, speed
    from tftrain.models.hard_swish import HardSigmoid, HardSwish
    from ai_edge_litert.interpreter import Interpreter
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv")(inputs)
    h = HardSwish(name="swish_0")(keras.layers.BatchNormalization(name="bn_0")(h))
    h = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="depthwise")(h)
    h = HardSwish(name="swish_1")(keras.layers.BatchNormalization(name="bn_1")(h))
    g = keras.layers.GlobalAveragePooling2D(keepdims=True, name="squeeze")(h)
    g = keras.layers.ReLU(name="se_relu")(keras.layers.Conv2D(4, 1, name="se_reduce")(g))
    g = HardSigmoid(name="se_gate")(keras.layers.Conv2D(8, 1, name="se_expand")(g))
    h = keras.layers.Multiply(name="excite")([h, g])
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    x = np.random.default_rng(0).uniform(0, 1, (64, 16, 16, 3)).astype("float32")
    q = quantization.quantize_model(net, load_config(None, []).compression.quantization, False)
    assert quantization.calibrate_ranges(q, [x[:32], x[32:]]) == 2
    blob = artifacts.convert_tflite(artifacts.save_saved_model(q, tmp_path / "sm"), "int8", x, qat=True)
    interpreter = Interpreter(model_content=blob)
    interpreter.allocate_tensors()
    ops = [op["op_name"] for op in interpreter._get_ops_details() if op["op_name"] != "DELEGATE"]
    assert ops[0] == "QUANTIZE" and ops[-1] == "DEQUANTIZE"
    assert "HARD_SWISH" not in ops and not {"QUANTIZE", "DEQUANTIZE"} & set(ops[1:-1]), ops
    assert speed.xnnpack(blob)["fallback"] == []
    expected = q(x, training=False).numpy()
    logits, _ = artifacts.tflite_logits(blob, x)
    sqnr = 10 * np.log10(np.sum(expected ** 2) / np.sum((logits - expected) ** 2))
    assert sqnr >= 25, sqnr
    # each hard sigmoid's relu6(x + 3) held on 8 bits of [0, 6], its gate on [0, 1]: the
    # ranges the int8 file computes in (a gate on [0, 6] would round 6 times coarser)
    held = {}
    for op in interpreter._get_ops_details():
        for index in op["outputs"]:
            detail = interpreter._get_tensor_details(index, 0)
            scale, zero = detail["quantization"]
            if "se_gate" in detail["name"] and scale:
                held[detail["name"].split(";")[0]] = ((-128 - zero) * scale, (127 - zero) * scale)
    assert sorted(held.values()) == [pytest.approx((0.0, 1.0)), pytest.approx((0.0, 6.0))], held
    # the float file it is timed against: the QAT model's float function, fused float
    # HARD_SWISH and no fake quantization left (the fixed ranges are tfmot quantizers)
    float_blob = artifacts.float_tflite(q, tmp_path / "sm", tmp_path, qat=True)
    interpreter = Interpreter(model_content=float_blob)
    interpreter.allocate_tensors()
    float_ops = {op["op_name"] for op in interpreter._get_ops_details()}
    assert "HARD_SWISH" in float_ops and not {"QUANTIZE", "DEQUANTIZE", "FAKE_QUANT"} & float_ops


def test_an_efficientnet_squeeze_excite_block_quantizes_to_int8_ops_xnnpack_runs(tmp_path):
    """EfficientNet's squeeze-excite (pool, reshape, a convolution with swish built in,
    one with sigmoid, the product) as the model is built (`tensor_ops.as_layers`):
    through QAT its int8 file has no float op (the convolutions' swish and sigmoid were
    float, 16 times in EfficientNetB0) and XNNPack runs every op (the reshape's SHAPE,
    STRIDED_SLICE and PACK it did not)."""
    from tftrain.export import artifacts, file_tensors, speed
    from tftrain.models.tensor_ops import as_layers
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", use_bias=False, name="conv")(inputs)
    h = keras.layers.Activation("swish", name="act")(keras.layers.BatchNormalization(name="bn")(h))
    g = keras.layers.GlobalAveragePooling2D(name="squeeze")(h)
    g = keras.layers.Reshape((1, 1, 16), name="se_reshape")(g)
    g = keras.layers.Conv2D(4, 1, activation="swish", name="se_reduce")(g)
    g = keras.layers.Conv2D(16, 1, activation="sigmoid", name="se_expand")(g)
    h = keras.layers.Multiply(name="excite")([h, g])
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(
        keras.layers.GlobalAveragePooling2D(name="pool")(h)))
    x = np.random.default_rng(0).uniform(0, 1, (64, 8, 8, 3)).astype("float32")
    q = quantization.quantize_model(as_layers(net), load_config(None, []).compression.quantization,
                                    False)
    quantization.calibrate_ranges(q, [x])
    blob = artifacts.convert_tflite(artifacts.save_saved_model(q, tmp_path / "sm"), "int8", x, qat=True)
    assert file_tensors.float_ops(blob) == [] and speed.xnnpack(blob)["fallback"] == []
    expected = q(x, training=False).numpy()
    logits, _ = artifacts.tflite_logits(blob, x)
    assert 10 * np.log10(np.sum(expected ** 2) / np.sum((logits - expected) ** 2)) >= 25


def _qat_updates(strategy, accumulation, held, updates=4):
    """A calibrated QAT CNN trained `updates` SGD updates of 64 examples: (its weights,
    its activation ranges before and after)."""
    keras.utils.set_random_seed(5)
    net = cnn()
    cfg = load_config(None, [])
    x, _ = data(64, seed=1)
    with strategy.scope():
        q = quantization.quantize_model(net, cfg.compression.quantization, False)
        quantization.calibrate_ranges(q, [x])
        model = TrainModel.wrap(q, accumulation, unroll=True)
        model.compile(keras.optimizers.SGD(0.5), build_loss("sparse_categorical_crossentropy"))
    before = [v.numpy().copy() for v in quantization.range_variables(q)]
    with quantization.activation_ranges_held() if held else contextlib.nullcontext():
        fit(model, updates)
    return ([w.numpy() for w in q.trainable_weights], before,
            [v.numpy() for v in quantization.range_variables(q)])


@pytest.mark.slow
def test_held_activation_ranges_stay_calibrated_and_make_replicas_equal_accumulation():
    """`ranges: fixed`: the calibrated activation ranges do not move in training, and two
    replicas of 32 compute the updates one device makes accumulating two micro-batches of
    32, to float32 rounding; with moving ranges the two differ (each replica batch moves
    the EMA once, averaged, against once per micro-batch in turn)."""
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    replicas, before, after = _qat_updates(mirrored(), 1, held=True)
    accumulated, _, after_one = _qat_updates(one, 2, held=True)
    assert len(before) > 4 and all(np.array_equal(a, b) for a, b in zip(before, after))
    assert all(np.array_equal(a, b) for a, b in zip(after, after_one))
    held_gap = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                   for a, b in zip(replicas, accumulated))
    assert held_gap < 1e-5, held_gap
    moving_replicas, moving_before, moved = _qat_updates(mirrored(), 1, held=False)
    moving_one, _, _ = _qat_updates(one, 2, held=False)
    assert not all(np.array_equal(a, b) for a, b in zip(moving_before, moved))
    moving_gap = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
                     for a, b in zip(moving_replicas, moving_one))
    assert moving_gap > 10 * held_gap, (moving_gap, held_gap)


def test_a_convnext_block_quantizes_with_its_layer_scale_int8(tmp_path):
    """ConvNeXt's block (a grouped 7x7 convolution, layer norm, Dense, GELU, Dense, layer
    scale, the residual sum): QAT accepts the layer scale (tfmot has no config for it)
    and it becomes an int8 MUL; the layer norm is the one op left float (TFLite has no
    int8 kernel for it), and the file computes what the QAT model does."""
    from tf_keras.src.applications.convnext import LayerScale

    from tftrain.export import artifacts, file_tensors
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 16))
    h = keras.layers.Conv2D(16, 7, padding="same", groups=16, name="depthwise")(inputs)
    h = keras.layers.LayerNormalization(epsilon=1e-6, name="norm")(h)
    h = keras.layers.Dense(32, name="expand")(h)
    h = keras.layers.Activation("gelu", name="gelu")(h)
    h = keras.layers.Dense(16, name="project")(h)
    h = LayerScale(0.5, 16, name="layer_scale")(h)
    h = keras.layers.Add(name="add")([inputs, h])
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(
        keras.layers.GlobalAveragePooling2D(name="pool")(h)))
    x = np.random.default_rng(0).normal(size=(32, 8, 8, 16)).astype("float32")
    q = quantization.quantize_model(net, load_config(None, []).compression.quantization, False)
    assert type(q.get_layer("quant_layer_scale").layer) is LayerScale
    quantization.calibrate_ranges(q, [x])
    blob = artifacts.convert_tflite(artifacts.save_saved_model(q, tmp_path / "sm"), "int8", x, qat=True)
    floats = file_tensors.float_ops(blob)
    assert floats and all("norm" in op for op in floats), floats
    assert not [op for op in floats if "layer_scale" in op or "gelu" in op]
    expected = q(x, training=False).numpy()
    logits, _ = artifacts.tflite_logits(blob, x)
    assert 10 * np.log10(np.sum(expected ** 2) / np.sum((logits - expected) ** 2)) >= 20
