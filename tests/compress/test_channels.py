"""Channel pruning: groups, widths for a FLOPs target, and the narrower model computing
exactly what the wide one computes with the pruned channels unread."""
import sys
import types

import numpy as np
import pytest

from tftrain.compress import channels
from tftrain.config import ConfigError
from tftrain.core.keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS

IMAGES = InputSpec((32, 32, 3), "float32", 10)


def with_statistics(model, seed=0):
    """Batch norms with statistics far from (0, 1), so a wrong slice shows."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(size=n) * 0.5)
            layer.moving_variance.assign(rng.uniform(0.2, 3.0, n))
            if layer.scale:
                layer.gamma.assign(rng.uniform(0.3, 2.0, n))
            if layer.center:
                layer.beta.assign(rng.normal(size=n) * 0.5)
    return model


def narrowed_and_masked(model, target=0.5):
    graph, plan = channels.plan(model, target)
    keep = channels.select(graph, plan.counts)
    return graph, plan, keep, channels.narrowed(graph, keep), channels.masked(graph, keep)


def agree(narrow, wide, shape, seed=0):
    x = np.random.default_rng(seed).normal(size=(16, *shape)).astype(np.float32)
    a, b = narrow(x, training=False).numpy(), wide(x, training=False).numpy()
    scale = float(np.abs(b).max())
    assert scale > 1e-3                                # the outputs carry signal
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, scale))
    return a


def test_a_narrowed_resnet_computes_what_the_wide_one_computes_without_the_pruned_channels():
    """ResNet-14: each residual stage's convolutions before an add, the add, the block
    outputs and the next blocks' inputs are one group, so the same channels go in every
    branch; the model keeps <= 50% of its FLOPs and computes to 1e-5 what the wide model
    computes when nothing reads a pruned channel."""
    net = with_statistics(MODELS.get("resnet")(IMAGES, depth=14, width=16))
    graph, plan, keep, narrow, wide = narrowed_and_masked(net)
    for layer in net.layers:
        if isinstance(layer, keras.layers.Add):
            roots = {graph.root(g) for i in graph.inputs[layer.name] for g, _ in graph.spaces[i]}
            assert len(roots) == 1, layer.name
            widths = {narrow.get_layer(i).output_shape[-1] for i in graph.inputs[layer.name]}
            assert len(widths) == 1 and widths.pop() < layer.output_shape[-1]
    assert plan.flops_after <= 0.5 * plan.flops_before
    assert channels.flops(narrow) == pytest.approx(plan.flops_after)
    assert narrow.count_params() < 0.55 * net.count_params()
    assert narrow.get_layer("logits").output_shape[-1] == 10       # the output keeps all
    agree(narrow, wide, IMAGES.shape)
    # the wrong channels would not agree: keep the least important ones instead
    worst = {g: np.sort(np.argsort(s)[:len(keep[g])]) for g, s in channels.importance(graph).items()}
    x = np.random.default_rng(1).normal(size=(16, *IMAGES.shape)).astype(np.float32)
    assert not np.allclose(channels.narrowed(graph, worst)(x, training=False).numpy(),
                           wide(x, training=False).numpy(), atol=1e-3)


def test_a_depthwise_separable_block_keeps_its_depthwise_on_its_input_channels():
    """A depthwise convolution follows its input's channels: pointwise filters, the
    depthwise kernel and both batch norms lose the same channels; MobileNetV2 (adds,
    padding, ReLU6) narrows too and computes what the masked wide model computes."""
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(24, 3, padding="same", use_bias=False, name="pw_0")(inputs)
    h = keras.layers.BatchNormalization(name="pw_bn_0")(h)
    h = keras.layers.ReLU(name="relu_0")(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(h)
    h = keras.layers.BatchNormalization(name="dw_bn")(h)
    h = keras.layers.ReLU(name="dw_relu")(h)
    h = keras.layers.Conv2D(32, 1, name="pw_1")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    net = with_statistics(keras.Model(inputs, keras.layers.Dense(10, name="logits")(h)))
    graph, plan, keep, narrow, wide = narrowed_and_masked(net)
    group = graph.group(graph.spaces["pw_0"][0][0])
    assert {"pw_0", "pw_bn_0", "dw", "dw_bn", "dw_relu"} <= set(group.members)
    kept = len(keep[graph.root(graph.spaces["pw_0"][0][0])])
    assert narrow.get_layer("dw").depthwise_kernel.shape[2] == kept < 24
    assert narrow.get_layer("pw_1").kernel.shape[2] == kept
    agree(narrow, wide, (16, 16, 3))

    from tftrain.models.applications import application
    mobilenet = with_statistics(application("MobileNetV2")(IMAGES, alpha=0.35))
    graph, plan, keep, narrow, wide = narrowed_and_masked(mobilenet)
    assert plan.groups >= 10 and plan.flops_after <= 0.5 * plan.flops_before
    agree(narrow, wide, IMAGES.shape)


def test_flatten_concatenate_and_conv1d_are_followed():
    """The dense layer after a flatten loses the rows of the pruned channels at every
    position; a concatenation keeps each input's channels in its own slice; Conv1D and
    1-D pooling narrow like their 2-D forms."""
    inputs = keras.Input((8, 8, 2))
    a = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="a")(inputs)
    b = keras.layers.Conv2D(12, 3, padding="same", activation="relu", name="b")(inputs)
    h = keras.layers.Concatenate(name="cat")([a, b])
    h = keras.layers.MaxPooling2D(name="pool")(keras.layers.Conv2D(16, 1, name="mix")(h))
    h = keras.layers.Dense(20, activation="relu", name="hidden")(keras.layers.Flatten(name="flat")(h))
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    graph, plan, keep, narrow, wide = narrowed_and_masked(net)
    assert narrow.get_layer("cat").output_shape[-1] == len(keep[graph.root(graph.spaces["a"][0][0])]) \
        + len(keep[graph.root(graph.spaces["b"][0][0])])
    mix = len(keep[graph.root(graph.spaces["mix"][0][0])])
    assert narrow.get_layer("hidden").kernel.shape[0] == 16 * mix
    agree(narrow, wide, (8, 8, 2))

    speech = InputSpec((64, 13), "float32", 10)
    inputs = keras.Input(speech.shape)
    h = keras.layers.Conv1D(16, 5, padding="same", activation="relu", name="c0")(inputs)
    h = keras.layers.MaxPooling1D(2, name="p0")(h)
    h = keras.layers.Conv1D(32, 5, padding="same", activation="relu", name="c1")(h)
    h = keras.layers.GlobalAveragePooling1D(name="gp")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    graph, plan, keep, narrow, wide = narrowed_and_masked(net)
    assert narrow.get_layer("c1").kernel.shape[1:] == (len(keep[graph.root(graph.spaces["c0"][0][0])]),
                                                       len(keep[graph.root(graph.spaces["c1"][0][0])]))
    agree(narrow, wide, speech.shape)


def test_a_layer_with_a_built_in_softmax_keeps_all_its_channels():
    """A convolution or dense layer with activation="softmax" normalizes across its
    channels: removing some would change the others, so its group keeps every channel
    (as after a softmax Activation layer), while the groups before it still narrow."""
    inputs = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="a")(inputs)
    h = keras.layers.Conv2D(12, 1, activation="softmax", name="attention")(h)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="b")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gp")(h)
    net = keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))
    graph = channels.ChannelGraph(net)
    attention = graph.group(graph.spaces["attention"][0][0])
    assert attention.fixed == "attention (Conv2D) applies a softmax across its channels"
    prunable = graph.prunable()
    assert graph.root(graph.spaces["attention"][0][0]) not in prunable
    assert graph.root(graph.spaces["a"][0][0]) in prunable
    _, plan, keep, narrow, wide = narrowed_and_masked(net)
    assert narrow.get_layer("attention").kernel.shape[-1] == 12
    assert narrow.get_layer("a").kernel.shape[-1] < 16
    agree(narrow, wide, (8, 8, 2))


def test_widths_keep_one_share_of_every_group_for_the_flops_target():
    net = MODELS.get("cnn")(IMAGES, filters=[32, 64], dense=[128])
    graph = channels.ChannelGraph(net)
    for target in (0.25, 0.5, 0.75):
        counts = channels.widths(graph, target)
        shares = [counts[g] / graph.groups[g].width for g in counts]
        assert max(shares) - min(shares) < 0.05
        assert channels.flops_with(graph, counts) <= target * channels.flops(net)
    assert channels.flops_with(graph, {}) == channels.flops(net)
    # rounded to a multiple of 8 (the channel tile of XNNPack's kernels): MobileNetV2's
    # narrowed float file ran 1.64x faster than the dense one, 1.43x unrounded
    counts = channels.widths(graph, 0.5, multiple=8)
    assert all(c % 8 == 0 or c == graph.groups[g].width for g, c in counts.items())
    assert channels.flops_with(graph, counts) <= 0.5 * channels.flops(net)


class Scale(keras.layers.Layer):
    """A custom layer: nothing tells the groups how its channels relate to its input's."""

    def call(self, x):
        return x * 2.0


