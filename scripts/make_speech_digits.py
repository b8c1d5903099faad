"""Spoken digits synthesized with espeak-ng: one folder per digit of WAV files.

Each voice is an accent (espeak-ng language variant) with a voice variant (m1, f3, ...);
every voice says each digit at a few speeds and pitches, and noise is added at a random
signal-to-noise ratio. Files are named `<voice>_nohash_<n>.wav` (the Speech Commands
convention), so `audio_folder` can hold whole voices out for validation. Files are
written at espeak-ng's 22,050 Hz; the recipe resamples them to 16 kHz.

    python scripts/make_speech_digits.py --out data/speech_digits [--voices 96] [--takes 2]

Needs the `espeak-ng` Debian package (`apt-get install espeak-ng`).
"""
from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
ACCENTS = ["en", "en-us", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan",
           "en-gb-x-gbcwmd", "en-029", "en-us-nyc"]
VARIANTS = ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5"]


def voices(n: int) -> list[str]:
    """The first n accent+variant voices, variants cycling fastest across accents."""
    all_voices = [f"{a}+{v}" for v in VARIANTS for a in ACCENTS]
    return all_voices[:n]


def synthesize(voice: str, word: str, speed: int, pitch: int) -> tuple[np.ndarray, int]:
    out = subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch),
                          "--stdout", word], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(out)) as w:
        rate = w.getframerate()
        # espeak-ng's streamed header leaves the length unset: read what is there
        frames = w.readframes(w.getnframes() or 1 << 30)
    return np.frombuffer(frames, np.int16).astype(np.float32) / 32768.0, rate


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())


def make(out: Path, n_voices: int = 96, takes: int = 2, seed: int = 0) -> int:
    if shutil.which("espeak-ng") is None:
        sys.exit("make_speech_digits: espeak-ng is not installed; apt-get install espeak-ng")
    rng = np.random.default_rng(seed)
    jobs = []
    for voice in voices(n_voices):
        name = voice.replace("+", "-")
        for digit, word in enumerate(WORDS):
            for take in range(takes):
                speed = int(rng.integers(110, 200))
                pitch = int(rng.integers(20, 80))
                snr_db = float(rng.uniform(10, 30))
                noise_seed = int(rng.integers(1 << 31))
                jobs.append((out / str(digit) / f"{name}_nohash_{take}.wav", voice, word, speed,
                             pitch, snr_db, noise_seed))
    for digit in range(len(WORDS)):
        (out / str(digit)).mkdir(parents=True, exist_ok=True)

    def run(job):
        path, voice, word, speed, pitch, snr_db, noise_seed = job
        samples, rate = synthesize(voice, word, speed, pitch)
        power = np.mean(samples ** 2) + 1e-12
        noise = np.random.default_rng(noise_seed).normal(size=samples.shape)
        samples = samples + noise * np.sqrt(power / 10 ** (snr_db / 10))
        write_wav(path, samples, rate)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, jobs))
    return len(jobs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--voices", type=int, default=96, help=f"at most {len(ACCENTS) * len(VARIANTS)}")
    parser.add_argument("--takes", type=int, default=2, help="recordings per voice and digit")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n = make(args.out, args.voices, args.takes, args.seed)
    print(f"wrote {n} WAV files under {args.out}")


if __name__ == "__main__":
    main()
