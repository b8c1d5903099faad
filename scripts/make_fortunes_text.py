"""Text classification data from the `fortunes` Debian package: one folder per category
(computers, politics, science, law by default), one .txt file per fortune.

    python scripts/make_fortunes_text.py --out data/fortunes [--categories computers law]
    python scripts/make_fortunes_text.py --out data/fortunes.tsv --format tsv

Needs the `fortunes` Debian package (`apt-get install fortunes`).
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path("/usr/share/games/fortunes")
CATEGORIES = ["computers", "politics", "science", "law"]


def read_category(name: str) -> list[str]:
    path = ROOT / name
    if not path.exists():
        sys.exit(f"make_fortunes_text: {path} not found; apt-get install fortunes")
    text = path.read_text(encoding="utf-8", errors="replace")
    return [entry.strip() for entry in text.split("\n%\n") if entry.strip() and entry.strip() != "%"]


def make(out: Path, categories=CATEGORIES, fmt: str = "folders") -> int:
    rows = [(entry, name) for name in categories for entry in read_category(name)]
    if fmt == "folders":
        for name in categories:
            (out / name).mkdir(parents=True, exist_ok=True)
        counts = {name: 0 for name in categories}
        for entry, name in rows:
            (out / name / f"{counts[name]:05d}.txt").write_text(entry + "\n", encoding="utf-8")
            counts[name] += 1
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, delimiter="\t" if fmt == "tsv" else ",")
            writer.writerow(["text", "label"])
            writer.writerows(rows)
    return len(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--categories", nargs="+", default=CATEGORIES)
    parser.add_argument("--format", choices=["folders", "csv", "tsv"], default="folders")
    args = parser.parse_args(argv)
    n = make(args.out, args.categories, args.format)
    print(f"wrote {n} fortunes in {len(args.categories)} categories to {args.out}")


if __name__ == "__main__":
    main()