def test_a_layer_the_groups_cannot_follow_is_refused_by_name(monkeypatch, tmp_path, capsys):
    inputs = keras.Input((8, 8, 1))
    h = Scale(name="my_scale")(keras.layers.Conv2D(8, 3, name="conv")(inputs))
    h = keras.layers.GlobalAveragePooling2D()(h)
    net = keras.Model(inputs, keras.layers.Dense(10)(h))
    with pytest.raises(ConfigError, match=r"compression\.pruning\.structure: channels cannot "
                                          r"follow my_scale \(Scale\)"):
        channels.ChannelGraph(net)

    class Subclassed(keras.Model):
        def call(self, x):
            return x
    with pytest.raises(ConfigError, match="Subclassed is subclassed"):
        channels.ChannelGraph(Subclassed())

    # from the CLI: exit 2 at plan time, nothing written
    from tftrain.run import main
    module = types.ModuleType("channel_models")
    module.custom = lambda spec: keras.Model(inputs, net.outputs)
    monkeypatch.setitem(sys.modules, "channel_models", module)
    runs = tmp_path / "runs"
    code = main(["configs/quickstart.yaml", "--run-dir", str(runs), "--set",
                 "model={name: 'channel_models:custom', params: {}}", "--set",
                 "compression.pruning={enabled: true, structure: channels}"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot follow my_scale (Scale)" in err and "Traceback" not in err
    assert not runs.exists()


def test_auto_importance_ranks_by_batch_norm_scale_where_a_group_has_one_else_by_filter_norm():
    """`auto`: the group whose conv feeds a batch norm ranks channels by |gamma| (its
    filters' norms say otherwise), the group without one by L1; `bn` refuses the latter."""
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, name="plain")(inputs)                  # no batch norm
    h = keras.layers.Conv2D(8, 3, use_bias=False, name="normed")(h)
    h = keras.layers.BatchNormalization(name="normed_bn")(h)
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    ramp = np.arange(1, 9, dtype=np.float32)
    for name, order in (("plain", ramp), ("normed", ramp[::-1])):
        layer = model.get_layer(name)
        layer.kernel.assign(np.ones(layer.kernel.shape, np.float32) * order)
    model.get_layer("normed_bn").gamma.assign(ramp)            # gamma: the opposite order
    graph = channels.ChannelGraph(model)
    by_group = {graph.groups[g].producers[0]: g for g in graph.prunable()}
    auto, l1 = channels.importance(graph, "auto"), channels.importance(graph, "l1")
    assert np.argmax(auto[by_group["normed"]]) == 7 and np.argmax(l1[by_group["normed"]]) == 0
    assert np.argmax(auto[by_group["plain"]]) == 7
    np.testing.assert_allclose(auto[by_group["plain"]], l1[by_group["plain"]])
    with pytest.raises(ConfigError, match="bn needs a batch norm .* plain"):
        channels.importance(graph, "bn")


@pytest.mark.slow
def test_a_narrowed_mobilenet_v3_keeps_each_squeeze_excite_gate_on_its_block_s_channels():
    """MobileNetV3Small (its hard-swish and gates as tftrain's layers): a squeeze-excite
    gate multiplies the block's features channel by channel, so the gate's expanding
    convolution and the block's expansion are one group; the narrowed model computes
    what the wide one computes without the pruned channels."""
    from tftrain.models.applications import application
    from tftrain.models.tensor_ops import as_layers
    keras.utils.set_random_seed(0)
    net = with_statistics(as_layers(application("MobileNetV3Small")(IMAGES, alpha=0.75)))
    graph, plan, keep, narrow, wide = narrowed_and_masked(net)
    gates = [layer for layer in net.layers if isinstance(layer, keras.layers.Multiply)]
    assert len(gates) == 9
    for gate in gates:
        roots = {graph.root(g) for i in graph.inputs[gate.name] for g, _ in graph.spaces[i]}
        assert len(roots) == 1, gate.name
    assert plan.flops_after <= 0.5 * plan.flops_before and narrow.count_params() < net.count_params()
    agree(narrow, wide, IMAGES.shape)


@pytest.mark.slow
def test_a_narrowed_efficientnet_prunes_the_expanded_channels_its_squeeze_excite_reshapes():
    """EfficientNetB0's squeeze-excite reshapes the pooled (C,) to (1, 1, C): channel by
    channel, so the block's expanded channels are prunable (an opaque reshape would keep
    them all) and the reshape takes the narrowed width."""
    from tftrain.models.applications import application
    from tftrain.models.tensor_ops import as_layers
    keras.utils.set_random_seed(0)
    # as Keras Applications build it (as a model is built, `tensor_ops` makes the pooling
    # keep its dimensions and drops the reshape)
    net = with_statistics(application("EfficientNetB0")(IMAGES))
    graph, plan, keep, narrow, wide = narrowed_and_masked(net)
    reshapes = [layer for layer in net.layers if isinstance(layer, keras.layers.Reshape)]
    assert len(reshapes) == 16
    narrowed_widths = [narrow.get_layer(r.name).output_shape[-1] < r.output_shape[-1] for r in reshapes]
    assert sum(narrowed_widths) >= 8, narrowed_widths
    assert plan.flops_after <= 0.5 * plan.flops_before
    agree(narrow, wide, IMAGES.shape)
    # as a run builds it: the pooling keeps its dimensions, no reshape; the same channels go
    graph, plan_kept, _, narrow, wide = narrowed_and_masked(as_layers(net))
    assert sorted(plan_kept.counts.values()) == sorted(plan.counts.values()) and not any(
        isinstance(layer, keras.layers.Reshape) for layer in narrow.layers)
    agree(narrow, wide, IMAGES.shape)
