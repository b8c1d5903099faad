"""The config's building blocks: its error type, the strict base model (unknown keys,
infinities and NaNs refused) and the value types parsed from YAML (durations, sizes)."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class ConfigError(ValueError):
    """Bad configuration or arguments: the CLI prints each line and exits 2."""

    def __init__(self, *problems: str):
        self.problems = [p for p in problems if p]
        super().__init__("\n".join(self.problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# --- durations -----------------------------------------------------------------------
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(steps?|epochs?)\s*$")


# The text forms `_parse_duration` and `_size_bytes` read, for the JSON Schema (editors
# check configs against it: the short forms must validate there too).
DURATION_TEXT = r"^\s*\d+(\.\d+)?\s*(steps?|epochs?|%)\s*$"
SIZE_TEXT = r"^\s*\d+(\.\d+)?\s*([KMGTkmgt]i?)?[Bb]?\s*$"


class Duration(Strict):
    """A length of training: an integer is optimizer updates; "N epochs" is epochs; a
    float in [0, 1] or "N%" is that fraction of the stage's updates."""

    value: float = Field(description="how many: updates, epochs, or a fraction in [0, 1]")
    unit: Literal["steps", "epochs", "fraction"] = Field(
        description="what `value` counts: optimizer updates, epochs, or a fraction of the stage")

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema, handler):
        """Every form a config may write: updates, a fraction, "2 epochs", "50%", or the
        resolved {value, unit}."""
        resolved = handler(core_schema)
        return {"anyOf": [{"type": "integer", "minimum": 0, "description": "optimizer updates"},
                          {"type": "number", "minimum": 0, "maximum": 1,
                           "description": "a fraction of the stage"},
                          {"type": "string", "pattern": DURATION_TEXT,
                           "description": "e.g. '2 epochs', '500 steps', '50%'"},
                          resolved]}

    def steps(self, steps_per_epoch: int, total: int) -> int:
        """The one conversion of durations to optimizer updates (`total`: the stage's)."""
        if self.unit == "steps":
            return int(self.value)
        if self.unit == "fraction":
            return int(round(self.value * total))
        return int(round(self.value * steps_per_epoch))


def size_schema(schema: dict) -> None:
    """JSON Schema of a size in bytes (`json_schema_extra` of its field): a number or
    text like '16GB' or '512MiB'."""
    nullable = any(s.get("type") == "null" for s in schema.get("anyOf", []))
    schema.pop("type", None)
    schema["anyOf"] = [{"type": "integer", "minimum": 0}, {"type": "number", "minimum": 0},
                       {"type": "string", "pattern": SIZE_TEXT,
                        "description": "e.g. '16GB', '512MiB'"}]
    schema["anyOf"] += [{"type": "null"}] if nullable else []


def _parse_duration(v: Any) -> Any:
    if isinstance(v, Duration) or isinstance(v, dict):
        return v
    if isinstance(v, bool):
        raise ValueError("expected an integer number of steps or a string like '2 epochs'")
    if isinstance(v, int):
        if v < 0:
            raise ValueError("must be >= 0")
        return {"value": v, "unit": "steps"}
    if isinstance(v, float):
        if not 0 <= v <= 1:
            raise ValueError("a float is a fraction of the stage and must be in [0, 1]")
        return {"value": v, "unit": "fraction"}
    if isinstance(v, str):
        percent = _number(v.strip()[:-1]) if v.strip().endswith("%") else None
        if percent is not None:
            return _parse_duration(percent / 100.0)
        m = _DURATION.match(v)
        if m:
            unit = "epochs" if m.group(2).startswith("epoch") else "steps"
            return {"value": float(m.group(1)), "unit": unit}
    raise ValueError("expected an integer number of steps, a string like '2 epochs' or "
                     "'500 steps', or a fraction of the stage like 0.5 or '50%'")


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _size_bytes(v: Any) -> Optional[int]:
    """'16GB', '512MiB', 1e9 -> bytes."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    if isinstance(v, float):
        return int(v)
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", str(v), re.IGNORECASE)
    if not m:
        raise ValueError("expected bytes as a number or a size like '16GB' or '512MiB'")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)
