"""QAT of the speech models' feature layer (`models.audio.AudioFeatures`).

With `spectrum: fft` the layer computes in float (RFFT2D, the mel product, the log) and
only its output is quantized. With `spectrum: matrix` its spectrum is an int8 matrix
product: each frame, scaled to a peak of 1 and quantized on [-1, 1], times the layer's
`dft` matrix (its mean removal, window and real DFT folded into one [frame, 2 x bins]
matrix, quantized per tensor, symmetric) is one int8 FULLY_CONNECTED whose output range
is calibrated and held; the power (scaled back by the frame's peak), mel product and log
after it stay float before the output is quantized again. LiteRT runs that product in
XNNPack's int8 kernels several times faster than the float FFT it replaces
(`docs/applications.md`).
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow_model_optimization.python.core.quantization.keras import (
    quantize_config,
    quantizers,
)

from tftrain.config import ConfigError
from tftrain.core.keras import keras
from tftrain.models.audio import AudioFeatures


def refuse_uncalibrated(model, cfg) -> None:
    """A config error for `calibration_batches: 0` with an int8 spectrum: its range is set
    by calibration and held (`HeldQuantizer`), so it would stay tfmot's [-6, 6]."""
    held = [layer.name for layer in model.layers if matrix_form(layer)]
    if held and cfg.calibration_batches == 0:
        raise ConfigError(
            f"compression.quantization.calibration_batches: 0 leaves the int8 spectrum of "
            f"layer {held[0]} (spectrum: matrix) at tfmot's [-6, 6], and that range is held "
            "through QAT; set calibration_batches: auto, or the model's spectrum: fft")


def matrix_form(layer) -> bool:
    """Whether `layer` is a feature layer whose spectrum QAT quantizes."""
    return isinstance(layer, AudioFeatures) and layer.spectrum == "matrix"


@keras.utils.register_keras_serializable("tftrain")
class HeldQuantizer(quantizers.MovingAverageQuantizer):
    """An 8-bit activation range calibrated at the 99.9th percentile of each tail
    (`qat_base.bounds`) and held there: a spectrum's largest values are rare peaks, and
    at their range the MFCCs of a DS-CNN were 20 dB above the error 8 bits add, 33 dB at
    this one (simulated on the spoken digits). QAT's updates leave it (a moving average
    would draw it back to each batch's extremes)."""
    percentile = 99.9

    def __init__(self, **kwargs):
        super().__init__(num_bits=8, per_axis=False, symmetric=False, narrow_range=False)

    def __call__(self, inputs, training, weights, **kwargs):
        return super().__call__(inputs, False, weights, **kwargs)

    def get_config(self):
        return {}


@keras.utils.register_keras_serializable("tftrain")
class SpectrumQuantizeConfig(quantize_config.QuantizeConfig):
    """The `dft` matrix (8 bits, symmetric, per tensor: its columns are cosines and
    sines of one amplitude), the frames it reads (on [-1, 1]: each is scaled to its
    peak), the spectrum it makes (an 8-bit range calibrated on data, `HeldQuantizer`)
    and the features (the layer's output, as every float layer's)."""

    def get_weights_and_quantizers(self, layer):
        return [(layer.dft, quantizers.LastValueQuantizer(
            num_bits=8, per_axis=False, symmetric=True, narrow_range=True))]

    def get_activations_and_quantizers(self, layer):
        return [(layer.frame_activation, quantizers.FixedQuantizer(
                    num_bits=8, init_min=-1.0, init_max=1.0, narrow_range=True)),
                (layer.spectrum_activation, HeldQuantizer())]

    def set_quantize_weights(self, layer, quantize_weights):
        layer.quantized_dft = quantize_weights[0]

    def set_quantize_activations(self, layer, quantize_activations):
        layer.frame_activation, layer.spectrum_activation = quantize_activations

    def get_output_quantizers(self, layer):
        return [quantizers.MovingAverageQuantizer(
            num_bits=8, per_axis=False, symmetric=False, narrow_range=False)]

    def get_config(self):
        return {}


@keras.utils.register_keras_serializable("tftrain")
class HeldSpectrum(AudioFeatures):
    """The int8 SavedModel's form of a QAT feature layer with `spectrum: matrix`: it
    computes as the QAT model does at inference, with nothing of tfmot's: the frames at
    8 bits on [-1, 1], the `dft` matrix at 8 bits (symmetric, its own extent, as the
    kernel quantizer's last value has it) and the spectrum in its held range."""

    def __init__(self, *args, spectrum_range=(0.0, 0.0), **kwargs):
        super().__init__(*args, **kwargs)
        self.spectrum_range = tuple(float(v) for v in spectrum_range)

    def build(self, input_shape):
        super().build(input_shape)
        low, high = self.spectrum_range
        self.frame_activation = lambda x: tf.quantization.fake_quant_with_min_max_args(
            x, -1.0, 1.0, num_bits=8, narrow_range=True)
        self.spectrum_activation = lambda x: tf.quantization.fake_quant_with_min_max_args(
            x, low, high, num_bits=8, narrow_range=False)

    @property
    def quantized_dft(self):
        extent = tf.reduce_max(tf.abs(self.dft))
        return tf.quantization.fake_quant_with_min_max_vars(self.dft, -extent, extent,
                                                            num_bits=8, narrow_range=True)

    def get_config(self):
        return {**super().get_config(), "spectrum_range": list(self.spectrum_range)}


def held_form(layer, config: dict, ranges: list) -> tuple[type, dict]:
    """The class and config of a float layer standing for `layer` (a QAT-wrapped layer
    quantized inside its computation) with the `(min, max)` `ranges` of its inner
    activation quantizers that hold variables, in its config's order."""
    if not matrix_form(layer) or len(ranges) != 1:
        raise ValueError(f"layer {layer.name}: {type(layer).__name__} with {len(ranges)} "
                         "inner activation ranges has no int8 SavedModel form")
    return HeldSpectrum, {**config, "spectrum_range": list(ranges[0])}
