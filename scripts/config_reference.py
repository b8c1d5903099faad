"""Write docs/config.md's reference table from the config schema and its descriptions
(`tftrain.config.reference`), the same as `python -m tftrain.run --schema` describes.

    python scripts/config_reference.py            # rewrite the table in docs/config.md
    python scripts/config_reference.py --print    # print it
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- reference:begin -->", "<!-- reference:end -->"


def table() -> str:
    from tftrain.config import Config, dump_config, json_schema
    from tftrain.config.reference import leaves

    defaults = yaml.safe_load(dump_config(Config()))
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, node in leaves(json_schema()).items():
        value = defaults
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        shown = ("" if isinstance(value, dict) else "null" if value is None
                 else f"`{str(value).lower() if isinstance(value, bool) else value}`")
        rows.append(f"| `{key}` | {shown} | {node['description']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = table()
    if "--print" in argv:
        print(text)
        return 0
    page = ROOT / "docs" / "config.md"
    old = page.read_text()
    start, end = old.index(BEGIN) + len(BEGIN), old.index(END)
    page.write_text(old[:start] + "\n" + text + "\n" + old[end:])
    print("docs/config.md: reference table written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
