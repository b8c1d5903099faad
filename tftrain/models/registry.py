"""The model registry: builders by name (`MODELS`), Keras Applications by
`keras_applications:NAME`, or the user's `package.module:function`; building a configured
model with its params checked."""
from __future__ import annotations

import inspect

from tftrain.core.keras import ensure_tf_keras_model
from tftrain.config import ConfigError
from tftrain.core import console
from tftrain.core.registry import Registry, check_params, import_function
from tftrain.models import keras3, tensor_ops
from tftrain.models.files import builder
from tftrain.models.applications import application
from tftrain.models.files import origin

MODELS = Registry("model", "model.name")
APPLICATIONS = "keras_applications:"      # + a keras.applications model name
FILE = "file:"                            # + a .keras, .h5 or SavedModel path


def resolve_builder(name: str, key: str = "model.name", trust_code: bool = False):
    """A registered builder, or `package.module:function`; errors name `key`. A model file
    that carries code is loaded only with `trust_code` (`model.trust_code`)."""
    if ":" not in name:
        return MODELS.get(name, key)
    if name.startswith(FILE):
        return builder(name[len(FILE):], trust_code)
    if name.startswith(APPLICATIONS):
        try:
            return application(name[len(APPLICATIONS):])
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None
    fn = import_function(name, key)
    if inspect.isbuiltin(fn):
        raise ConfigError(f"{key}: {name} is a built-in function, not a model builder; a builder "
                          "is a Python function fn(spec, **params) that returns a Keras model")
    return fn


def build_model(cfg, spec, section: str = "model", trust_code: bool | None = None):
    """Build the configured model for `spec` (params checked against the builder); errors
    name the config `section` it came from (e.g. a distillation student's). `cfg`: a
    `ModelConfig` or a student's section; a file model loads its code only with
    `trust_code` (default: `cfg.trust_code`, the run's `model.trust_code`)."""
    trust = cfg.trust_code if trust_code is None else trust_code
    builder = resolve_builder(cfg.name, f"{section}.name", trust)
    check_params(builder, cfg.params, f"{section}.params", skip=1)
    if ":" in cfg.name and not cfg.name.startswith((APPLICATIONS, FILE)):
        # user code: whatever it raises is a bug in it (exit 1, traceback)
        built = builder(spec, **cfg.params)
        if keras3.is_keras3(built):
            _KERAS3.add(cfg.name)
        return tensor_ops.as_layers(tf_keras_model(built, cfg.name, section))
    try:
        model = builder(spec, **cfg.params)
    except ValueError as err:     # the bundled builders' own checks of their params
        raise ConfigError(f"{section}.params: {cfg.name} rejected {cfg.params} ({err})") from None
    # operations on tensors as layers (MobileNetV3's hard-swish): what compression reads
    return tensor_ops.as_layers(ensure_tf_keras_model(model, f"model '{cfg.name}'"))


_KERAS3: set[str] = set()          # model names whose builder returned a Keras 3 model


def came_in_as_keras3(name: str) -> bool:
    """Whether the model `model.name` names came in as Keras 3 (a Keras 3 file, or a
    builder that returned a Keras 3 model) in this process: it is handed back as one."""

    found = origin(name)
    return name in _KERAS3 or (found is not None and found.writer == "keras3")


def tf_keras_model(model, what: str, section: str = "model"):
    """A builder's model as tf_keras: a Keras 3 functional or Sequential model converted
    layer by layer (`keras3.to_tf_keras`; what cannot be is a config error naming the
    layer), a tf_keras one as it is."""
    if keras3.is_keras3(model):
        problems = keras3.refusal(model)
        if problems:
            raise ConfigError(console.listed(f"{section}.name: {what} is a Keras 3 model:", problems, most=4))
        return keras3.checked(model, what)[0]
    return ensure_tf_keras_model(model, what)


def layer_parents(model) -> dict[str, list[str]]:
    """Class names of each layer's inputs within `model`, read from the model's own
    graph (a layer may also be called in other models, so its inbound nodes are not)."""
    config = model.get_config()["layers"]
    kinds = {entry["name"]: entry["class_name"] for entry in config}
    return {entry["name"]: [kinds[item[0]] for node in entry.get("inbound_nodes", [])
                            for item in node
                            if isinstance(item, (list, tuple)) and item[0] in kinds]
            for entry in config}
