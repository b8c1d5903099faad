"""Reading configs: YAML in (a safe loader, aliases bounded), `--set` overrides, validation against the schema
in `tftrain.config`, one line per problem out (a `ConfigError`)."""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from pydantic import BaseModel, ValidationError

from tftrain.config.schema import Config
from tftrain.core.config_types import ConfigError


# --- loading -------------------------------------------------------------------------
def _yaml_problem(source: str, text: str, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = "file"
    if mark:
        lines = text.splitlines()
        line = lines[mark.line].strip() if mark.line < len(lines) else ""
        key = line.split(":", 1)[0].strip("- ") if ":" in line else ""
        where = f"line {mark.line + 1}" + (f" (key '{key}')" if key else "")
    if isinstance(err, yaml.constructor.ConstructorError):
        return (f"{source}: {where}: tag not allowed ({err.problem}); "
                "tftrain configs are plain YAML (maps, lists, numbers, strings)")
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{source}: {where}: malformed YAML: {problem}; fix the syntax at that line"


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading `1e-05` as a float as YAML 1.2 does (YAML 1.1 wants
    a dot, `1.0e-05`, and PyYAML reads `1e-05` as a string; `json.dumps` and most people
    write it without one)."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))

# Values a config may hold once aliases are expanded: a real config has a few hundred; a
# few aliases nested a few levels deep (a "billion laughs" file) expand exponentially.
MAX_VALUES = 10_000


def parse_yaml(text: str, where: str = ""):
    """`text` read by `Loader` after its node tree is checked: a key given twice in one
    mapping, or aliases expanding beyond `MAX_VALUES` values, is a ConfigError. The checks
    walk the composed node tree (nothing is constructed, so nothing can run), each shared
    node once."""
    root = yaml.compose(text, Loader=Loader)
    sizes: dict[int, int] = {}

    def size(node) -> int:              # values under `node`, aliases expanded
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1             # (a node that contains itself counts once)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in seen:
                        raise ConfigError(f"line {key.start_mark.line + 1}: key '{key.value}' is "
                                          f"given twice in the same mapping (first at line "
                                          f"{seen[key.value]}); keep one of them")
                    seen[key.value] = key.start_mark.line + 1
                total += size(key) + size(value)
        elif isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        sizes[id(node)] = min(total, MAX_VALUES + 1)
        return sizes[id(node)]

    if root is not None and size(root) > MAX_VALUES:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}its aliases (*name) expand to more than {MAX_VALUES:,} "
                          "values; a config needs far fewer: write the values out or use "
                          "fewer nested aliases")
    loader = Loader(text)             # what yaml.load does, with this safe loader
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: Union[str, Path]) -> dict:
    """Read a YAML mapping (safe loader, duplicate keys refused); raise ConfigError on any
    problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; pass the path of a YAML file "
                          "(e.g. configs/quickstart.yaml)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {err.start} is "
                          f"{raw[err.start]:#04x}); pass a YAML config file") from None
    if "\0" in text:
        raise ConfigError(f"{path}: binary file (it contains NUL bytes); pass a YAML config file")
    try:
        data = parse_yaml(text)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_problem(str(path), text, err)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections "
                          f"(run, distribute, model, ...); got {type(data).__name__}")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides; values are parsed as YAML scalars or lists."""
    data = _deep_copy(data)
    problems = []
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--set {item!r}: expected KEY=VALUE, e.g. train.epochs=5")
            continue
        try:
            value = parse_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            problems.append(f"--set {key}: value {raw!r} is not valid YAML ({err.__class__.__name__})")
            continue
        except ConfigError as err:
            problems.append(f"--set {key}: {err}")
            continue
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise ConfigError(*problems)
    return data


