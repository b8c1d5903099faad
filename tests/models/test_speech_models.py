"""Speech models: the in-model features (against tf.signal, and the same in LiteRT) and
a Conv1D model through pruning and prune-preserving QAT to an int8 TFLite file that
takes the raw waveform, with the pruned zeros read back from the file."""

import numpy as np
import pytest
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.data.source import InputSpec
from tftrain.export.artifacts import tflite_logits, tflite_weights
from tftrain.models import MODELS
from tftrain.models.audio import AudioFeatures

from helpers import quick_config


def test_features_are_tf_signal_mfccs_and_litert_computes_the_same():
    rate = 16000
    x = np.random.default_rng(0).normal(size=(3, rate)).astype(np.float32) * 0.1
    layer = AudioFeatures(rate, frame_ms=40, step_ms=20, num_mel_bins=40, num_mfcc=10)
    got = layer(x).numpy()
    frames = tf.signal.frame(x, 640, 320)
    frames -= tf.reduce_mean(frames, axis=-1, keepdims=True)      # each frame's DC removed
    stft = tf.signal.rfft(frames * tf.signal.hann_window(640), [1024])
    mel = tf.signal.linear_to_mel_weight_matrix(40, 513, rate, 20.0, 8000.0)
    logmel = tf.math.log(tf.tensordot(tf.abs(stft) ** 2, mel, 1) + 1e-6)
    want = tf.signal.mfccs_from_log_mel_spectrograms(logmel)[..., :10].numpy()
    assert got.shape == (3, 49, 10) == layer.compute_output_shape((3, rate))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    inputs = keras.Input((rate,))
    model = keras.Model(inputs, layer(inputs))
    blob = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    lite, _ = tflite_logits(blob, x)
    np.testing.assert_allclose(lite.reshape(got.shape), got, rtol=1e-3, atol=2e-2)


@pytest.mark.parametrize("frame_ms, band", [(32.0, (20.0, 4000.0)), (40.0, (20.0, None))])
def test_the_spectrum_matrix_is_the_fft_of_each_centred_windowed_frame(frame_ms, band):
    """`spectrum: matrix` folds each frame's mean removal, window and real DFT of the bins
    the mel filters use into one [frame, 2 x bins] matrix: its product with the frames is
    the FFT's spectrum, bin for bin, and the float model still computes by the FFT."""
    rate = 16000
    x = np.random.default_rng(1).normal(0.05, 0.1, size=(3, rate)).astype(np.float32)
    layer = AudioFeatures(rate, frame_ms=frame_ms, step_ms=20, band=band, spectrum="matrix")
    got = layer(x).numpy()
    frame, bins = int(rate * frame_ms / 1000), layer._bins
    assert layer.dft.shape == (frame, 2 * bins) and not layer.trainable_weights
    frames = tf.signal.frame(x, frame, 320)
    spectrum = tf.signal.rfft((frames - tf.reduce_mean(frames, -1, keepdims=True))
                              * tf.signal.hann_window(frame), [layer.fft_length])[..., :bins]
    parts = tf.matmul(frames, layer.dft).numpy()
    scale = np.abs(spectrum.numpy()).max()
    np.testing.assert_allclose(parts[..., :bins], tf.math.real(spectrum), atol=1e-5 * scale)
    np.testing.assert_allclose(parts[..., bins:], tf.math.imag(spectrum), atol=1e-5 * scale)
    np.testing.assert_array_equal(got, AudioFeatures(rate, frame_ms=frame_ms, step_ms=20,
                                                     band=band)(x).numpy())
    with pytest.raises(ValueError, match="spectrum must be one of"):
        AudioFeatures(rate, spectrum="dft")


def test_an_offset_waveform_has_the_same_features_and_float16_keeps_them():
    """A waveform's DC offset (a `normalize` of its mean) leaves the features as they were,
    and a float16 file, whose window is rounded to 11 bits, computes them 50 dB above its
    difference (with the offset leaking through the window: 22 dB)."""
    rate = 16000
    x = np.zeros((3, rate), np.float32)
    x[:, 4000:9000] = np.random.default_rng(2).normal(size=(3, 5000)) * 0.1   # speech, silence
    inputs = keras.Input((rate,))
    model = keras.Model(inputs, AudioFeatures(rate, frame_ms=30, step_ms=20)(inputs))
    plain, offset = model(x).numpy(), model(x - 0.25).numpy()
    np.testing.assert_allclose(offset, plain, rtol=0, atol=1e-3)
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.target_spec.supported_types = [tf.float16]
    lite, _ = tflite_logits(converter.convert(), x - 0.25)
    sqnr = 10 * np.log10(np.sum(offset ** 2) / np.sum((lite.reshape(offset.shape) - offset) ** 2))
    assert sqnr >= 50, sqnr


