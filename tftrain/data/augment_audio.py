"""Waveform augmentations (`data.augment` entries for 1-D audio), seeded statelessly
like the image ones.

`spec_augment` is SpecAugment's time and frequency masking (Park et al. 2019) applied
to the waveform rather than to a spectrogram, so the features stay inside the model
(which the exported artifacts need) and the masks stay seeded per example: a time mask
zeroes a span of samples, a frequency mask zeroes a band of the waveform's spectrum,
which removes that band from every frame of its spectrogram.
"""
from __future__ import annotations

import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.data.augment import AUGMENTS, Op, _fold


def _fraction(value: float, key: str) -> float:
    if not 0 <= value < 1:
        raise ConfigError(f"data.augment.{key}: {value}; expected a fraction in [0, 1)")
    return value


def _span(n, fraction: float, seed):
    """A random [start, stop) of at most `fraction` of n, as a boolean mask of n."""
    width = tf.random.stateless_uniform([], seed, 0, tf.cast(tf.cast(n, tf.float32) * fraction,
                                                            tf.int32) + 1, tf.int32)
    start = tf.random.stateless_uniform([], _fold(seed, 7), 0, tf.maximum(n - width, 0) + 1,
                                        tf.int32)
    i = tf.range(n)
    return (i >= start) & (i < start + width)


@AUGMENTS.register("spec_augment")
def spec_augment(time_masks: int = 2, time_mask: float = 0.1, freq_masks: int = 2,
                 freq_mask: float = 0.1) -> Op:
    """`time_masks` spans of up to `time_mask` of the clip zeroed, and `freq_masks`
    bands of up to `freq_mask` of the spectrum removed (widths drawn per example)."""
    _fraction(time_mask, "spec_augment.time_mask")
    _fraction(freq_mask, "spec_augment.freq_mask")

    def fn(x, seed):
        if len(x.shape) != 1:
            raise ConfigError("data.augment.spec_augment: needs 1-D waveforms (data.name: "
                              f"audio_folder), got examples of shape {x.shape}")
        n = tf.shape(x)[0]
        if freq_masks and freq_mask:
            spectrum = tf.signal.rfft(x)
            bins = tf.shape(spectrum)[0]
            keep = tf.ones([bins], tf.bool)
            for i in range(freq_masks):
                keep &= ~_span(bins, freq_mask, _fold(seed, 10 + i))
            x = tf.signal.irfft(tf.where(keep, spectrum, tf.zeros_like(spectrum)), [n])
        for i in range(time_masks if time_mask else 0):
            x = tf.where(_span(n, time_mask, _fold(seed, 20 + i)), tf.zeros_like(x), x)
        return x
    return Op("spec_augment", fn, takes="waveforms")


@AUGMENTS.register("time_shift")
def time_shift(fraction: float = 0.1) -> Op:
    """Shift the waveform by up to `fraction` of its length either way (zeros fill)."""
    _fraction(fraction, "time_shift.fraction")

    def fn(x, seed):
        n = tf.shape(x)[0]
        most = tf.cast(tf.cast(n, tf.float32) * fraction, tf.int32)
        shift = tf.random.stateless_uniform([], seed, -most, most + 1, tf.int32)
        padded = tf.pad(x, [[most, most]])
        return padded[most - shift: most - shift + n]
    return Op("time_shift", fn, takes="waveforms")