def _deep_copy(d):
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def _fields_at(loc: tuple) -> list[str]:
    """Names of the fields of the schema section at `loc` (for 'did you mean')."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        for candidate in (ann, *getattr(ann, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
        else:
            return []
    return list(getattr(model, "model_fields", {}))


def _untagged(loc: tuple) -> tuple[tuple, Optional[tuple[str, str]]]:
    """`loc` without the tag pydantic inserts after a field selected by name (a schedule:
    train.schedule.cosine.alpha), and (what is selected, the name) when there is one."""
    model: Any = Config
    for i, part in enumerate(loc):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return loc, None
        if field.discriminator and i + 1 < len(loc):
            return loc[:i + 1] + loc[i + 2:], (str(part), str(loc[i + 1]))
        ann = field.annotation
        model = next((c for c in (ann, *getattr(ann, "__args__", ()))
                      if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return loc, None


def _selected_fields(tag: str) -> list[str]:
    from tftrain.optim.schedules import SCHEDULES     # the one name-selected section today

    for cls in SCHEDULES:
        if getattr(cls.model_fields["name"].annotation, "__args__", (None,))[0] == tag:
            return [f for f in cls.model_fields if f != "name"]
    return []


def _format_error(source: str, err) -> str:
    loc, tagged = _untagged(tuple(err["loc"]))
    path = ".".join(str(p) for p in loc) or "(top level)"
    value = err.get("input")
    if err["type"] == "union_tag_invalid":
        tags = [t.strip("' ") for t in err["ctx"]["expected_tags"].split(",")]
        key = err["ctx"]["discriminator"].strip("'")
        hint = difflib.get_close_matches(str(err["ctx"]["tag"]), tags, n=1, cutoff=0.6)
        return (f"{source}: {path}.{key}: unknown {loc[-1]} '{err['ctx']['tag']}'; expected one "
                f"of {', '.join(tags)}" + (f"; did you mean '{hint[0]}'?" if hint else ""))
    if err["type"] == "extra_forbidden" and tagged and len(loc) == len(err["loc"]) - 1:
        fields = _selected_fields(tagged[1])
        return (f"{source}: {path}: not used by {tagged[0]} '{tagged[1]}' (it takes: "
                f"{', '.join(fields)})")
    if err["type"] == "extra_forbidden":
        hint = difflib.get_close_matches(str(loc[-1]), _fields_at(loc[:-1]), n=1, cutoff=0.6)
        tail = f"did you mean {hint[0]}?" if hint else \
            f"valid keys: {', '.join(_fields_at(loc[:-1]))}"
        return f"{source}: {path}: unknown key; {tail}"
    msg = err["msg"].removeprefix("Value error, ")
    if msg.startswith(tuple(f"{s}." for s in Config.model_fields)):
        return f"{source}: {msg}"     # a cross-field check that names its own key
    shown = repr(value) if not isinstance(value, dict) else "a mapping"
    return f"{source}: {path}: {msg} (got {shown})"


def validate(data: dict, source: str = "config", overridden: tuple[str, ...] = ()) -> Config:
    """Validate a plain dict against the schema. `overridden`: the keys `--set` gave; a
    problem under one of them is blamed on that `--set`, not on the file."""
    from tftrain.config import builders

    def blamed(err) -> str:
        path = ".".join(str(p) for p in _untagged(tuple(err["loc"]))[0])
        key = next((k for k in overridden if path == k or path.startswith(k + ".")
                    or k.startswith(path + ".")), None)
        return "--set" if key else source

    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(*[_format_error(blamed(e), e) for e in exc.errors()]) from None
    builders.check(cfg)          # the builder's parameters, read from its source
    return cfg


def load_config(path: Union[str, Path, None] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load, override and validate a config. `path=None` starts from the defaults."""
    data = read_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    keys = tuple(item.partition("=")[0].strip() for item in overrides or [])
    return validate(data, str(path) if path is not None else "config", keys)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (durations written back in their short form)."""
    return yaml.safe_dump(_plain(cfg.model_dump()), sort_keys=False)


def _plain(v):
    if isinstance(v, dict):
        if set(v) == {"value", "unit"}:
            if v["unit"] == "fraction":
                return float(v["value"])
            n = int(v["value"]) if float(v["value"]).is_integer() else v["value"]
            return n if v["unit"] == "steps" else f"{n} epochs"
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def json_schema() -> dict:
    """JSON Schema of the config (for editor completion of YAML files), every key
    described (`reference.DESCRIPTIONS`)."""
    from tftrain.config.reference import describe
    return describe(Config.model_json_schema())
