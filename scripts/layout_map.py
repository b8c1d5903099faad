"""The package's layout map in CONTRIBUTING.md, generated from the tree: each package
and module with the first line of its docstring, in the order packages may import each
other (tests/test_layout.py checks the map is current).

    python scripts/layout_map.py            # rewrite the map in CONTRIBUTING.md
    python scripts/layout_map.py --print    # print it
"""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
BEGIN, END = "<!-- layout:begin -->", "<!-- layout:end -->"
# packages in the order they may import each other (as tests/test_layout.py's ORDER)
PACKAGES = ["core", "optim", "config", "data", "models", "runtime", "training", "compress",
            "export", "stages"]


def _summary(path: Path, width: int = 88) -> str:
    """The first sentence of a module's docstring, cut to `width` characters."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = re.split(r"(?<=[a-z)`'?])[.]\s+(?=[A-Z`(])", " ".join(doc.split("\n\n")[0].split()))[0]
    first = first.rstrip(".")
    if len(first) > width:
        first = first[:width].rsplit(" ", 1)[0].rstrip(",;:(") + " ..."
    return first


def layout() -> str:
    pkg = ROOT / "tftrain"
    rows = ["```", "tftrain/"]
    for path in sorted(pkg.glob("*.py")):
        rows.append(f"  {path.name:<24} {_summary(path)}")
    for name in PACKAGES:
        rows.append(f"  {name + '/':<24} {_summary(pkg / name / '__init__.py')}")
        for path in sorted((pkg / name).glob("*.py")):
            if path.name != "__init__.py":
                rows.append(f"    {path.name:<22} {_summary(path)}")
    rows.append("```")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the map, write nothing")
    args = parser.parse_args(argv)
    if args.print:
        print(layout())
        return 0
    text = CONTRIBUTING.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    CONTRIBUTING.write_text(f"{head}{BEGIN}\n{layout()}\n{END}{tail}")
    print(f"{CONTRIBUTING.relative_to(ROOT)}: layout map written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
