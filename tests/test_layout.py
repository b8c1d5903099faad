"""The package's layout: packages by concern whose imports point one way, no import cycle,
small modules, a thin top level.

The import graph is read statically from the source (every `import` and `from ... import`
anywhere in a module, lazy imports inside functions included), so a cycle that only closes
at run time, on some code path, is found before it bites.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers import ROOT

# packages in the order they may import each other: each imports only itself and those
# before it (data and models are independent of each other); the top-level modules may
# import every package
ORDER = [("core",), ("optim",), ("config",), ("data", "models"), ("runtime",), ("training",),
         ("compress",), ("export",), ("stages",), ("search",)]
TOP_LEVEL = {"__init__", "run", "plan", "report", "launch", "sweep", "doctor"}
MAX_LINES = 400


def modules(root: Path, package: str = "tftrain") -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` under `root`."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: Path, package: str = "tftrain") -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (`from a import b` counts as an
    import of `a.b` when that is a module, else of `a`)."""
    mods = modules(root, package)
    graph = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[:len(name.split(".")) - node.level + is_package]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in mods else module)
        graph[name] = {_owner(t, mods) for t in targets
                       if t.split(".")[0] == package} - {name, None}
    return graph


def _owner(target: str, mods) -> str | None:
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target or None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def rank(module: str, package: str = "tftrain") -> tuple[int, str]:
    """(position in ORDER, package) of a module; the top level is last."""
    parts = module.split(".")
    sub = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] not in TOP_LEVEL) else None
    for i, group in enumerate(ORDER):
        if sub in group:
            return i, sub
    return len(ORDER), ""


def against_the_order(graph: dict[str, set[str]], package: str = "tftrain") -> list[str]:
    """Each import of a package later in ORDER (or of an unrelated package of the same
    rank), and each import of the top-level package or modules from inside a package."""
    wrong = []
    for module, targets in sorted(graph.items()):
        mine = rank(module, package)
        for target in sorted(targets):
            theirs = rank(target, package)
            if target == package and mine[0] < len(ORDER):
                wrong.append(f"{module} -> {target} (the top-level package)")
            elif theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1]):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_no_import_cycle_and_every_import_points_down_the_order():
    graph = imports(ROOT)
    assert len(graph) > 60                      # the whole package was read
    assert cycles(graph) == []
    assert against_the_order(graph) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_guard_finds_a_cycle_and_an_import_against_the_order(tmp_path):
    """A test-only package: a lazy import closes a cycle inside `data`, and `core` imports
    `training` (backwards). Both are found; the same tree without them is clean."""
    clean = {"tftrain/__init__.py": "from tftrain.config import Config\n",
             "tftrain/core/__init__.py": "", "tftrain/core/registry.py": "import re\n",
             "tftrain/config/__init__.py": "from tftrain.core.registry import re\n",
             "tftrain/data/__init__.py": "",
             "tftrain/data/source.py": "from tftrain.core import registry\n",
             "tftrain/data/images.py": "from tftrain.data.source import x\n",
             "tftrain/training/__init__.py": "", "tftrain/training/step.py": "from . import x\n",
             "tftrain/run.py": "from tftrain.training import step\nfrom tftrain import data\n"}
    graph = imports(_write(tmp_path / "clean", clean))
    assert graph["tftrain.data.images"] == {"tftrain.data.source"}
    assert graph["tftrain.run"] == {"tftrain.training.step", "tftrain.data"}
    assert cycles(graph) == [] and against_the_order(graph) == []

    broken = {**clean,
              "tftrain/data/source.py": "from tftrain.core import registry\n\n\ndef f():\n"
                                        "    from tftrain.data.images import decode\n",
              "tftrain/core/registry.py": "from tftrain.training.step import y\n"}
    graph = imports(_write(tmp_path / "broken", broken))
    assert cycles(graph) == [["tftrain.data.images", "tftrain.data.source"]]
    assert against_the_order(graph) == ["tftrain.core.registry -> tftrain.training.step"]
    # a package module importing the top-level package (which imports everything)
    graph = imports(_write(tmp_path / "top", {**clean, "tftrain/data/user.py": "import tftrain\n"}))
    assert against_the_order(graph) == ["tftrain.data.user -> tftrain (the top-level package)"]


