"""What every artifact's report entry measures: sizes, accuracy, logits and latency of a
loaded signature, and what the artifact takes as input."""
from __future__ import annotations

import gzip
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
from tftrain.models.rounding import layer_noise


# examples each layer's own rounding noise is measured on (an eager replay: slow)
NOISE_EXAMPLES = 256


# gzip's own default level (`gzip FILE`, web servers): level 9 took 11x as long for 0.7-4%
# fewer bytes (a VGG16's 118 MB SavedModel: 72 s against 6.4 s, 80% of its export; gzip
# sizes reported before 2026-12-07 were level 9's)
GZIP_LEVEL = 6


def gzip_size(blob: bytes) -> int:
    """The bytes of `blob` gzipped (at `GZIP_LEVEL`)."""
    return len(gzip.compress(blob, GZIP_LEVEL))


def sizes(blob: bytes) -> dict:
    """A file's bytes and its gzip size (what a download or an app bundle costs)."""
    return {"size_bytes": len(blob), "gzip_bytes": gzip_size(blob)}


def dir_bytes(path: Path) -> bytes:
    """Every file under `path`, concatenated in sorted order (a SavedModel's bytes)."""
    return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())


def accuracy(logits, y) -> float:
    """Top-1 accuracy of `logits` against integer labels `y`."""
    return float(np.mean(np.argmax(logits, axis=-1) == y))


def against(logits: np.ndarray, reference: np.ndarray) -> dict:
    """How an artifact's logits compare with the model's on the same examples: the largest
    difference, the model's largest logit (the scale float32 rounds at), the signal-to-noise ratio of the logits (dB: the model's logits against
    the artifact's departure from them, after removing each example's mean, which a
    softmax ignores), the model's own spread of logits across classes (the RMS of that
    signal) and the fraction of examples whose top class agrees."""
    diff = logits - reference
    centred = reference - reference.mean(axis=-1, keepdims=True)
    noise = diff - diff.mean(axis=-1, keepdims=True)
    signal, error = float(np.sum(centred ** 2)), float(np.sum(noise ** 2))
    sqnr = 10 * np.log10(signal / error) if error > 0 else float("inf")
    return {"max_abs_logit_diff": float(np.max(np.abs(diff))),
            "logit_scale": float(np.max(np.abs(reference))),
            "logit_sqnr_db": float(min(sqnr, 200.0)),
            "logit_spread": float(np.sqrt(signal / centred.size)),
            "top1_agreement": float(np.mean(np.argmax(logits, -1) == np.argmax(reference, -1)))}


def traced_logits(model, x: np.ndarray) -> np.ndarray:
    """`model`'s logits on `x` with the model traced as a function, as a SavedModel and
    Keras' `evaluate` run it (`against_traced`)."""
    traced = tf.function(lambda inputs: {"logits": tf.cast(model(inputs, training=False),
                                                            tf.float32)})
    return signature_logits(traced, x)


def against_traced(logits: np.ndarray, traced: np.ndarray, eager: np.ndarray) -> dict:
    """A quantization-aware trained model's SavedModel (`logits`) against the model traced
    as a function (`traced`: `traced_logits`), as the SavedModel runs it: exact where the
    file is sound. The eager model (`eager`) is no reference for it: where the traced
    graph's fused kernels round a sum otherwise (1e-7 apart), a value on an 8-bit rounding
    edge moves a whole step, and the logits after it (a smoke-trained MobileNetV2's
    SavedModel, equal to its traced model, 16.2 to 30.8 dB from the eager one). That
    distance is kept (`eager_logit_sqnr_db`)."""
    return {**against(logits, traced), "reference": "the model traced as a function",
            "eager_logit_sqnr_db": against(traced, eager)["logit_sqnr_db"]}


ROUNDING_ULPS = 4      # the input moved by this many units of float32 roundoff


def rounding_noise(call, x: np.ndarray, reference: np.ndarray, batch: int = 256) -> float:
    """The model's own logit noise: the largest change of its logits (`reference`, from
    `call` on `x`) when each input value moves by `ROUNDING_ULPS` units of float32
    roundoff, up or down at random. A trained network keeps it near float rounding; an
    untrained deep one amplifies it (an untrained EfficientNetV2B0's moved by 9e-4 on
    logits up to 6): the scale an artifact that rounds otherwise can be held to."""
    if x.dtype.kind != "f":
        return 0.0
    signs = np.random.default_rng(0).choice([-1.0, 1.0], x.shape)
    moved = (x * (1.0 + ROUNDING_ULPS * 2.0 ** -24 * signs)).astype(x.dtype)
    logits = np.concatenate([np.asarray(call(moved[i:i + batch]), np.float32)
                             for i in range(0, len(moved), batch)])
    return float(np.max(np.abs(logits - reference)))


def layer_rounding_noise(model, x: np.ndarray, reference: np.ndarray, batch: int = 64) -> float:
    """The model's own logit noise under float32 rounding at every layer
    (`models.rounding.layer_noise`): another runtime rounds at every layer, not only at
    the input (an untrained EfficientNetV2S's SavedModel was 20 times as far from the model
    as input rounding moved it)."""

    return layer_noise(model, x, reference, batch) if x.dtype.kind == "f" else 0.0


def signature_logits(signature, raw, batch: int = 64) -> np.ndarray:
    """A loaded signature's logits for every example of `raw`, `batch` at a time (the
    whole validation split in one call is gigabytes of activations for an ImageNet-sized
    model)."""
    return np.concatenate([signature(inputs=tf.constant(raw[i:i + batch]))["logits"].numpy()
                           for i in range(0, len(raw), batch)])


def signature_latency(signature, raw, examples: int = 100) -> float:
    """Seconds per example of a loaded signature called on one example at a time."""
    rows = [tf.constant(raw[i:i + 1]) for i in range(min(examples, len(raw)))]
    signature(inputs=rows[0])
    start = time.perf_counter()
    for row in rows:
        signature(inputs=row)
    return (time.perf_counter() - start) / max(len(rows), 1)


def input_kind(plain, serving) -> str:
    """What an artifact takes, for the report (e.g. "raw strings", "int32 [256]")."""
    if serving is not None:
        return serving.kind
    return f"{plain.inputs[0].dtype.name} {list(plain.input_shape[1:])}"
