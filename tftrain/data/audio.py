"""`audio_folder`: WAV files in one sub-folder per class, streamed from disk.

Every file's header is read once at start (a bad file is named before anything is
written); each example is read, decoded, mixed to mono, resampled to `sample_rate`
when its file has another rate, and cropped or zero-padded to `duration` seconds (both
centred) in a parallel `map` when its slot comes. Resampling is band-limited (the
spectrum is truncated or zero-extended, as `scipy.signal.resample` does), so
downsampling does not alias.

Validation holds out whole speakers: a file's group is the first capture group of
`group` matched against its name (default: the Speech Commands convention
`<speaker>_nohash_<n>.wav`), and groups, drawn in a seeded order, go to validation
until it holds `data.validation_fraction` of the files.
"""
from __future__ import annotations

import re
import wave
from pathlib import Path
from typing import Optional

import numpy as np
import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.data.source import DATASETS, IndexedSource, InputSpec, existing

SPEECH_COMMANDS_GROUP = r"^(.+?)_nohash_"


def _header(path: Path) -> tuple[int, int, int]:
    """(sample rate, channels, frames) of a PCM WAV file; ValueError when it is not one."""
    try:
        with wave.open(str(path)) as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"{8 * w.getsampwidth()}-bit samples (16-bit PCM is read)")
            return w.getframerate(), w.getnchannels(), w.getnframes()
    except (wave.Error, EOFError) as err:
        raise ValueError(str(err) or "truncated") from None


def list_audio(root: Path, on_bad_record: str):
    """(files, labels, rates, classes, skipped) of root/<class>/<file>.wav."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise ConfigError(f"data.params.path: {root} has no class sub-folders (expected "
                          "root/<class>/<file>.wav)")
    files, labels, rates, skipped = [], [], [], 0
    for label, name in enumerate(classes):
        found = sorted((root / name).glob("*.wav")) + sorted((root / name).glob("*.WAV"))
        if not found:
            raise ConfigError(f"data.params.path: class folder {root / name} has no .wav files; "
                              "remove it or add recordings")
        for f in found:
            try:
                rate, _, frames = _header(f)
                if frames == 0:
                    raise ValueError("no samples")
            except ValueError as err:
                if on_bad_record == "fail":
                    raise ConfigError(f"data: {f} is not a readable 16-bit PCM WAV file ({err}); "
                                      "convert or remove it, or set data.on_bad_record: skip") from None
                skipped += 1
                continue
            files.append(str(f))
            labels.append(label)
            rates.append(rate)
    return files, np.array(labels, np.int32), np.array(rates, np.int32), classes, skipped


def target_rate(files, rates, sample_rate: Optional[int]) -> int:
    """The rate examples are served at: `sample_rate`, or the files' one rate."""
    if sample_rate is not None:
        if sample_rate < 1000:
            raise ConfigError(f"data.params.sample_rate: {sample_rate} Hz; expected samples per "
                              "second, e.g. 16000")
        return int(sample_rate)
    distinct = sorted(set(rates.tolist()))
    if len(distinct) > 1:
        a = files[int(np.argmax(rates == distinct[0]))]
        b = files[int(np.argmax(rates == distinct[1]))]
        raise ConfigError(f"data: the WAV files have different sample rates ({distinct[0]} Hz in "
                          f"{a}, {distinct[1]} Hz in {b}); set data.params.sample_rate to "
                          "resample them all to one rate")
    return distinct[0]


