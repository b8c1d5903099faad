"""Augmentation and preprocessing as config, on the host, seeded statelessly.

`data.augment` is a list of `{name: params}` (or bare names), applied in order. Every
random draw is a stateless function of the example's seed, itself a function of (run
seed, epoch, position in the epoch), so a resumed run sees the very batches the
interrupted one would have. Validation gets only the deterministic steps (`normalize`,
`center_crop`). `mixup` and `cutmix` act on batches and turn labels into class
probabilities (the loss then takes soft labels).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import tensorflow as tf

from tftrain.config import ConfigError
from tftrain.core.registry import Registry, check_params
from tftrain.core.registry import import_function


@dataclass(frozen=True)
class Op:
    name: str
    fn: Callable                 # (x, seed) -> x ; batch ops: (x, y, w, seed) -> (x, y, w)
    batch: bool = False
    deterministic: bool = False  # also applied to validation and export inputs
    takes: str = "images"        # what its examples must be: images, waveforms or any (float)


TAKES = {"images": (3, "images (height, width, channels)"), "waveforms": (1, "waveforms (samples)")}


def check(ops: list[Op], shape: tuple, dtype: str) -> None:
    """At plan time: every op can take the source's examples (a ConfigError naming the
    entry otherwise): no float augmentation of token ids, no image op on a waveform."""
    for i, op in enumerate(ops):
        if not str(dtype).startswith(("float", "bfloat")):
            raise ConfigError(f"data.augment[{i}]: {op.name} changes float inputs, and the data "
                              f"gives {dtype} examples of shape {tuple(shape)} (e.g. token ids); "
                              "remove it from data.augment")
        if op.takes in TAKES and len(shape) != TAKES[op.takes][0]:
            raise ConfigError(f"data.augment[{i}]: {op.name} works on {TAKES[op.takes][1]}, and "
                              f"the data gives examples of shape {tuple(shape)}; remove it or "
                              "use an augmentation made for these inputs")


AUGMENTS: Registry[Callable[..., Op]] = Registry("augmentation", "data.augment")


def _fold(seed, i: int):
    return tf.random.experimental.stateless_fold_in(seed, i)


def _uniform(seed, lo, hi, shape=()):
    return tf.random.stateless_uniform(shape, seed, lo, hi)


@AUGMENTS.register("random_crop")
def random_crop(padding: int = 4, mode: str = "constant") -> Op:
    """Pad by `padding` pixels (constant zeros or reflect), crop back to the size."""
    def fn(x, seed):
        padded = tf.pad(x, [[padding, padding], [padding, padding], [0, 0]],
                        mode="REFLECT" if mode == "reflect" else "CONSTANT")
        return tf.image.stateless_random_crop(padded, tf.shape(x), seed)
    return Op("random_crop", fn)


@AUGMENTS.register("random_flip")
def random_flip(mode: str = "horizontal") -> Op:
    """Flip left-right (`horizontal`), up-down (`vertical`) or both at random."""
    if mode not in ("horizontal", "vertical", "both"):
        raise ConfigError(f"data.augment.random_flip: mode {mode!r}; expected horizontal, "
                          "vertical or both")

    def fn(x, seed):
        if mode in ("horizontal", "both"):
            x = tf.image.stateless_random_flip_left_right(x, _fold(seed, 1))
        if mode in ("vertical", "both"):
            x = tf.image.stateless_random_flip_up_down(x, _fold(seed, 2))
        return x
    return Op("random_flip", fn)


@AUGMENTS.register("random_resized_crop")
def random_resized_crop(scale: tuple = (0.08, 1.0), ratio: tuple = (3 / 4, 4 / 3)) -> Op:
    """Crop a random area fraction in `scale` with aspect ratio in `ratio`, resize back."""
    def fn(x, seed):
        size = tf.shape(x)[:2]
        begin, extent, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.shape(x), tf.zeros([1, 0, 4]), seed, min_object_covered=0.0,
            aspect_ratio_range=ratio, area_range=scale, max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        crop = tf.slice(x, begin, extent)
        return tf.cast(tf.image.resize(crop, size), x.dtype)
    return Op("random_resized_crop", fn)


def _affine(rotation: float, zoom: float, translation: float, fill: str):
    """A random rotation (fraction of a full turn), zoom and translation (fractions of
    the size) about the centre, as one projective transform."""
    def fn(x, seed):
        h, w = tf.cast(tf.shape(x)[0], tf.float32), tf.cast(tf.shape(x)[1], tf.float32)
        angle = _uniform(_fold(seed, 1), -rotation, rotation) * 2 * math.pi
        scale = 1.0 + _uniform(_fold(seed, 2), -zoom, zoom)
        dx = _uniform(_fold(seed, 3), -translation, translation) * w
        dy = _uniform(_fold(seed, 4), -translation, translation) * h
        cos, sin = tf.cos(angle) * scale, tf.sin(angle) * scale
        cx, cy = (w - 1) / 2, (h - 1) / 2
        # output (x, y) samples input (a0 x + a1 y + a2, b0 x + b1 y + b2)
        transform = tf.stack([cos, -sin, cx - cos * cx + sin * cy - dx,
                              sin, cos, cy - sin * cx - cos * cy - dy, 0.0, 0.0])
        out = tf.raw_ops.ImageProjectiveTransformV3(
            images=x[None], transforms=transform[None], output_shape=tf.shape(x)[:2],
            fill_value=0.0, interpolation="BILINEAR", fill_mode=fill.upper())
        return out[0]
    return fn


@AUGMENTS.register("random_affine")
def random_affine(rotation: float = 0.0, zoom: float = 0.0, translation: float = 0.0,
                  fill: str = "reflect") -> Op:
    """Rotation (fraction of 2 pi), zoom and translation (fractions) drawn together."""
    return Op("random_affine", _affine(rotation, zoom, translation, fill))


@AUGMENTS.register("random_rotation")
def random_rotation(factor: float = 0.05, fill: str = "reflect") -> Op:
    return Op("random_rotation", _affine(factor, 0.0, 0.0, fill))


@AUGMENTS.register("random_zoom")
def random_zoom(factor: float = 0.1, fill: str = "reflect") -> Op:
    return Op("random_zoom", _affine(0.0, factor, 0.0, fill))


@AUGMENTS.register("random_translation")
def random_translation(factor: float = 0.1, fill: str = "reflect") -> Op:
    return Op("random_translation", _affine(0.0, 0.0, factor, fill))


@AUGMENTS.register("color_jitter")
def color_jitter(brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0,
                 hue: float = 0.0) -> Op:
    """Random brightness (added), contrast and saturation (factors 1 +- x) and hue."""
    def fn(x, seed):
        if brightness:
            x = tf.image.stateless_random_brightness(x, brightness, _fold(seed, 1))
        if contrast:
            x = tf.image.stateless_random_contrast(x, 1 - contrast, 1 + contrast, _fold(seed, 2))
        if saturation:
            x = tf.image.stateless_random_saturation(x, 1 - saturation, 1 + saturation, _fold(seed, 3))
        if hue:
            x = tf.image.stateless_random_hue(x, hue, _fold(seed, 4))
        return tf.clip_by_value(x, 0.0, 1.0)
    return Op("color_jitter", fn)


@AUGMENTS.register("cutout")
def cutout(size: int = 8) -> Op:
    """Zero a `size` x `size` square at a random centre (clipped at the borders)."""
    def fn(x, seed):
        h, w = tf.shape(x)[0], tf.shape(x)[1]
        cy = tf.random.stateless_uniform([], seed, 0, h, tf.int32)
        cx = tf.random.stateless_uniform([], _fold(seed, 1), 0, w, tf.int32)
        ys, xs = tf.range(h)[:, None], tf.range(w)[None, :]
        inside = ((ys >= cy - size // 2) & (ys < cy - size // 2 + size) &
                  (xs >= cx - size // 2) & (xs < cx - size // 2 + size))
        return tf.where(inside[..., None], tf.zeros_like(x), x)
    return Op("cutout", fn)


@AUGMENTS.register("normalize")
def normalize(mean: Any = 0.0, std: Any = 1.0) -> Op:
    """(x - mean) / std per channel (deterministic: validation and exports get it too)."""
    if min(std if isinstance(std, (list, tuple)) else [std]) <= 0:
        raise ConfigError("data.augment.normalize.std: must be > 0")
    return Op("normalize", lambda x, seed=None: (x - mean) / std, deterministic=True, takes="any")


@AUGMENTS.register("center_crop")
def center_crop(fraction: float = 0.875) -> Op:
    """Keep the central `fraction` of each side, resize back (train and validation)."""
    def fn(x, seed=None):
        return tf.cast(tf.image.resize(tf.image.central_crop(x, fraction), tf.shape(x)[:2]), x.dtype)
    return Op("center_crop", fn, deterministic=True)


def _mix(alpha: float, seed):
    """lambda ~ Beta(alpha, alpha), from two stateless gammas."""
    a = tf.random.stateless_gamma([], _fold(seed, 1), alpha)
    b = tf.random.stateless_gamma([], _fold(seed, 2), alpha)
    return a / (a + b)


def _partner(w):
    """Mix each example with the next one of the batch (a padding slot is not mixed)."""
    return tf.roll(tf.range(tf.shape(w)[0]), -1, 0)


@AUGMENTS.register("mixup")
def mixup(alpha: float = 0.2) -> Op:
    """Convex combination of example pairs and of their one-hot labels."""
    def fn(x, y, w, seed):
        lam = _mix(alpha, seed)
        j = _partner(w)
        lam = tf.where(tf.gather(w, j) > 0, lam, 1.0)[:, None]
        xs = lam[..., None, None] if len(x.shape) == 4 else lam
        return xs * x + (1 - xs) * tf.gather(x, j), lam * y + (1 - lam) * tf.gather(y, j), w
    return Op("mixup", fn, batch=True, takes="any")


@AUGMENTS.register("cutmix")
def cutmix(alpha: float = 1.0) -> Op:
    """Paste a random box of the partner image; labels mixed by the box's area."""
    def fn(x, y, w, seed):
        lam = _mix(alpha, seed)
        h, wd = tf.shape(x)[1], tf.shape(x)[2]
        cut = tf.sqrt(1.0 - lam)
        bh = tf.cast(cut * tf.cast(h, tf.float32), tf.int32)
        bw = tf.cast(cut * tf.cast(wd, tf.float32), tf.int32)
        cy = tf.random.stateless_uniform([], _fold(seed, 3), 0, h, tf.int32)
        cx = tf.random.stateless_uniform([], _fold(seed, 4), 0, wd, tf.int32)
        y0, y1 = tf.maximum(cy - bh // 2, 0), tf.minimum(cy - bh // 2 + bh, h)
        x0, x1 = tf.maximum(cx - bw // 2, 0), tf.minimum(cx - bw // 2 + bw, wd)
        ys, xs = tf.range(h)[:, None], tf.range(wd)[None, :]
        box = tf.cast((ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1), x.dtype)[None, ..., None]
        j = _partner(w)
        real = tf.cast(tf.gather(w, j) > 0, x.dtype)[:, None, None, None]
        box = box * real
        area = tf.cast((y1 - y0) * (x1 - x0), tf.float32) / tf.cast(h * wd, tf.float32)
        share = area * real[:, 0, 0, :]
        return x * (1 - box) + tf.gather(x, j) * box, (1 - share) * y + share * tf.gather(y, j), w
    return Op("cutmix", fn, batch=True)


def build(entries) -> list[Op]:
    """Ops of `data.augment` (ConfigError naming the entry when one is wrong)."""
    ops = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            name, params = entry, {}
        elif isinstance(entry, dict) and len(entry) == 1:
            name, params = next(iter(entry.items()))
        else:
            raise ConfigError(f"data.augment[{i}]: {entry!r}; expected a name or a one-key "
                              "mapping like {random_crop: {padding: 4}}")
        if ":" in str(name):                # the user's own: package.module:function
            ops.append(_imported(name, params, f"data.augment[{i}]"))
            continue
        maker = AUGMENTS.get(name)
        if not isinstance(params, dict):     # the main parameter alone: {random_flip: horizontal}
            first = next(iter(inspect.signature(maker).parameters))
            params = {first: params}
        check_params(maker, params, f"data.augment[{i}].{name}")
        ops.append(maker(**params))
    return ops


def _imported(name: str, params, key: str) -> Op:
    """An augmentation of the user's, `package.module:function`: `function(x, seed,
    **params) -> x` on one float example (`seed`: a stateless seed of shape (2,), a
    function of the run's seed and the example's place, so resumes replay it), applied to
    training examples only."""

    fn = import_function(name, key)
    params = params if isinstance(params, dict) else {}
    check_params(fn, params, f"{key}.{name}", skip=2)
    return Op(name, lambda x, seed: fn(x, seed, **params), takes="any")


def soft_labels(ops) -> bool:
    return any(op.batch for op in ops)
