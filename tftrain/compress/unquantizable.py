"""Which layers QAT cannot quantize, and a refusal a person can read: one line per kind
of layer with its count and an example, at most 10 lines, and what keeping them float
(`compression.quantization.skip_unsupported`) would cost in float islands."""
from __future__ import annotations

import tensorflow as tf

from tftrain.compress import qat_configs, qat_norms
from tftrain.config import ConfigError, QuantizationConfig
from tftrain.core.keras import keras
from tftrain.models import layer_parents
from tftrain.core import internals

# a batch norm after these is folded into them (a SeparableConv2D's into its 1x1 part)
FOLDED_INTO = ("Conv2D", "DepthwiseConv2D", "Dense", "SeparableConv2D")


def quantizable(layer, parents: list[str], loose: frozenset | set = frozenset()) -> bool:
    """Whether tfmot's default 8-bit scheme, or tftrain's forms, can quantize this layer
    (a SeparableConv2D as a depthwise and a 1x1 convolution, `qat_scheme`; batch norm
    right after a convolution or dense layer is folded into it; the batch
    norms named in `loose`, `qat_norms.standalone_norms`, become `ChannelAffine`)."""
    from tensorflow_model_optimization.python.core.quantization.keras.default_8bit import (
        default_8bit_quantize_registry as registry,
    )
    if isinstance(layer, keras.layers.InputLayer):
        return True
    if isinstance(layer, keras.layers.BatchNormalization):
        return layer.name in loose or (bool(parents) and all(p in FOLDED_INTO for p in parents))
    if type(layer) is keras.layers.SeparableConv2D:     # split in two (`qat_scheme`)
        return True
    return registry.Default8BitQuantizeRegistry().supports(layer) or qat_configs.supported(layer)


def unquantizable(model, cfg: QuantizationConfig, loose: set[str] | None = None) -> list[str]:
    """Layers tfmot cannot quantize: an error naming them, or (skip_unsupported) the
    names to leave in float. `loose`: the model's `standalone_norms`, when the caller
    has them."""
    parents = layer_parents(model)
    if loose is None:
        loose = qat_norms.standalone_norms(model, FOLDED_INTO)
    unsupported = [layer for layer in model.layers
                   if not quantizable(layer, parents[layer.name], loose)]
    if unsupported and not cfg.skip_unsupported:
        raise ConfigError("\n".join(refusal_lines(model, unsupported)))   # one problem
    return [layer.name for layer in unsupported]


def refusal_lines(model, unsupported: list, most: int = 10) -> list[str]:
    """What cannot be quantized, a line per kind of layer with its count and an example
    ("TFOpLambda (add, multiply) x 54, e.g. tf.__operators__.add_27"), at most `most`
    lines, and what `skip_unsupported` would cost: each connected group of float layers
    is a float island, a DEQUANTIZE before it and a QUANTIZE after it in the int8 file."""
    kinds: dict[str, list] = {}
    for layer in unsupported:
        kinds.setdefault(type(layer).__name__, []).append(layer)
    lines = [f"compression.quantization: tfmot cannot quantize {_count(unsupported, 'layer')} "
             f"of {_count(kinds, 'kind')}:"]
    ranked = sorted(kinds.items(), key=lambda kv: -len(kv[1]))
    shown = ranked if len(ranked) <= most - 2 else ranked[:most - 3]
    for kind, layers in shown:
        ops = sorted({getattr(layer, "symbol", "").split(".")[-1] for layer in layers} - {""})
        what = f"{kind} ({', '.join(ops)})" if ops else kind
        lines.append(_fit(f"  {what} x {len(layers)}, e.g. {layers[0].name}"))
    if len(shown) < len(ranked):
        rest = ranked[len(shown):]
        lines.append(f"  and {_count(rest, 'more kind')} "
                     f"({_count([x for _, v in rest for x in v], 'layer')})")
    islands = _count(range(float_islands(model, {x.name for x in unsupported})), "float island")
    lines.append(f"  skip_unsupported: true keeps them float ({islands}, a DEQUANTIZE/QUANTIZE "
                 "pair each), or disable quantization")
    return lines


def _count(items, word: str) -> str:
    return f"{len(items)} {word}{'' if len(items) == 1 else 's'}"


def _fit(line: str, width: int = 120) -> str:
    return line if len(line) <= width else line[:width - 3] + "..."


def float_islands(model, names: set) -> int:
    """Connected groups of the layers `names` in `model`'s graph."""
    links: dict[str, set] = {n: set() for n in names}
    for node in (n for nodes in internals.nodes_by_depth(model).values() for n in nodes):
        if node.layer.name not in names:
            continue
        for inbound in tf.nest.flatten(node.inbound_layers):
            if inbound.name in names:
                links[node.layer.name].add(inbound.name)
                links[inbound.name].add(node.layer.name)
    seen, groups = set(), 0
    for name in names:
        if name in seen:
            continue
        groups += 1
        todo = [name]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(links[current] - seen)
    return groups
