"""The command line's surface, to compare before and after a change that must not alter
it (a restructuring): `python -m tftrain.run --schema` and `--dry-run` of every
`configs/*.yaml`, each run in a fresh process from the checkout it is started in.

    python scripts/cli_surface.py > before.txt          # on the old tree
    python scripts/cli_surface.py --compare before.txt  # on the new tree: exit 1 on a difference

Measured seconds (how long the export preflight took) and the device memory free at the
moment (the planner reads it) differ run to run and are masked.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECONDS = re.compile(r"\b\d+(\.\d+)? s\b")
FREE = re.compile(r"device memory \d+(\.\d+)? GiB")


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "tftrain.run", *args], cwd=ROOT,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return f"$ tftrain.run {' '.join(args)}\nexit {proc.returncode}\n{_masked(proc.stdout)}"


def _masked(printed: str) -> str:
    return FREE.sub("device memory <free> GiB", SECONDS.sub("<s> s", printed))


def surface() -> str:
    parts = [_run("--schema")]
    parts += [_run(f"configs/{path.name}", "--dry-run")
              for path in sorted((ROOT / "configs").glob("*.yaml"))]
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="a file this script wrote before")
    args = parser.parse_args(argv)
    now = surface()
    if args.compare is None:
        sys.stdout.write(now)
        return 0
    before = _masked(args.compare.read_text())     # (a file written before the masks)
    diff = list(difflib.unified_diff(before.splitlines(), now.splitlines(), "before", "now",
                                     lineterm=""))
    configs = len(list((ROOT / "configs").glob("*.yaml")))
    print("\n".join(diff) if diff else f"identical: --schema and --dry-run of {configs} configs")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
