"""The one small Registry class: components chosen by name, with helpful errors."""
from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

from tftrain.core.config_types import ConfigError

T = TypeVar("T")


def closest(name: str, choices) -> str | None:
    """The valid choice closest to `name`, or None when nothing is close."""
    match = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


class Registry(Generic[T]):
    """Maps names to builders. `get` raises a ConfigError naming the config key."""

    def __init__(self, kind: str, key: str):
        self.kind = kind          # e.g. "model"
        self.key = key            # config path of the name, e.g. "model.name"
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._items[name] = item
            return item
        return add

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def get(self, name: str, key: str | None = None) -> T:
        """The item registered as `name`; the error names `key` (default: the registry's)."""
        if name in self._items:
            return self._items[name]
        hint = closest(name, self._items)
        suggestion = f"; did you mean '{hint}'?" if hint else ""
        raise ConfigError(
            f"{key or self.key}: unknown {self.kind} '{name}'; expected one of "
            f"{', '.join(self.names())}{suggestion}"
        )


def check_params(fn: Callable, params: dict, key: str, skip: int = 0,
                 strict: bool = False) -> None:
    """Raise a ConfigError naming `key.<param>` for params `fn` does not take.

    `skip` leading positional parameters are supplied by tftrain, not by the config;
    `strict` checks against the named parameters even when `fn` takes **kwargs.
    """
    import inspect

    sig = inspect.signature(fn)
    accepted = [p.name for p in list(sig.parameters.values())[skip:]
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not strict and any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    problems = []
    for name in params:
        if name not in accepted:
            hint = closest(name, accepted)
            tail = f"did you mean {hint}?" if hint else f"valid: {', '.join(accepted) or 'none'}"
            problems.append(f"{key}.{name}: unknown parameter; {tail}")
    if problems:
        raise ConfigError(*problems)


def import_function(name: str, key: str) -> Callable:
    """`package.module:function` -> the function; a ConfigError naming `key` when the
    module cannot be imported or has no such function (the user's code is imported as
    is: an error raised while importing it is theirs)."""
    import importlib

    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(f"{key}: cannot import module '{module_name}' ({err}); check the "
                          "module is on PYTHONPATH") from None
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"{key}: module '{module_name}' has no function '{attr}'")
    return getattr(module, attr)
