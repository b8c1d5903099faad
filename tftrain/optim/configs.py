"""The optimizer's config section (`train.optimizer`), beside the optimizers it builds;
the learning-rate schedules' sections are `schedules.py`. No TensorFlow import: the config
schema is read without it."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, model_validator

from tftrain.core.config_types import Strict


class OptimizerConfig(Strict):
    name: str = "adam"
    learning_rate: float = Field(0.001, gt=0)
    weight_decay: Optional[float] = Field(None, ge=0)
    clipnorm: Optional[float] = Field(None, gt=0)
    global_clipnorm: Optional[float] = Field(None, gt=0)
    params: dict[str, Any] = {}

    @model_validator(mode="after")
    def _one_clip(self):
        if self.clipnorm is not None and self.global_clipnorm is not None:
            raise ValueError("set clipnorm or global_clipnorm, not both")
        return self
