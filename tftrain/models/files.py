"""A model you already have: `model.name: file:PATH`.

PATH is a `.keras` file (written by Keras 3 or by tf_keras), an `.h5` file, or a
SavedModel directory written by tf_keras' `model.save`. The file is read by the Keras
that wrote it (its metadata says which): a tf_keras model as it is, a Keras 3 model
converted layer by layer (`keras3.to_tf_keras`; its outputs are compared with Keras 3's
on sample inputs, to 1e-5). Its optimizer state is not read (`compile=False`): tftrain
trains it with the configured optimizer. A model that ends in a softmax gives
probabilities; the softmax is taken off so it gives the logits tftrain's losses and
exports take (the same top class). The model's input and output are checked against the
data (`check_spec`): a mismatch is a config error naming both shapes. Layers come out
under the run's precision policy (a file's layers keep the dtype they were saved with
otherwise).
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path


from tftrain.config import ConfigError
from tftrain.core.keras import keras, keras3
from tftrain.core.keras_files import writer_of
from tftrain.core import console
from tftrain.models import file_code
from tftrain.core import internals
from tftrain.models import keras3 as convert
from tftrain.models.keras3 import LAYERS, _CONVERTERS
from tftrain.models.keras3_forms import APPLICATION_LAYERS, OPS

PREFIX = "file:"


@dataclass(frozen=True)
class Origin:
    """Where a model came from, for the plan and for handing it back."""
    path: str
    writer: str             # "keras3" or "tf_keras"
    form: str               # ".keras", ".h5", "SavedModel"
    layers: int
    converted_diff: float | None = None    # largest output difference after conversion
    softmax_removed: bool = False
    trusted_code: tuple[str, ...] = ()     # code the file carried, run under model.trust_code

    def describe(self) -> str:
        what = {"keras3": "Keras 3", "tf_keras": "tf_keras"}[self.writer]
        line = f"model from {self.path}: {what} {self.form}, {self.layers} layers"
        if self.converted_diff is not None:
            line += (f", converted to tf_keras (outputs equal Keras 3's to "
                     f"{self.converted_diff:.1e} on sample inputs)")
        if self.softmax_removed:
            line += "; its final softmax taken off (tftrain trains and exports logits)"
        return line


_LOADED: dict[str, Origin] = {}
_SAID: set[str] = set()         # files whose trusted code the console has named
_FIRST: dict[str, tuple] = {}   # path -> (its stamp, the model it gave, its weights then)


def _stamp(path: str) -> tuple:
    """When the file (a SavedModel: its graph) was written, and its size."""
    file = Path(path) / "saved_model.pb" if Path(path).is_dir() else Path(path)
    try:
        found = file.stat()
    except OSError:
        return ()
    return found.st_mtime_ns, found.st_size


def origin(name: str) -> Origin | None:
    """How the model `model.name` names was loaded in this process (None: not a file)."""
    return _LOADED.get(name[len(PREFIX):]) if name.startswith(PREFIX) else None


def builder(path: str, trust_code: bool = False):
    """The builder of `model.name: file:PATH`: `fn(spec)` loads the file (refused if it
    carries code, unless `trust_code`: `file_code.check`). The plan builds a model twice
    (for its costs, then under the strategy): the file is read, checked and converted
    once a process, and each later build is a copy of what it gave, with the weights
    it was read with (`_FIRST`)."""
    def from_file(spec):
        stamp = (*_stamp(path), trust_code)          # (a file refused untrusted stays so)
        if _FIRST.get(path, (None,))[0] == stamp:
            _, first, weights = _FIRST[path]
            model = keras.models.clone_model(first)     # its own variables
            model.set_weights(weights)
        else:
            model, found = load(path, trust_code)
            model, removed = to_logits(model)
            _LOADED[path] = Origin(found.path, found.writer, found.form, found.layers,
                                   found.converted_diff, removed, found.trusted_code)
            _FIRST.clear()                      # (one file's model held at a time)
            _FIRST[path] = (stamp, model, model.get_weights())   # (its weights as read)
        check_spec(model, spec, path)
        return in_current_policy(model)
    from_file.__doc__ = f"The model in {path}."
    return from_file


def load(path: str, trust_code: bool = False):
    """(tf_keras model, `Origin`) of the file at `path` (a ConfigError naming what is wrong;
    a file carrying code is refused before any of it runs unless `trust_code`)."""
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"model.name: {path} does not exist")
    writer, form = writer_of(file)
    code = tuple(file_code.check(path, "model.name", trust_code))
    if code and path not in _SAID:          # once a process (the plan builds it again)
        _SAID.add(path)
        console.warn(f"model.name: code from {path} ran while loading it (model.trust_code: "
                     f"true): {'; '.join(code[:3])}" + (f" and {len(code) - 3} more"
                                                       if len(code) > 3 else ""))
    if writer == "tf_keras":
        model = keras.models.load_model(str(file), compile=False)
        if not isinstance(model, keras.Model) or not internals.has_graph(model):
            raise ConfigError(f"model.name: {path} holds a subclassed tf_keras model; tftrain "
                              "needs a functional or Sequential one (its layers are compressed "
                              "one by one)")
        return model, Origin(str(path), writer, form, len(model.layers), trusted_code=code)

    unknown = _custom_classes(file) if form == ".keras" else []
    if unknown:
        raise ConfigError(console.listed(f"model.name: {path}:", [
            f"layer {name} ({cls}) is not a Keras built-in layer tftrain can convert; rewrite "
            "it with tf_keras, or register a converter (tftrain.models.keras3.register_converter) "
            "and load its module before the run" for name, cls in unknown], most=4))
    original = keras3().saving.load_model(str(file), compile=False, safe_mode=not trust_code)
    problems = convert.refusal(original)
    if problems:
        raise ConfigError(console.listed(f"model.name: {path}:", problems, most=4))
    model, diff = convert.checked(original, str(path))
    return model, Origin(str(path), writer, form, len(model.layers), diff, trusted_code=code)


def _custom_classes(file: Path) -> list[tuple[str, str]]:
    """(layer name, class) of layers in a Keras 3 `.keras` file's config that are not
    Keras built-ins registered under another name (read from config.json: nothing is
    loaded or run)."""

    with zipfile.ZipFile(file) as z:
        config = json.loads(z.read("config.json"))
    found = []

    def walk(entry):
        layers = entry.get("config", {}).get("layers", []) if isinstance(entry, dict) else []
        for layer in layers:
            cls = layer.get("class_name", "")
            module = layer.get("module") or ""
            builtin = ((module == "keras" or module.startswith("keras."))
                       and cls in LAYERS | {"Functional", "Sequential"}
                       or module.startswith("keras.src.ops") and cls in OPS
                       or module.startswith("keras.src.applications") and cls in APPLICATION_LAYERS)
            if not builtin and cls not in _CONVERTERS:
                found.append((layer.get("config", {}).get("name", "?"),
                              layer.get("registered_name") or cls))
            walk(layer)
    walk(config)
    return found


def to_logits(model):
    """(model, whether a final softmax was taken off): a model ending in a softmax gives
    probabilities, which tftrain's losses and exports would take for logits."""
    last = model.layers[-1]
    activation = getattr(getattr(last, "activation", None), "__name__", "")
    if type(last).__name__ == "Softmax" or (type(last).__name__ == "Activation"
                                            and activation == "softmax"):
        logits = last.input
        return keras.Model(model.inputs, logits, name=model.name), True
    if activation == "softmax" and len(model.outputs) == 1:
        config = last.get_config()
        config["activation"] = "linear"
        head = type(last).from_config(config)
        out = head(last.input)
        head.set_weights(last.get_weights())
        return keras.Model(model.inputs, out, name=model.name), True
    return model, False


