"""Speech models on raw waveforms: a feature layer (log-mel spectrogram or MFCC,
computed with `tf.signal` inside the model, so the SavedModel and the TFLite file take
the waveform) and keyword-spotting networks after it.

The features are the short-time power spectrum of `tf.signal.stft` (Hann window, |.|²)
of each frame less its mean (its DC offset): each frame's real FFT (`tf.signal.rfft`) and its magnitude squared, then a mel matrix
product over only the FFT bins the mel filters use, a log and (MFCC) a DCT matrix
product. TFLite runs them as builtins (framing by GATHER of sub-frames, RFFT2D,
COMPLEX_ABS, FULLY_CONNECTED, LOG) in float before the int8 layers, holding only the
window and the mel and DCT matrices (a few KB); tf2onnx writes the FFT of the ONNX
files as a DFT matrix product (opset 17 has no real FFT ONNX Runtime runs on CPU), so
the ONNX files hold that matrix. The feature layer computes in float32 whatever the
training policy (a log of a bfloat16 power loses the quiet frames).
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tftrain.core.keras import keras
from tftrain.models.registry import MODELS

# how QAT and the int8 file compute each frame's spectrum: "fft" (RFFT2D in float, a few
# bytes of constants) or "matrix" (one int8 matrix product: frame x 2 x bins bytes)
SPECTRA = ("fft", "matrix")


@keras.utils.register_keras_serializable("tftrain")
class AudioFeatures(keras.layers.Layer):
    """Waveform [batch, samples] -> features [batch, frames, bins]: log-mel energies
    (`num_mfcc: 0`) or the first `num_mfcc` MFCCs of them. Frames are `frame_ms` long
    every `step_ms`, Hann-windowed, with an `fft_length`-point spectrum; the mel bins span
    `band` (lowest and highest Hz; None: half the sample rate)."""

    front_end = True        # a file's constants are split at its output (`file_memory`)

    def __init__(self, sample_rate, frame_ms=30.0, step_ms=20.0, num_mel_bins=40, num_mfcc=0,
                 band=(20.0, None), fft_length=None, spectrum="fft", **kwargs):
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
        if spectrum not in SPECTRA:
            raise ValueError(f"spectrum must be one of {SPECTRA}, received {spectrum!r}")
        self.spectrum = spectrum
        if num_mfcc > num_mel_bins:
            raise ValueError(f"num_mfcc={num_mfcc} exceeds num_mel_bins={num_mel_bins}")

    def build(self, input_shape):
        bins = self.fft_length // 2 + 1
        self._window = tf.signal.hann_window(self.frame, periodic=True).numpy()
        mel = tf.signal.linear_to_mel_weight_matrix(
            self.num_mel_bins, bins, self.sample_rate, self.lower_hz, self.upper_hz).numpy()
        # only the bins up to the last one a mel filter weighs (fewer below a low upper_hz)
        self._bins = int(np.flatnonzero(mel.any(axis=1)).max()) + 1
        self._mel = mel[:self._bins]
        self._dct = None
        if self.num_mfcc:    # the DCT-II tf.signal.mfccs_from_log_mel_spectrograms applies
            self._dct = tf.signal.mfccs_from_log_mel_spectrograms(
                tf.eye(self.num_mel_bins)[None])[0, :, :self.num_mfcc].numpy()
        # the form QAT quantizes (`spectrum: matrix`): a non-trainable weight, so tfmot
        # can give it a kernel quantizer; the float model computes by the FFT
        self.spectrum_activation = keras.activations.get("linear")
        self.frame_activation = keras.activations.get("linear")
        if self.spectrum == "matrix":
            self.dft = self.add_weight(
                name="dft", shape=(self.frame, 2 * self._bins), trainable=False,
                initializer=keras.initializers.Constant(self.spectrum_matrix()))
        super().build(input_shape)

    def spectrum_matrix(self) -> np.ndarray:
        """A frame's mean removal, Hann window and real DFT of the bins the mel filters
        use, as one [frame, 2 x bins] matrix (real parts, then imaginary): the frame
        times it is `rfft((frame - mean) * window)[:bins]`. Windowing and centring are
        linear, so they fold into the DFT's columns (each column less its mean)."""
        n, k = np.arange(self.frame)[:, None], np.arange(self._bins)[None, :]
        angle = 2 * np.pi * n * k / self.fft_length
        dft = np.concatenate([np.cos(angle), -np.sin(angle)], axis=1)
        windowed = self._window.astype(np.float64)[:, None] * dft
        return (windowed - windowed.mean(axis=0, keepdims=True)).astype(np.float32)

    def frames(self, waveform):
        """`tf.signal.frame` (no padding), written with the waveform's static length where
        it has one: one gather of sub-frames (the frame and step's common divisor) by
        constant indices between two reshapes, with none of the shape arithmetic a file
        would otherwise compute at each call."""
        samples = waveform.shape[-1]
        if samples is None or samples < self.frame:
            return tf.signal.frame(waveform, self.frame, self.step)
        sub = math.gcd(self.frame, self.step)
        count = 1 + (samples - self.frame) // self.step
        used = (count - 1) * self.step + self.frame
        parts = tf.reshape(waveform[:, :used], [-1, used // sub, sub])
        index = (np.arange(count)[:, None] * (self.step // sub)
                 + np.arange(self.frame // sub)[None, :]).astype(np.int32)
        return tf.reshape(tf.gather(parts, index, axis=1), [-1, count, self.frame])

    def call(self, waveform):
        frames = self.frames(tf.cast(waveform, tf.float32))
        matrix = getattr(self, "quantized_dft", None)      # set by QAT (`qat_audio`)
        if matrix is not None:
            # one int8 FULLY_CONNECTED in the int8 file: each frame scaled to a peak of 1
            # and quantized on [-1, 1] (`frame_activation`), times the int8 matrix, its
            # output range calibrated and held (`spectrum_activation`); the power scaled back. With
            # the frames' own peaks a quiet frame keeps its 8 bits: at one range for all,
            # a DS-CNN's MFCCs were 4 dB above their error, 20 dB this way.
            peak = tf.maximum(tf.reduce_max(tf.abs(frames), axis=-1, keepdims=True), 1e-4)
            parts = self.spectrum_activation(_dot(self.frame_activation(frames / peak), matrix))
            power = (tf.square(parts[..., :self._bins]) + tf.square(parts[..., self._bins:])) \
                * tf.square(peak)
        else:
            power = self.power(frames)
        features = tf.math.log(_dot(power, self._mel) + 1e-6)
        if self._dct is not None:
            features = _dot(features, self._dct)
        return features

    def power(self, frames):
        """Each frame's power spectrum up to the last bin a mel filter weighs."""
        # each frame less its mean (Kaldi's remove_dc_offset): a waveform's offset (a
        # `normalize` of its mean) would otherwise leak through the window into every bin,
        # and a float16 file's rounded window makes that leak 70 dB above silence's power
        frames = frames - tf.reduce_mean(frames, axis=-1, keepdims=True)
        spectrum = tf.signal.rfft(frames * tf.constant(self._window), [self.fft_length])
        # |.|² through ComplexAbs, the one consumer of an FFT ONNX conversion knows
        return tf.square(tf.abs(spectrum))[..., :self._bins]

    def compute_output_shape(self, input_shape):
        frames = None if input_shape[1] is None else 1 + (input_shape[1] - self.frame) // self.step
        return tf.TensorShape([input_shape[0], frames, self.num_mfcc or self.num_mel_bins])

    def get_config(self):
        return {**super().get_config(), "sample_rate": self.sample_rate,
                "frame_ms": self.frame_ms, "step_ms": self.step_ms,
                "fft_length": self.fft_length, "num_mel_bins": self.num_mel_bins,
                "band": [self.lower_hz, self.upper_hz], "num_mfcc": self.num_mfcc,
                "spectrum": self.spectrum}


def _dot(x, matrix):
    """x [..., K] times a constant [K, M]: one matrix product over the rows (a TFLite
    FULLY_CONNECTED), reshaped back by x's static shape where it has one
    (`tf.tensordot` computes the shapes at each call)."""
    inner, matrix = x.shape[1:-1], tf.convert_to_tensor(matrix)
    if None in inner:
        return tf.tensordot(x, matrix, 1)
    rows = tf.matmul(tf.reshape(x, [-1, matrix.shape[0]]), matrix)
    return tf.reshape(rows, [-1, *inner, matrix.shape[1]])


def _features(spec, features: str, num_mel_bins: int, num_mfcc: int, frames, band,
              spectrum: str):
    if spec.sample_rate is None or len(spec.shape) != 1:
        raise ValueError("needs raw waveforms [samples] with a sample rate (data.name: "
                         f"audio_folder); got inputs of shape {spec.shape}")
    if features not in ("log_mel", "mfcc"):
        raise ValueError(f"features must be 'log_mel' or 'mfcc', received {features!r}")
    inputs = keras.Input(spec.shape, name="inputs")
    frame_ms, step_ms = frames
    x = AudioFeatures(spec.sample_rate, frame_ms, step_ms, num_mel_bins=num_mel_bins,
                      num_mfcc=num_mfcc if features == "mfcc" else 0, band=tuple(band),
                      spectrum=spectrum, name="features")(inputs)
    return inputs, x


@MODELS.register("ds_cnn")
def ds_cnn(spec, features="mfcc", num_mel_bins=40, num_mfcc=10, frames=(40.0, 20.0),
           filters=64, blocks=4, dropout=0.2, band=(20.0, None), spectrum="fft"):
    """Depthwise-separable CNN for keyword spotting ("Hello Edge", Zhang et al. 2017):
    a 10x4 strided convolution over the (time, feature) map, `blocks` depthwise 3x3 +
    pointwise 1x1 blocks (each with batch norm and ReLU), average pooling, logits.
    `frames`: each frame's length and the step between frames, in ms; `band`: the mel
    filters' lowest and highest Hz (None: half the sample rate); `spectrum`: how QAT and
    the int8 file compute each frame's spectrum (`SPECTRA`)."""
    inputs, x = _features(spec, features, num_mel_bins, num_mfcc, frames, band, spectrum)
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
           filters=(64, 64, 128), kernel_size=5, dropout=0.2, band=(20.0, None),
           spectrum="fft"):
    """A 1-D CNN over time (features as channels) for speech: per entry of `filters` a
    Conv1D (ReLU) and a 2x max pool, then average pooling over time and logits.
    `frames`: each frame's length and the step between frames, in ms; `band`: the mel
    filters' lowest and highest Hz (None: half the sample rate); `spectrum`: as
    `ds_cnn`'s."""
    inputs, x = _features(spec, features, num_mel_bins, num_mfcc, frames, band, spectrum)
    for i, f in enumerate(filters):
        x = keras.layers.Conv1D(f, kernel_size, padding="same", activation="relu",
                                name=f"conv_{i}")(x)
        x = keras.layers.MaxPooling1D(2, name=f"pool_{i}")(x)
    x = keras.layers.GlobalAveragePooling1D(name="time_pool")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    outputs = keras.layers.Dense(spec.num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="conv1d")
