"""Segments for recomputation: cut where one tensor is live (blocks) or every K layers,
covering the model's layers once, in order; what they keep, estimated."""
import math

import pytest

from tftrain.config import ConfigError
from tftrain.core.keras import keras
from tftrain.data import InputSpec
from tftrain.models import MODELS
from tftrain.runtime import placement, segments

SPEC = InputSpec((16, 16, 3), "float32", 10)


def resnet():
    return MODELS.get("resnet")(SPEC, depth=20, width=8)


def test_blocks_cut_where_one_tensor_is_live_in_the_size_that_keeps_least():
    model = resnet()
    calls = segments.layer_calls(model)
    found = segments.segments(model, "blocks")
    assert [s.start for s in found] == [0] + [s.stop for s in found[:-1]]
    assert found[-1].stop == len(calls)
    assert all(len(s.inputs) == 1 for s in found)         # a single tensor at every cut
    assert len(found) >= 3
    # the size that keeps least: below the square root of the layer count's segments
    sizes = {c.name: c.activation_bytes for c in placement.layer_costs(model)}
    chen = segments._cut(segments._live(model, calls), segments._greedy(
        [i for i, live in enumerate(segments._live(model, calls)) if len(live) == 1 and
         0 < i < len(calls)], len(calls), round(math.sqrt(len(calls)))))
    assert segments.kept_bytes(model, found, sizes) <= segments.kept_bytes(model, chen, sizes)


def test_a_transformer_keeps_one_layer_per_segment():
    """Its layers' boundaries are one (batch, tokens, dim) tensor, small beside the
    attention scores inside: a layer a segment keeps least (the square root of its 113
    layer calls, 11, put two transformer layers in each, 1.8x the memory)."""
    spec = InputSpec((32,), "int32", 4, vocab_size=50)
    model = MODELS.get("transformer")(spec, embed_dim=16, num_heads=2, num_layers=12,
                                      mlp_dim=32, dropout=0.1)
    found = segments.segments(model, "blocks")
    assert len(found) == 12
    calls = segments.layer_calls(model)
    assert all(type(calls[s.start - 1].layer).__name__ == "Add" for s in found[1:])


def test_every_k_layers_keeps_whatever_is_live_at_the_cut():
    model = resnet()
    found = segments.segments(model, "every", 5)
    assert [s.stop - s.start for s in found[:-1]] == [5] * (len(found) - 1)
    assert any(len(s.inputs) == 2 for s in found)         # inside a block: branch and shortcut


def test_a_subclassed_model_is_refused_with_the_reason():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)
    net = Net()
    net(keras.Input((4,)))
    with pytest.raises(ConfigError, match="train.recompute: model .* is not a functional model"):
        segments.segments(net, "blocks")


def test_recompute_keeps_a_fraction_of_the_activations():
    model = resnet()
    costs = placement.layer_costs(model)
    every = sum(c.activation_bytes for c in costs)
    kept = segments.kept_bytes(model, segments.segments(model, "blocks"),
                               {c.name: c.activation_bytes for c in costs})
    assert 0.1 * every < kept < 0.7 * every
    assert "segments of" in segments.describe(segments.segments(model, "blocks"), "blocks")