def check_spec(model, spec, path: str) -> None:
    """The model takes the data's examples and gives one output per class."""
    inputs = model.inputs[0]
    wanted = tuple(spec.shape)
    shape = tuple(inputs.shape[1:])
    if len(model.inputs) != 1 or len(shape) != len(wanted) or any(
            d is not None and d != w for d, w in zip(shape, wanted)):
        raise ConfigError(f"model.name: {path} takes inputs of shape {shape}, but the data's "
                          f"examples are {wanted}; give data of that shape (data.params: "
                          "image_size, channels) or a model that takes it")
    if ("int" in spec.dtype) != ("int" in inputs.dtype.name):
        raise ConfigError(f"model.name: {path} takes {inputs.dtype.name} inputs, but the data's "
                          f"examples are {spec.dtype}")
    classes = model.outputs[0].shape[-1]
    if len(model.outputs) != 1 or classes != spec.num_classes:
        raise ConfigError(f"model.name: {path} gives {classes} outputs, but the data has "
                          f"{spec.num_classes} classes; give a model with one output per class")


def in_current_policy(model):
    """`model` with its layers in the current mixed-precision policy (a file's layers
    keep the dtype they were saved with), weights as they are."""
    policy = keras.mixed_precision.global_policy().name
    if policy == "float32" and all(layer.dtype_policy.name == "float32" for layer in model.layers):
        return model

    def rebuild(layer):
        config = layer.get_config()
        if "dtype" in config and type(layer).__name__ != "InputLayer":
            config["dtype"] = policy
        return type(layer).from_config(config)
    clone = keras.models.clone_model(model, clone_function=rebuild)
    clone.set_weights(model.get_weights())
    return clone
