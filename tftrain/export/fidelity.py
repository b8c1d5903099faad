"""Where an int8 artifact departs from the model it was made from, layer by layer.

For every Keras layer whose output the artifact holds as a tensor, the SQNR (signal to
quantization-noise ratio, dB) and the largest absolute difference between the in-memory
model's output of that layer (a QAT model's fake-quantized values, or a float model's)
and the artifact's tensor, dequantized, on calibration examples. The errors accumulate
through the network, as they do when it runs (`sqnr_db`); `local_sqnr_db` is the error
a layer adds to what the artifact fed it, which names the layer that introduced an error
rather than the ones downstream that carry it.

What the file holds, by layer, is read by `file_tensors`; a layer computing with a
kernel that no compared tensor holds is named (`uncompared`): a comparison that missed
it says nothing of it.
"""
from __future__ import annotations

import math

import numpy as np

from tftrain.core import console, internals
from tftrain.core.keras import keras
from tftrain.export.file_tensors import bounded, float_ops, label, tflite_tensors
from tftrain.export.layer_noise import floor as layer_floor, rounding_limited, too_noisy, why_noisy
from tftrain.models.rounding import replay

CAP_DB = 99.0        # an exact tensor (no noise) is reported at this SQNR


def sqnr_db(reference: np.ndarray, value: np.ndarray) -> float:
    """10 log10(signal power / noise power), capped at `CAP_DB` (exact, or no signal)."""
    signal = float(np.sum(np.square(reference, dtype=np.float64)))
    noise = float(np.sum(np.square(value.astype(np.float64) - reference)))
    if noise <= signal * 10 ** (-CAP_DB / 10):
        return CAP_DB
    return max(-CAP_DB, 10 * math.log10(signal / noise)) if signal > 0 else -CAP_DB


def keras_outputs(model, names: list[str], x: np.ndarray, batch: int = 64) -> dict:
    """Each named layer's output of `model` on `x`, in inference mode."""

    probe = keras.Model(model.inputs, [output(model, model.get_layer(n)) for n in names])
    found = [probe(x[i:i + batch], training=False) for i in range(0, len(x), batch)]
    found = [found_batch if isinstance(found_batch, (list, tuple)) else [found_batch]
             for found_batch in found]
    return {n: np.concatenate([np.asarray(b[i]) for b in found]) for i, n in enumerate(names)}


def compare(model, artifact: dict[str, dict], x: np.ndarray) -> list[dict]:
    """Per layer the artifact holds a tensor of (in model order): `sqnr_db` and
    `max_abs_diff` of that tensor against `model`'s output of the layer, the error as it
    has accumulated from the input; and `local_sqnr_db`, against what `model`'s layer
    computes from the artifact's own values of its inputs (where the artifact has no
    tensor of an input, e.g. a convolution fused into its ReLU, from what `model`
    computes of it from the artifact's values before it): the error this layer adds,
    which names the layer that went wrong rather than the ones downstream that carry it.

    The model's graph is replayed node by node as Keras runs a functional model (each
    layer called with its own arguments), an artifact's value standing in for a layer's
    output wherever the artifact has one."""
    artifact = fused_forward(model, artifact)
    names = [layer.name for layer in model.layers if layer.name in artifact]
    reference = keras_outputs(model, names, x)
    found_rows = {}
    rng = np.random.default_rng(0)

    makers: list = []

    def dithered(maker, value):       # moved within the 8-bit step the file holds it to
        makers.append(maker)
        step = artifact.get(maker, {}).get("step")
        return value + rng.uniform(-0.5, 0.5, value.shape).astype(value.dtype) * step \
            if step else value

    def substitute(name, local, again):
        value, row = _substituted(name, local, artifact, reference)
        if row is not None:
            if "step" in artifact[name]:
                makers.clear()
                row["allowed_sqnr_db"] = _allowed(local, again(dithered), artifact[name])
                # how far the file's inputs of the layer already are from the model's
                inputs = [found_rows[m]["sqnr_db"] for m in makers if m in found_rows]
                if inputs:
                    row["input_sqnr_db"] = min(inputs)
            if "saturated" in artifact[name]:
                row["saturated"] = round(artifact[name]["saturated"], 4)
                row["tensors"] = artifact[name]["tensors"]
            found_rows[name] = row
        return value
    replay(model, x, substitute, again=True)
    return [found_rows[layer.name] for layer in model.layers if layer.name in found_rows]


# a layer computing with one of these weights must have its computation in a compared
# tensor of the file (through tfmot's wrapper)
_WEIGHTED = ("kernel", "depthwise_kernel", "embeddings")


