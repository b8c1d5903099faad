"""`audio_folder` (decoding, resampling, cropping, speaker hold-out, bad files) and the
waveform augmentations."""
import wave

import numpy as np
import pytest
import tensorflow as tf

from tftrain.config import ConfigError, load_config
from tftrain.data import load_source
from tftrain.data.audio import fit_length, group_split, resample
from tftrain.data.augment import build
from tftrain.run import main

from helpers import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TONES = {"hi": 1000.0, "lo": 440.0}


def write_wav(path, samples, rate):
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())


def make_tones(root, speakers=5, rates=(8000, 22050)):
    """One tone per class, said by each speaker at alternating rates and lengths."""
    for name, hz in TONES.items():
        for s in range(speakers):
            rate = rates[s % len(rates)]
            seconds = 0.5 if s % 2 else 1.5
            t = np.arange(int(rate * seconds)) / rate
            write_wav(root / name / f"spk{s}_nohash_0.wav", 0.5 * np.sin(2 * np.pi * hz * t), rate)
    return root


def cfg(path, *sets):
    return load_config(None, ["data.name=audio_folder", f"data.params={{path: {path}}}", *sets])


def test_audio_folder_resamples_crops_and_keeps_the_tone(tmp_path):
    root = make_tones(tmp_path / "audio")
    source = load_source(cfg(root, "data.params.sample_rate=16000", "data.validation_fraction=0.4").data, 0)
    assert source.spec.shape == (16000,) and source.spec.sample_rate == 16000
    assert source.num_train + source.num_val == 10 and source.num_val == 4   # 2 speakers x 2 classes
    examples = list(source.validation()) + [source.load(tf.constant(i)) for i in range(source.num_train)]
    for x, y in examples:
        x = x.numpy()
        assert x.shape == (16000,)
        voiced = np.flatnonzero(np.abs(x) > 1e-3)
        segment = x[voiced[0]:voiced[-1] + 1]
        peak = np.argmax(np.abs(np.fft.rfft(segment))) * 16000 / len(segment)
        expected = TONES[sorted(TONES)[int(y)]]
        assert abs(peak - expected) < 5, (peak, expected)
        assert abs(np.median(np.abs(x[voiced])) - 0.5 * np.sqrt(0.5)) < 0.03   # amplitude kept


def test_group_split_holds_out_whole_speakers():
    files = [f"/d/{c}/spk{s}_nohash_{k}.wav" for c in "ab" for s in range(10) for k in range(3)]
    train, val, held, total = group_split(files, 0.2, 3, r"^(.+?)_nohash_")
    speakers = lambda idx: {files[i].split("/")[-1].split("_")[0] for i in idx}  # noqa: E731
    assert total == 10 and held == 2 and len(val) == 12
    assert not speakers(train) & speakers(val)
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(files)))
    assert group_split(files, 0.2, 3, r"^(.+?)_nohash_")[1].tolist() == val.tolist()   # seeded


def test_resample_and_fit_length():
    x = tf.constant(np.sin(2 * np.pi * 100 * np.arange(22050) / 22050), tf.float32)
    y = resample(x, tf.constant(22050), 16000).numpy()
    assert len(y) == 16000
    np.testing.assert_allclose(y[100:-100], np.sin(2 * np.pi * 100 * np.arange(16000) / 16000)[100:-100],
                               atol=2e-3)
    assert resample(x, tf.constant(16000), 16000) is not None
    np.testing.assert_array_equal(fit_length(tf.range(10.0), 4).numpy(), [3, 4, 5, 6])
    np.testing.assert_array_equal(fit_length(tf.range(1.0, 3.0), 6).numpy(), [0, 0, 1, 2, 0, 0])


def _bad(root, case):
    make_tones(root, rates=(16000,) if case != "mixed" else (8000, 16000))
    if case == "empty":
        (root / "silence").mkdir()
    if case == "unreadable":
        (root / "hi" / "broken_nohash_0.wav").write_bytes(b"RIFF....not a wav file")


@pytest.mark.parametrize("case,pattern", [
    ("empty", r"class folder .*silence has no \.wav files"),
    ("unreadable", r"data: .*hi/broken_nohash_0\.wav is not a readable 16-bit PCM WAV file"),
    ("mixed", r"different sample rates \(8000 Hz in .*\.wav, 16000 Hz in .*\.wav\); set "
              r"data\.params\.sample_rate"),
])
def test_bad_audio_exits_2_naming_the_file(tmp_path, capsys, case, pattern):
    root = tmp_path / "audio"
    _bad(root, case)
    runs = tmp_path / "runs"
    sets = ["data.name=audio_folder", f"data.params={{path: {root}}}", "model={name: ds_cnn}"]
    assert main([str(QUICKSTART), "--run-dir", str(runs), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(pattern, err), err
    assert "Traceback" not in err and not runs.exists()


def test_unreadable_wav_is_skipped_when_asked(tmp_path):
    root = tmp_path / "audio"
    _bad(root, "unreadable")
    source = load_source(cfg(root, "data.on_bad_record=skip", "data.validation_fraction=0").data, 0)
    assert source.num_train == 10


def test_spec_augment_and_time_shift_are_seeded_and_mask_what_they_say():
    x = tf.constant(np.random.default_rng(0).normal(size=4000), tf.float32)
    (masks,) = build([{"spec_augment": {"time_masks": 1, "time_mask": 0.2, "freq_masks": 0}}])
    seed = tf.constant([1, 2], tf.int64)
    a, b = masks.fn(x, seed).numpy(), masks.fn(x, seed).numpy()
    np.testing.assert_array_equal(a, b)
    zeroed = np.flatnonzero(a == 0)
    assert len(zeroed) <= 800 and (len(zeroed) == 0 or np.all(np.diff(zeroed) == 1))
    np.testing.assert_array_equal(a[a != 0], x.numpy()[a != 0])
    (band,) = build([{"spec_augment": {"time_masks": 0, "freq_masks": 1, "freq_mask": 0.3}}])
    seeds = [tf.constant([s, 0], tf.int64) for s in range(5)]
    spectra = [np.abs(np.fft.rfft(band.fn(x, s).numpy())) for s in seeds]
    removed = [np.flatnonzero(s < 1e-3) for s in spectra]
    assert any(len(r) > 50 for r in removed)                      # a band is gone
    assert all(len(r) <= 0.3 * 2001 + 1 for r in removed)
    assert len({tuple(r) for r in removed}) > 1                   # different per seed
    (shift,) = build([{"time_shift": {"fraction": 0.1}}])
    shifted = shift.fn(x, seed).numpy()
    lag = [k for k in range(-400, 401) if np.allclose(np.roll(x.numpy(), k)[400:-400], shifted[400:-400])]
    assert len(lag) == 1


def test_augment_params_are_checked():
    with pytest.raises(ConfigError, match=r"spec_augment\.time_mask: 1\.5; expected a fraction"):
        build([{"spec_augment": {"time_mask": 1.5}}])
