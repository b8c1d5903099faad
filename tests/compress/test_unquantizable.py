"""Which layers QAT cannot quantize, and the refusal that lists them."""
import pytest
import tensorflow as tf

from tftrain.compress import quantization, unquantizable
from tftrain.config import ConfigError, load_config
from tftrain.core import console
from tftrain.core.keras import keras
from tftrain.models import layer_parents


def test_a_refusal_of_many_kinds_of_layers_is_at_most_10_lines_of_120_columns():
    """One line per kind with its count and an example (ops named for TFOpLambda), the
    rarest kinds summed up past 10 lines, and the float islands skip_unsupported leaves:
    13 kinds of unquantizable layer in 4 connected groups."""
    inputs = keras.Input((8, 16))
    h = keras.layers.Dense(16, name="proj")(inputs)
    for i in range(3):
        h = tf.math.sin(h)
        h = tf.math.cos(h)
        h = keras.layers.Dense(16, name=f"dense_{i}")(h)
    odd = [keras.layers.UnitNormalization(name="unit"), keras.layers.GroupNormalization(4, name="group"),
           keras.layers.ELU(name="elu"), keras.layers.ThresholdedReLU(name="thresholded"),
           keras.layers.GaussianDropout(0.1, name="gauss_dropout"), keras.layers.GaussianNoise(0.1, name="noise"),
           keras.layers.AlphaDropout(0.1, name="alpha"), keras.layers.PReLU(name="prelu"),
           keras.layers.UpSampling1D(name="upsample"), keras.layers.Masking(name="mask"),
           keras.layers.Lambda(lambda x: x * 2, name="double"),
           keras.layers.LocallyConnected1D(4, 1, name="local")]
    for layer in odd:
        h = layer(h)
    net = keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten(name="flat")(h)))
    cfg = load_config(None, []).compression.quantization
    with pytest.raises(ConfigError) as refused:
        quantization.quantize_model(net, cfg, preserve_sparsity=False)
    problem, = refused.value.problems            # one problem: the prefix printed once
    lines = problem.split("\n")
    printed = console.problem("tftrain: config error: ", problem).splitlines()
    assert len(printed) == 10 and max(map(len, printed)) <= 120, printed
    assert sum("config error" in line for line in printed) == 1
    assert all(line.startswith("    ") for line in printed[1:]), printed
    unsupported = [layer for layer in net.layers
                   if not unquantizable.quantizable(layer, layer_parents(net)[layer.name])]
    kinds = {type(layer).__name__ for layer in unsupported}
    assert len(kinds) == 13 and len(lines) == 10 and max(map(len, lines)) <= 120, lines
    assert lines[0] == (f"compression.quantization: tfmot cannot quantize {len(unsupported)} layers of "
                        f"{len(kinds)} kinds:")
    assert lines[1] == "  TFOpLambda (cos, sin) x 6, e.g. tf.math.sin"
    assert lines[-2].startswith("  and 6 more kinds (")
    assert lines[-1] == ("  skip_unsupported: true keeps them float (4 float islands, a DEQUANTIZE/QUANTIZE "
                         "pair each), or disable quantization")
    assert unquantizable.float_islands(net, {layer.name for layer in unsupported}) == 4