def test_a_thin_top_level_of_small_modules():
    top = {p.stem for p in (ROOT / "tftrain").glob("*.py")}
    assert top == TOP_LEVEL and len(top) <= 8
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "tftrain").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("package", sorted(p.name for p in (ROOT / "tftrain").iterdir()
                                           if (p / "__init__.py").exists()))
def test_every_package_says_what_it_is_for_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((ROOT / "tftrain" / package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 15, package
    assert re.search(r"^May import: ", doc, re.M), package


def test_core_imports_no_tensorflow_but_its_keras_module():
    """(`internals` reaches TensorFlow's private parts inside its functions only.)"""
    assert _top_imports(ROOT / "tftrain" / "core" / "internals.py") == {"__future__", "__future__.annotations"}
    for path in (ROOT / "tftrain" / "core").glob("*.py"):
        named = {alias.name.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Import) for alias in node.names}
        named |= {(node.module or "").split(".")[0]
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.ImportFrom)}
        heavy = named & {"tensorflow", "tf_keras", "keras", "tensorflow_model_optimization"}
        assert not heavy or path.name in ("keras.py", "internals.py"), (path.name, heavy)


# what loads TensorFlow when imported (besides TensorFlow itself): Keras, through
# `tftrain.core.keras`
HEAVY_ROOTS = ("tensorflow", "tf_keras", "keras", "tftrain.core.keras")


def _top_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def loads_tensorflow(root: Path, package: str = "tftrain") -> dict[str, bool]:
    """module -> whether importing it loads TensorFlow (its top-level imports, or its
    packages', reach TensorFlow or a module that does)."""
    mods = modules(root, package)
    tops = {name: _top_imports(path) for name, path in mods.items()}
    found: dict[str, bool] = {}

    def heavy(name: str, seen: frozenset = frozenset()) -> bool:
        if name not in found:
            parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
            found[name] = any(
                any(dep == root or dep.startswith(root + ".") for root in HEAVY_ROOTS) or
                (_owner(dep, mods) not in (None, name) and _owner(dep, mods) not in seen
                 and heavy(_owner(dep, mods), seen | {name}))
                for dep in tops[name] | parents)
        return found[name]
    return {name: heavy(name) for name in mods}


def deferred_imports(root: Path, package: str = "tftrain") -> list[str]:
    """Imports of tftrain, TensorFlow or NumPy inside a function of a module that loads
    TensorFlow anyway: deferring them saves nothing."""
    mods, heavy = modules(root, package), loads_tensorflow(root, package)
    wrong = []
    for name, path in mods.items():
        if not heavy[name]:
            continue
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                         else [])
                wrong += [f"{name}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in (package, "tensorflow", "numpy")]
    return sorted(wrong)


def test_modules_that_load_tensorflow_import_at_the_top():
    """Only a module importable without TensorFlow (what `--help`, `--dry-run`, the config
    check and the export kinds read) defers imports to keep those fast; one that loads
    TensorFlow anyway imports tftrain, TensorFlow and NumPy at its top."""
    heavy = loads_tensorflow(ROOT)
    assert heavy["tftrain.stages.runner"] and heavy["tftrain.export.context"]
    assert not any(heavy[m] for m in ("tftrain.run", "tftrain.plan", "tftrain.config",
                                      "tftrain.export.kinds", "tftrain.core.internals",
                                      "tftrain.stages"))
    assert deferred_imports(ROOT) == []


def test_the_deferred_import_check_sees_a_deferred_import(tmp_path):
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/light.py": "def f():\n    import tensorflow\n",
        "pkg/heavy.py": "import pkg.base\n\ndef f():\n    from pkg import light\n",
        "pkg/base.py": "from tensorflow import nest\n",
        "pkg/named_alike.py": "import tensorflow_datasets\nfrom pkg import kerasish\n",
        "pkg/kerasish.py": ""})
    heavy = loads_tensorflow(root, "pkg")
    assert heavy == {"pkg": False, "pkg.light": False, "pkg.heavy": True, "pkg.base": True,
                     "pkg.named_alike": False, "pkg.kerasish": False}
    assert deferred_imports(root, "pkg") == ["pkg.heavy:4 pkg"]