def uncompared(model, artifact: dict[str, dict], rows: list[dict]) -> list[str]:
    """The layers of `model` computing with a kernel or an embedding whose computation no
    compared tensor of the artifact holds: neither named after them, nor computing them
    fused (its name mentions them), nor fused into their only reader without a tensor of
    their own (a convolution whose bias took a constant added after it: the file names
    the sum); a layer the comparison did not see, of which it cannot say anything."""
    moved = fused_forward(model, artifact)
    seen = set()
    for row in rows:
        seen |= set(moved.get(row["layer"], {}).get("covers", ())) | {row["layer"]}
    layers = set(model.layers)

    def compared(layer, depth: int = 0) -> bool:
        if layer.name in seen:
            return True
        # the layers reading it (a layer called again, in a model built on the same layers
        # to read their outputs, has a node more per call: one reader, counted once)
        readers = list({id(node.layer): node.layer for node in internals.outbound_nodes(layer)
                        if node.layer in layers}.values())
        return (layer.name not in moved and len(readers) == 1 and depth < len(layers)
                and compared(readers[0], depth + 1))
    return [layer.name for layer in model.layers if not compared(layer) and computes_with_weights(layer)]


def computes_with_weights(layer) -> bool:
    """Whether a layer multiplies by weights of its own: a kernel, a depthwise kernel or an
    embedding, on it or on one of its sublayers (attention's projections, a nested model's
    layers; through tfmot's wrapper)."""
    inner = getattr(layer, "layer", layer)
    return any(hasattr(part, weight) for part in (inner, *inner.submodules)
               for weight in _WEIGHTED)


# what a TFLite convolution or fully connected op computes besides its own layer: a
# following batch norm (folded into its weights) and ReLU-like activation (fused)
_FOLDS_INTO = ("Conv1D", "Conv2D", "DepthwiseConv2D", "Dense")
_FOLDED = ("BatchNormalization", "ReLU")
_FUSED_ACTIVATIONS = ("relu", "relu6")


def _kind(layer) -> str:
    return type(getattr(layer, "layer", layer)).__name__     # through tfmot's wrapper


def _foldable(layer) -> bool:
    inner = getattr(layer, "layer", layer)
    kind = type(inner).__name__
    return kind in _FOLDED or (kind == "Activation" and getattr(
        inner.activation, "__name__", "") in _FUSED_ACTIVATIONS)


def fused_forward(model, artifact: dict) -> dict:
    """`artifact` with a convolution's or dense layer's tensor moved to the last layer of
    the batch norm and activation after it that the file has no tensor of: the converter
    folds them into the op and names its output after the convolution alone (a bias-free
    Conv -> BatchNorm -> ReLU, as Keras Applications write them, is one CONV_2D named
    `.../Conv/Conv2D`), whose value is the activation's, not the convolution's."""
    moved = dict(artifact)
    for layer in model.layers:
        if layer.name not in moved or _kind(layer) not in _FOLDS_INTO:
            continue
        found, current = moved.pop(layer.name), layer
        while True:
            consumers = [node.layer for node in internals.outbound_nodes(current)
                         if node.layer in model.layers]
            if len(consumers) != 1 or consumers[0].name in moved or not _foldable(consumers[0]):
                break
            current = consumers[0]
        moved[current.name] = found
    return moved


def _substituted(name: str, local: np.ndarray, artifact: dict, reference: dict):
    """(the value downstream layers get: the artifact's where it has one, else `local`;
    the layer's row, or None)."""
    found = artifact.get(name)
    if found is None or found["value"].size != local.size:
        return local, None
    got = found["value"]                # maps come as NHWC (`onnx_fidelity`)
    if got.ndim == 4 and got.shape != local.shape and \
            got.transpose(0, 2, 3, 1).shape == local.shape:
        got = got.transpose(0, 2, 3, 1)  # an NCHW map `axis_orders` could not follow
    got = got.reshape(local.shape).astype(local.dtype)
    row = {"layer": name, "sqnr_db": round(sqnr_db(reference[name], got), 2),
           "local_sqnr_db": round(sqnr_db(local, got), 2),
           "max_abs_diff": float(np.max(np.abs(got - reference[name]))),
           "dtype": found["dtype"], "op": found["op"]}
    if found.get("step"):       # what rounding to the tensor's own 8-bit step alone gives
        row["rounding_sqnr_db"] = _db(local, found["step"] ** 2 / 12)
        row["range_fill"] = 1.0 if bounded(found) else round(max(
            float(np.max(got)) / found["high"] if found["high"] > 0 else 0.0,
            float(np.min(got)) / found["low"] if found["low"] < 0 else 0.0), 3)
        row["signal_steps"] = round(float(np.sqrt(np.mean(np.square(local, dtype=np.float64))))
                                    / found["step"], 3)      # its values' RMS in 8-bit steps
    return got, row


def _db(local: np.ndarray, noise: float) -> float:
    """`local`'s mean power over `noise` (a mean power), in dB, capped at `CAP_DB`."""
    power = float(np.mean(np.square(local, dtype=np.float64)))
    return round(min(CAP_DB, 10 * math.log10(max(power, 1e-30) / max(noise, 1e-30))), 2)