def group_split(files, fraction: float, seed: int, pattern: str):
    """(train, validation) indices holding whole groups out (see the module docstring)."""
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise ConfigError(f"data.params.group: {pattern!r} is not a regular expression ({err})") from None
    groups = []
    for f in files:
        m = regex.search(Path(f).name)
        groups.append(m.group(1) if m and m.groups() else (m.group(0) if m else Path(f).stem))
    names = sorted(set(groups))
    order = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    held, count, want = set(), 0, int(round(len(files) * fraction))
    by_group = {g: groups.count(g) for g in names}
    for g in order:
        if count >= want:
            break
        held.add(g)
        count += by_group[g]
    val = np.array([i for i, g in enumerate(groups) if g in held], np.int64)
    train = np.array([i for i, g in enumerate(groups) if g not in held], np.int64)
    rng = np.random.default_rng(seed + 1)
    return rng.permutation(train), val, len(held), len(names)


def resample(x, rate_in, rate_out: int):
    """Band-limited resampling of a 1-D float waveform from `rate_in` to `rate_out`."""
    n = tf.shape(x)[0]
    m = tf.cast(tf.math.ceil(tf.cast(n, tf.float64) * rate_out / tf.cast(rate_in, tf.float64)),
                tf.int32)

    def change():
        spectrum = tf.signal.rfft(x)
        bins = m // 2 + 1
        have = tf.shape(spectrum)[0]
        kept = spectrum[:tf.minimum(bins, have)]
        kept = tf.pad(kept, [[0, tf.maximum(bins - have, 0)]])
        return tf.signal.irfft(kept, [m]) * (tf.cast(m, tf.float32) / tf.cast(n, tf.float32))

    return tf.cond(tf.equal(rate_in, rate_out), lambda: x, change)


def fit_length(x, length: int):
    """Centre-crop or zero-pad a 1-D waveform to `length` samples."""
    n = tf.shape(x)[0]
    start = tf.maximum((n - length) // 2, 0)
    x = x[start:start + length]
    short = length - tf.shape(x)[0]
    x = tf.pad(x, [[short // 2, short - short // 2]])
    return tf.ensure_shape(x, [length])


def load_wav(path, rate_in, rate_out: int, length: int):
    """A WAV file -> float32 mono waveform of `length` samples at `rate_out`."""
    audio, _ = tf.audio.decode_wav(tf.io.read_file(path))
    mono = tf.reduce_mean(audio, axis=-1)
    return fit_length(resample(mono, rate_in, rate_out), length)


@DATASETS.register("audio_folder")
def audio_folder(fraction: float, seed: int, path: str = "", sample_rate: Optional[int] = None,
                 duration: float = 1.0, group: str = SPEECH_COMMANDS_GROUP,
                 on_bad_record: str = "fail") -> IndexedSource:
    """16-bit PCM WAV files in one sub-folder per class, resampled to `sample_rate` and
    cropped/padded to `duration` seconds; validation holds out whole speakers (`group`)."""
    root = existing(path, "data.params.path")
    files, labels, rates, classes, skipped = list_audio(root, on_bad_record)
    if skipped:
        print(f"data: skipped {skipped} files that are not readable WAV (data.on_bad_record: skip)")
    rate = target_rate(files, rates, sample_rate)
    if duration <= 0:
        raise ConfigError(f"data.params.duration: {duration}; expected seconds > 0, e.g. 1.0")
    length = int(round(duration * rate))
    train, val, held, total = group_split(files, fraction, seed, group)
    names = np.array(files)
    train_files, train_rates = tf.constant(names[train]), tf.constant(rates[train])
    train_labels = tf.constant(labels[train])

    def load(i):
        return load_wav(train_files[i], train_rates[i], rate, length), train_labels[i]

    val_ds = tf.data.Dataset.from_tensor_slices((names[val], rates[val], labels[val])).map(
        lambda f, r, y: (load_wav(f, r, rate, length), y),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    spec = InputSpec((length,), "float32", len(classes), sample_rate=rate)
    kind = (f"{len(files)} WAV files under {root} at {rate} Hz, {duration:g} s; validation "
            f"holds out {held} of {total} speakers")
    return IndexedSource(spec, len(train), len(val), load, val_ds, kind=kind, elementwise=True,
                         decoded_bytes=len(train) * length * 4)
