"""Model builder parameters checked before TensorFlow loads.

`model.params` (and a distillation student's) go to the builder as keyword arguments. A
name the builder does not take, or a value of the wrong kind (`filters: abc` where the
builder wants a list of ints), used to surface after TensorFlow started, as a TypeError
deep inside the builder. Here the builder's signature is read from its source file with
`ast`, without importing it (the bundled families, found by their `@MODELS.register`
name, or the user's `package.module:function`, located on `sys.path` without running
any of its package's code), and each value is checked against the parameter's
annotation, or, without one, against the kind of its default. What cannot be read this
way (a builder made at run time, Keras Applications' keyword arguments, a module not
found) is checked when the model is built, as before.
"""
from __future__ import annotations

import ast
import importlib.machinery
from dataclasses import dataclass
from pathlib import Path

from tftrain.core.config_types import ConfigError

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
_MISSING = object()


@dataclass(frozen=True)
class Param:
    name: str
    annotation: str | None          # as written, e.g. "int", "tuple[int, ...]"
    default: object = _MISSING      # a literal default, else _MISSING


@dataclass(frozen=True)
class Signature:
    where: str                      # e.g. "cnn in tftrain/models/cnn.py"
    params: tuple[Param, ...]       # after the input spec
    var_keyword: bool


def check(cfg) -> None:
    """A ConfigError naming `model.params.<name>` (or the student's) for each parameter the
    builder does not take or whose value is of the wrong kind."""
    problems = []
    sections = [("model", cfg.model.name, cfg.model.params)]
    student = cfg.compression.distillation.student
    if cfg.compression.distillation.enabled and student is not None:
        sections.append(("compression.distillation.student", student.name, student.params))
    for section, name, params in sections:
        if name.startswith("file:") and not Path(name[len("file:"):]).exists():
            raise ConfigError(f"{section}.name: {name[len('file:'):]} does not exist; give the "
                              "path of a .keras or .h5 file or a SavedModel directory")
        signature = find(name)
        if signature is not None:
            problems += problems_of(signature, params, f"{section}.params")
    if problems:
        raise ConfigError(*problems)


def find(name: str) -> Signature | None:
    """The builder's signature read from its source, or None when it cannot be read
    without running code."""
    if name.startswith("keras_applications:"):
        return None
    if name.startswith("file:"):                # a saved model: it takes no parameters
        return Signature(f"the model in {name[len('file:'):]}", (), False)
    if ":" not in name:
        return _registered(name)
    module, _, function = name.partition(":")
    path = _module_file(module)
    if path is None:
        return None
    return _signature(path, function, f"{name} in {path}")


def _registered(name: str) -> Signature | None:
    for path in sorted(MODELS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                    _registers(d, name) for d in node.decorator_list):
                return _of(node, f"{name} in tftrain/models/{path.name}")
    return None


def _registers(decorator, name: str) -> bool:
    return (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "register" and bool(decorator.args)
            and isinstance(decorator.args[0], ast.Constant) and decorator.args[0].value == name)


def _module_file(module: str) -> Path | None:
    """The source file of `module` (dotted) found on sys.path, without importing it or
    its packages."""
    spec, locations = None, None
    parts = module.split(".")
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), locations)
        if spec is None:
            return None
        locations = spec.submodule_search_locations
    origin = getattr(spec, "origin", None)
    return Path(origin) if origin and origin.endswith(".py") else None


def _signature(path: Path, function: str, where: str) -> Signature | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None                  # importing it will say what is wrong
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return _of(node, where)
    return None


def _of(node: ast.FunctionDef, where: str) -> Signature:
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [_MISSING] * (len(positional) - len(a.defaults)) + [_literal(d) for d in a.defaults]
    params = [Param(p.arg, _annotation(p.annotation), d)
              for p, d in zip(positional, defaults)][1:]          # the first takes the spec
    params += [Param(p.arg, _annotation(p.annotation), _MISSING if d is None else _literal(d))
               for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return Signature(where, tuple(params), a.kwarg is not None)


def _annotation(node) -> str | None:
    """An annotation as written (a string annotation, "Optional[str]", without its quotes)."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ast.unparse(node)


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


def problems_of(signature: Signature, params: dict, key: str) -> list[str]:
    """One line per parameter `params` gives that `signature` does not take or types
    differently."""
    from tftrain.core.registry import closest

    by_name = {p.name: p for p in signature.params}
    problems = []
    for name, value in params.items():
        param = by_name.get(name)
        if param is None:
            if signature.var_keyword:
                continue
            hint = closest(name, by_name)
            problems.append(f"{key}.{name}: unknown parameter of {signature.where}; "
                            + (f"did you mean {hint}?" if hint else
                               f"valid: {', '.join(by_name) or 'none'}"))
            continue
        wanted = expected(param)
        if wanted is not None and not wanted[0](value):
            shown = f"declares {param.name}: {param.annotation}" if param.annotation else \
                f"defaults it to {param.default!r}"
            problems.append(f"{key}.{name}: {value!r} is not {wanted[1]} ({signature.where} "
                            f"{shown})")
    return problems


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ints(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool)
                                                for x in v)


def _numbers(v) -> bool:
    return isinstance(v, (list, tuple)) and all(map(_number, v))


_KINDS = {  # what a value of a parameter may be, by annotation (None: anything)
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    "float": (_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "ints": (_ints, "a list of ints"),
    "numbers": (_numbers, "a list of numbers"),
    "int_or_ints": (lambda v: (isinstance(v, int) and not isinstance(v, bool)) or _ints(v),
                    "an int or a list of ints"),
}


def expected(param: Param):
    """(check, what it says) for a parameter, from its annotation, else its default's
    kind; None when anything goes (an annotation not understood, no literal default, or
    a None default)."""
    if param.annotation:
        kind = _annotation_kind(param.annotation)
        if kind is None:
            return None
        check, text = _KINDS[kind]
        if "None" in param.annotation or "Optional" in param.annotation:
            return (lambda v: v is None or check(v)), f"{text} or null"
        return check, text
    kind = _default_kind(param.default)
    return None if kind is None else _KINDS[kind]


def _annotation_kind(annotation: str) -> str | None:
    text = annotation.replace(" ", "")
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional["):-1]
    for alternative in text.split("|"):
        if alternative in ("int", "float", "bool", "str"):
            return alternative
        for head in ("tuple[", "list[", "Sequence["):
            if alternative.startswith(head):
                inner = alternative[len(head):].split(",")[0].rstrip("]")
                return {"int": "ints", "float": "numbers"}.get(inner)
    return None


def _default_kind(default) -> str | None:
    if default is _MISSING or default is None:
        return None
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int_or_ints"       # an int default often also takes a tuple (kernel sizes)
    if isinstance(default, float):
        return "float"
    if isinstance(default, str):
        return "str"
    if isinstance(default, (tuple, list)) and default:
        return "ints" if _ints(default) else "numbers" if _numbers(default) else None
    return None
