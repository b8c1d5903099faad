"""The configured dataset: a registered loader by name (`source.DATASETS`), a TFDS
dataset (`tfds:NAME`) or the user's own function (`package.module:function`), its params
checked against the loader."""
from __future__ import annotations

import inspect

from tftrain.config import ConfigError, DataConfig
from tftrain.core.registry import check_params
from tftrain.data.source import DATASETS, Source
from tftrain.data.tfds import tfds_source
from tftrain.data.user import user_source


def load_source(cfg: DataConfig, seed: int) -> Source:
    """Build the configured dataset (validating its params against the loader)."""
    if ":" in cfg.name and cfg.name.split(":", 1)[0] not in ("keras", "tfds"):
        return user_source(cfg, seed)
    if cfg.name.startswith("tfds:"):
        return tfds_source(cfg, seed)
    loader = DATASETS.get(cfg.name)
    for key in FROM_CONFIG:
        if key in cfg.params:
            raise ConfigError(f"data.params.{key}: set data.{key} instead (one way to say it)")
    kind = getattr(loader, "options", None)        # `source.options`: a dataclass of them
    taking = kind or loader
    check_params(taking, cfg.params, "data.params", skip=0 if kind else 2)
    taken = inspect.signature(taking).parameters
    given = {k: getattr(cfg, k) for k in FROM_CONFIG if k in taken and getattr(cfg, k) is not None}
    if kind is not None:
        return loader(cfg.validation_fraction, seed, kind(**cfg.params, **given))
    return loader(cfg.validation_fraction, seed, **cfg.params, **given)


FROM_CONFIG = ("shuffle_buffer", "on_bad_record")   # data.* keys some loaders take
