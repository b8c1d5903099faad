"""Speech models on raw waveforms: a feature layer (log-mel spectrogram or MFCC,
computed with `tf.signal`'s mel and DCT matrices inside the model, so the SavedModel and
the TFLite file take the waveform) and keyword-spotting networks after it.

The features are the short-time power spectrum of `tf.signal.stft` (Hann window, |.|²)
computed as two real DFT matrix products per frame, a mel matrix product, a log and
(MFCC) a DCT matrix product: real ops only, which TFLite runs as builtins (framing,
FULLY_CONNECTED, MUL, LOG) in float before the int8 layers, and ONNX has at opset 17. The feature layer computes in float32 whatever the
training policy (a log of a bfloat16 power loses the quiet frames).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.models.registry import MODELS


@keras.utils.register_keras_serializable("tftrain")
class AudioFeatures(keras.layers.Layer):
    """Waveform [batch, samples] -> features [batch, frames, bins]: log-mel energies
    (`num_mfcc: 0`) or the first `num_mfcc` MFCCs of them. Frames are `frame_ms` long
    every `step_ms`, Hann-windowed, with an `fft_length`-point spectrum; the mel bins span
    `band` (lowest and highest Hz; None: half the sample rate)."""

    def __init__(self, sample_rate, frame_ms=30.0, step_ms=20.0, num_mel_bins=40, num_mfcc=0,
                 band=(20.0, None), fft_length=None, **kwargs):
        lower_hz, upper_hz = band
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        self.sample_rate, self.frame_ms, self.step_ms = int(sample_rate), frame_ms, step_ms
        self.frame = int(round(sample_rate * frame_ms / 1000))
        self.step = int(round(sample_rate * step_ms / 1000))
        self.fft_length = fft_length or int(2 ** np.ceil(np.log2(self.frame)))
        if self.fft_length < self.frame:
            raise ValueError(f"fft_length={fft_length} is shorter than a frame ({self.frame} samples)")
        self.num_mel_bins, self.lower_hz = num_mel_bins, lower_hz
        self.upper_hz = upper_hz or sample_rate / 2
        self.num_mfcc = num_mfcc
        if num_mfcc > num_mel_bins:
            raise ValueError(f"num_mfcc={num_mfcc} exceeds num_mel_bins={num_mel_bins}")

    def build(self, input_shape):
        bins = self.fft_length // 2 + 1
        # The windowed DFT of each (zero-padded) frame as two real matrices: the power
        # spectrum is re^2 + im^2, with no complex tensor (TFLite's RFFT2D and the
        # ComplexAbs of |stft| have no ONNX form at opset 17; matrix products do).
        window = tf.signal.hann_window(self.frame, periodic=True).numpy().astype(np.float64)
        angle = 2 * np.pi * np.outer(np.arange(self.frame), np.arange(bins)) / self.fft_length
        self._cos = (window[:, None] * np.cos(angle)).astype(np.float32)
        self._sin = (window[:, None] * -np.sin(angle)).astype(np.float32)
        self._mel = tf.signal.linear_to_mel_weight_matrix(
            self.num_mel_bins, bins, self.sample_rate, self.lower_hz, self.upper_hz).numpy()
        self._dct = None
        if self.num_mfcc:    # the DCT-II tf.signal.mfccs_from_log_mel_spectrograms applies
            self._dct = tf.signal.mfccs_from_log_mel_spectrograms(
                tf.eye(self.num_mel_bins)[None])[0, :, :self.num_mfcc].numpy()
        super().build(input_shape)

    def call(self, waveform):
        frames = tf.signal.frame(tf.cast(waveform, tf.float32), self.frame, self.step)
        real = tf.tensordot(frames, tf.constant(self._cos), 1)
        imag = tf.tensordot(frames, tf.constant(self._sin), 1)
        power = real * real + imag * imag               # |stft|^2
        features = tf.math.log(tf.tensordot(power, tf.constant(self._mel), 1) + 1e-6)
        if self._dct is not None:
            features = tf.tensordot(features, tf.constant(self._dct), 1)
        return features

    def compute_output_shape(self, input_shape):
        frames = None if input_shape[1] is None else 1 + (input_shape[1] - self.frame) // self.step
        return tf.TensorShape([input_shape[0], frames, self.num_mfcc or self.num_mel_bins])

    def get_config(self):
        return {**super().get_config(), "sample_rate": self.sample_rate,
                "frame_ms": self.frame_ms, "step_ms": self.step_ms,
                "fft_length": self.fft_length, "num_mel_bins": self.num_mel_bins,
                "band": [self.lower_hz, self.upper_hz], "num_mfcc": self.num_mfcc}


def _features(spec, features: str, num_mel_bins: int, num_mfcc: int, frames):
    if spec.sample_rate is None or len(spec.shape) != 1:
        raise ValueError("needs raw waveforms [samples] with a sample rate (data.name: "
                         f"audio_folder); got inputs of shape {spec.shape}")
    if features not in ("log_mel", "mfcc"):
        raise ValueError(f"features must be 'log_mel' or 'mfcc', received {features!r}")
    inputs = keras.Input(spec.shape, name="inputs")
    frame_ms, step_ms = frames
    x = AudioFeatures(spec.sample_rate, frame_ms, step_ms, num_mel_bins=num_mel_bins,
                      num_mfcc=num_mfcc if features == "mfcc" else 0, name="features")(inputs)
    return inputs, x


@MODELS.register("ds_cnn")
def ds_cnn(spec, features="mfcc", num_mel_bins=40, num_mfcc=10, frames=(40.0, 20.0),
           filters=64, blocks=4, dropout=0.2):
    """Depthwise-separable CNN for keyword spotting ("Hello Edge", Zhang et al. 2017):
    a 10x4 strided convolution over the (time, feature) map, `blocks` depthwise 3x3 +
    pointwise 1x1 blocks (each with batch norm and ReLU), average pooling, logits.
    `frames`: each frame's length and the step between frames, in ms."""
    inputs, x = _features(spec, features, num_mel_bins, num_mfcc, frames)
    frames, bins = x.shape[1], x.shape[2]
    x = keras.layers.Reshape((frames, bins, 1), name="to_map")(x)
    x = keras.layers.Conv2D(filters, (10, 4), strides=(2, 2), padding="same", use_bias=False,
                            name="conv_0")(x)
    x = keras.layers.BatchNormalization(name="bn_0")(x)
    x = keras.layers.ReLU(name="relu_0")(x)
    for i in range(1, blocks + 1):
        x = keras.layers.DepthwiseConv2D(3, padding="same", use_bias=False, name=f"dw_{i}")(x)
        x = keras.layers.BatchNormalization(name=f"dw_bn_{i}")(x)
        x = keras.layers.ReLU(name=f"dw_relu_{i}")(x)
        x = keras.layers.Conv2D(filters, 1, use_bias=False, name=f"pw_{i}")(x)
        x = keras.layers.BatchNormalization(name=f"pw_bn_{i}")(x)
        x = keras.layers.ReLU(name=f"pw_relu_{i}")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="ds_cnn")


@MODELS.register("conv1d")
def conv1d(spec, features="log_mel", num_mel_bins=40, num_mfcc=13, frames=(30.0, 20.0),
           filters=(64, 64, 128), kernel_size=5, dropout=0.2):
    """A 1-D CNN over time (features as channels) for speech: per entry of `filters` a
    Conv1D (ReLU) and a 2x max pool, then average pooling over time and logits.
    `frames`: each frame's length and the step between frames, in ms."""
    inputs, x = _features(spec, features, num_mel_bins, num_mfcc, frames)
    for i, f in enumerate(filters):
        x = keras.layers.Conv1D(f, kernel_size, padding="same", activation="relu",
                                name=f"conv_{i}")(x)
        x = keras.layers.MaxPooling1D(2, name=f"pool_{i}")(x)
    x = keras.layers.GlobalAveragePooling1D(name="time_pool")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="conv1d")
