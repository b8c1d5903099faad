"""A TFLite file's constants split at its first int8 kernel or after its named front-end
layer, and its tensor arena estimate (the peak of activations live at once), against sizes
worked out by hand."""
import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.export import file_memory


def test_the_arena_is_the_peak_of_tensors_live_at_once():
    # input 0 -> op A -> 1 -> op B -> 2 -> op C (reads 0 too) -> 3 (the output)
    ops = [{"inputs": [0, 9], "outputs": [1]}, {"inputs": [1], "outputs": [2]},
           {"inputs": [2, 0], "outputs": [3]}]
    size = {0: 100, 1: 10, 2: 1000, 3: 1, 9: 5000}      # 9: a constant, not counted
    # op B: 0 (read again later), 1 and 2 live; op C: 0, 2 and 3
    assert file_memory.arena(ops, size, [0], [3]) == 100 + 10 + 1000
    # a tensor read by no op later dies where it is written
    assert file_memory.arena(ops, {**size, 2: 10}, [0], [3]) == 100 + 10 + 10 + 1 - 1


def test_a_float_file_has_no_front_end_and_its_arena_holds_its_widest_layer():
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(64, activation="relu", bias_initializer="ones")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, bias_initializer="ones")(hidden))
    blob = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    got = file_memory.layout(blob)
    assert got["weight_bytes"] == {"front_end": 0, "network": 4 * (16 * 64 + 64 + 64 * 3 + 3)}
    # the 64-wide hidden layer with its input, then with the logits
    assert got["arena_bytes"] == 4 * (16 + 64)


def test_an_int8_file_counts_what_comes_before_its_first_int8_kernel_as_front_end():
    inputs = keras.Input((16,))
    weight = np.linspace(1, 2, 9).astype(np.float32)       # folded into the first kernel
    scaled = keras.layers.Lambda(lambda x: tf.abs(tf.signal.rfft(x, [16])) * weight)(inputs)
    dense = keras.layers.Dense(32, bias_initializer="ones")(scaled)
    model = keras.Model(inputs, keras.layers.Dense(8, bias_initializer="ones")(dense))
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    rng = np.random.default_rng(0)
    converter.representative_dataset = lambda: ([rng.normal(size=(1, 16)).astype(np.float32)]
                                                for _ in range(8))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8,
                                           tf.lite.OpsSet.TFLITE_BUILTINS]
    blob = converter.convert()
    weights = file_memory.layout(blob)["weight_bytes"]
    # before: the FFT's axis (int32), its length and its output's shape (int32 [2] each);
    # from the first kernel on: int8 kernels 32 x 9 and 8 x 32, the second layer's
    # int32 bias (the first one's folded into it: no activation between)
    assert weights == {"front_end": 4 + 8 + 8, "network": 32 * 9 + 8 * 32 + 4 * 8}


def test_a_named_front_end_holds_its_int8_kernels_too():
    """With the name of the model's front-end layer, its ops' constants are the front end
    whatever their type: a layer named `features` whose int8 matrix product comes first
    (a speech model's spectrum as an int8 matrix) is counted front end, not network."""
    inputs = keras.Input((16,))
    features = keras.layers.Dense(12, use_bias=False, name="features")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, bias_initializer="ones", name="logits")(features))
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    rng = np.random.default_rng(0)
    converter.representative_dataset = lambda: ([rng.normal(size=(1, 16)).astype(np.float32)]
                                                for _ in range(8))
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    blob = converter.convert()
    # int8 kernels 12 x 16 (features) and 8 x 12 with its int32 bias (logits)
    assert file_memory.layout(blob)["weight_bytes"] == {"front_end": 0,
                                                       "network": 12 * 16 + 8 * 12 + 4 * 8}
    assert file_memory.layout(blob, "features")["weight_bytes"] == {
        "front_end": 12 * 16, "network": 8 * 12 + 4 * 8}