@pytest.mark.parametrize("frame_ms, step_ms, samples", [(40, 20, 16000), (30, 20, 16000),
                                                       (32, 20, 8000), (25, 10, 4003)])
def test_frames_are_tf_signal_frames_with_the_shapes_known(frame_ms, step_ms, samples):
    rate = 16000
    layer = AudioFeatures(rate, frame_ms=frame_ms, step_ms=step_ms)
    x = np.random.default_rng(1).normal(size=(2, samples)).astype(np.float32)
    want = tf.signal.frame(x, layer.frame, layer.step).numpy()
    got = layer.frames(tf.constant(x))
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want)
    unknown = tf.function(layer.frames).get_concrete_function(
        tf.TensorSpec([None, None], tf.float32))        # no static length: tf.signal.frame
    np.testing.assert_array_equal(unknown(tf.constant(x)).numpy(), want)


def test_only_the_bins_the_mel_filters_weigh_are_kept():
    layer = AudioFeatures(16000, frame_ms=32, step_ms=20, num_mel_bins=40, band=(20.0, 4000.0))
    layer.build((None, 16000))
    # 512-point FFT: bins of 31.25 Hz; the 4 kHz filter's last nonzero bin is below 128
    assert layer._mel.shape == (layer._bins, 40) and layer._bins <= 129
    full = tf.signal.linear_to_mel_weight_matrix(40, 257, 16000, 20.0, 4000.0).numpy()
    assert not full[layer._bins:].any() and full[layer._bins - 1].any()


def test_speech_models_refuse_inputs_that_are_not_waveforms():
    with pytest.raises(ValueError, match=r"needs raw waveforms \[samples\] with a sample rate"):
        MODELS.get("ds_cnn")(InputSpec((8, 8, 1), "float32", 10))


@pytest.mark.slow
def test_conv1d_model_goes_through_pqat_with_sparsity_in_the_int8_file(tmp_path, spoken_digits):
    from tftrain.run import run
    summary = run(quick_config(
        tmp_path, "run.name=kws", "data.name=audio_folder",
        f"data.params={{path: {spoken_digits}, sample_rate: 16000}}",
        "data.validation_fraction=0.25", "data.per_replica_batch_size=16",
        "model={name: conv1d, params: {filters: [32, 32], dropout: 0.0}}", "train.epochs=2",
        "compression.pruning={enabled: true, final_sparsity: 0.5, epochs: 2, frequency: 2}",
        "compression.quantization={enabled: true, epochs: 1}", "export.tflite=int8"))
    art = summary["artifacts"]["tflite_int8"]
    assert art["verified"] and art["input"] == "float32 [16000]"
    # the features compute in float (the waveform's DFT, power, mel and log): said so
    assert art["label"] == f"int8 with {len(art['float_ops'])} float ops"
    assert any(op.startswith("LOG ") for op in art["float_ops"])
    assert not [op for op in art["float_ops"] if op.startswith(("CONV_2D", "FULLY_CONNECTED"))
                and "features" not in op]
    blob = (tmp_path / "kws" / "export" / "model.tflite").read_bytes()
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_content=blob)
    (inp,) = interp.get_input_details()
    assert inp["dtype"] == np.float32 and list(inp["shape"]) == [1, 16000]   # the raw waveform
    kinds = {d["op_name"] for d in interp._get_ops_details()}
    # the features in the file as builtins (a real FFT, its magnitude, the mel product
    # and the log), then int8 convolutions; the float front end holds only the window
    # and the mel matrix (log-mel of 30 ms frames: 480 + 257 x 40 floats; 2 KB more at
    # most: the gather's sub-frame indices, the shapes), not a DFT matrix
    assert {"RFFT2D", "COMPLEX_ABS", "LOG", "CONV_2D"} <= kinds
    front_end = art["weight_bytes"]["front_end"]
    assert 4 * (480 + 257 * 40) <= front_end < 4 * (480 + 257 * 40) + 2048, front_end
    # the waveform and the FFT's complex output are live at once, at the least
    assert art["arena_bytes"] >= 4 * 16000 + 8 * 49 * 257
    int8 = {name: w for name, w in tflite_weights(blob).items() if w.dtype == np.int8 and w.ndim == 4}
    convs = [w for name, w in int8.items() if "conv_" in name]
    assert len(convs) == 2, list(int8)
    for w in convs:                        # Conv1D kernels, stored as int8 [out, 1, k, in]
        assert abs(np.mean(w == 0) - 0.5) <= 0.01, np.mean(w == 0)
    for name, value in summary["sparsity"].items():
        assert abs(value - 0.5) <= 0.01, (name, value)