def _allowed(local: np.ndarray, moved: np.ndarray, found: dict) -> float:
    """The SQNR (dB) a layer's own 8-bit tensors allow it: the noise of its inputs each
    moved within their 8-bit step (`moved`: what the layer makes of them; an operation
    the file splits into several, as an int8 hard-swish's `x / 6`, rounds in between at
    about its input's step), plus its output rounded to its step and clipped to its
    range. A layer adding more noise than that computes something else."""
    clipped = np.clip(local, found["low"], found["high"])
    noise = (np.mean(np.square(moved - local, dtype=np.float64)) + found["step"] ** 2 / 12
             + np.mean(np.square(clipped - local, dtype=np.float64)))
    return _db(local, float(noise))


def _node(model, layer) -> int:
    """The index of `layer`'s node in `model`'s graph (a layer shared with another model,
    e.g. the one a plain copy was made from, has nodes of that model's too)."""
    for index in range(len(layer.inbound_nodes)):
        if internals.in_network(model, layer, index):
            return index
    raise ValueError(f"layer {layer.name} is not called in model {model.name}")


def output(model, layer):
    """`layer`'s output tensor in `model`'s graph."""
    return layer.get_output_at(_node(model, layer))


def worst(rows: list[dict], n: int = 5) -> list[dict]:
    """The `n` layers that add the most error (lowest `local_sqnr_db`)."""
    return sorted(rows, key=lambda r: r["local_sqnr_db"])[:n]


def tflite_report(blob: bytes, model, x: np.ndarray) -> list[dict]:
    """`compare` for a TFLite flatbuffer converted from `model`."""
    return tflite_compared(blob, model, x)[0]


def tflite_compared(blob: bytes, model, x: np.ndarray) -> tuple[list[dict], list[str]]:
    """(`compare`'s rows for a TFLite flatbuffer converted from `model`, the layers it
    could not compare: `uncompared`)."""
    names = [layer.name for layer in model.layers]
    outputs = tuple(internals.history(t)[0].name for t in model.outputs)
    artifact = tflite_tensors(blob, names, x, outputs)
    rows = compare(model, artifact, x)
    return rows, uncompared(model, artifact, rows)


EXAMPLES = 128      # calibration examples the per-layer comparison runs on


def tflite_entry(blob: bytes, plain, calibration: np.ndarray, cfg,
                 precision: str = "int8") -> dict:
    """Layer by layer, how far a reduced-precision TFLite file (`precision`: int8,
    dynamic or float16) is from the model it was converted from; for int8, also what the
    file is (`label`, its float ops)."""
    rows, missing = tflite_compared(blob, plain, calibration[:EXAMPLES])
    if precision != "int8":
        return entries(f"tflite_{precision}", rows, cfg, precision, missing)
    ops = float_ops(blob)
    return {"label": label(ops), "float_ops": ops,
            **entries("tflite_int8", rows, cfg, missing=missing)}


def saved_model_int8_entry(plain, quantized, layers: dict, calibration: np.ndarray,
                           cfg) -> dict:
    """The int8 SavedModel's layers against the model's: it computes in float32 from int8
    kernels (a folded convolution's output holds its batch norm too: compared at the
    batch norm's place)."""
    pairs = [(source.name, target.name) for source, target in     # clone_model keeps order
             zip(plain.layers[1:], quantized.layers[1:])
             if "folded" not in layers.get(target.name, {})]
    x = calibration[:EXAMPLES]
    values = keras_outputs(quantized, [t for _, t in pairs], x)
    artifact = {s: {"value": values[t], "dtype": "float32",
                    "op": type(quantized.get_layer(t)).__name__} for s, t in pairs}
    rows = compare(plain, artifact, x)
    return {"label": "int8 kernels, float32 compute",
            **entries("saved_model_int8", rows, cfg, missing=uncompared(plain, artifact, rows))}


def entries(name: str, rows: list[dict], cfg, precision: str = "int8",
            missing: list[str] = ()) -> dict:
    """`layers` (every compared layer), `worst_layers` (the five adding the most error),
    `uncompared` (the layers with weights the comparison could not see, when any), and
    one warning for the layers adding more noise than their precision's floor
    (`layer_noise.floor`) or than their 8-bit steps allow."""
    floor = layer_floor(precision, cfg)
    noisy = worst([row for row in rows if too_noisy(row, floor) or row["local_sqnr_db"] < floor],
                  len(rows))
    if noisy:            # one warning however many layers: the noisiest named, then a count
        row, more = noisy[0], len(noisy) - 1
        console.warn(f"{name}: layer {why_noisy(row, floor, precision)} ({row['op']}; its values are "
                     f"{row['sqnr_db']:.1f} dB from the model's)"
                     + ("" if rounding_limited(row) else
                        ": its 8-bit range or kernel does not fit its values")
                     + (f"; {more} more layer{'s' if more > 1 else ''} below it "
                        f"({', '.join(r['layer'] for r in noisy[1:4])}{', ...' if more > 3 else ''}"
                        "; summary.json lists every layer)" if more else ""))
    return {"layers": rows, "worst_layers": [r["layer"] for r in worst(rows)],
            **({"uncompared": list(missing)} if missing else {})}


