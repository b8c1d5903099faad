"""The documents: README as a short front door, every link between README,
CONTRIBUTING.md and the pages under docs/ leading to a file and a heading that exist,
and CONTRIBUTING's layout map generated from the current tree."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.+)$", line)):
            found.add(slug(m.group(1)))
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_leads_to_a_file_and_a_heading_that_exist(page):
    assert links(page) or page.name != "README.md"
    for target in links(page):
        name, _, anchor = target.partition("#")
        file = (page.parent / name).resolve() if name else page
        assert file.exists(), f"{page.name}: {target}: no such file"
        if anchor:
            assert anchor in anchors(file), f"{page.name}: {target}: no such heading"


def test_the_checker_finds_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Some part\n\n[ok](#some-part) [b](b.md#x)\n"
                                   "[gone](c.md) [web](https://example.com)\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert links(tmp_path / "a.md") == ["#some-part", "b.md#x", "c.md"]
    assert anchors(tmp_path / "a.md") == {"title", "some-part"}
    with pytest.raises(AssertionError, match="no such heading"):
        test_every_link_leads_to_a_file_and_a_heading_that_exist(tmp_path / "a.md")


def test_readme_is_a_front_door_to_every_page():
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) <= 150
    assert "`fn(spec, **params)`" in text                  # the builder's signature
    assert "python -m tftrain.run configs/quickstart.yaml" in text
    sample = text.split("## What a run prints")[1].split("## ")[0]
    assert all(part in sample for part in ("[train] done in", "report ", "tensorboard --logdir"))
    assert not re.search(r"\b[0-9a-f]{7,40}\b", text.replace("sha256", ""))   # no commit hashes
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme)}
    assert set(PAGES[1:]) <= linked                     # CONTRIBUTING and every docs/ page


def test_contributings_layout_map_is_the_trees():
    printed = subprocess.run([sys.executable, str(ROOT / "scripts" / "layout_map.py"), "--print"],
                             capture_output=True, text=True, check=True).stdout.strip()
    text = (ROOT / "CONTRIBUTING.md").read_text()
    current = text.split("<!-- layout:begin -->")[1].split("<!-- layout:end -->")[0].strip()
    assert current == printed, "run python scripts/layout_map.py"


@pytest.mark.slow
def test_the_docs_state_the_matrix_and_the_test_counts_as_they_are():
    """CONTRIBUTING's matrix figures are the matrix's, and every test count README
    states is one CONTRIBUTING's tier table states (they disagreed: 548 against 541)."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("matrix", ROOT / "tests" / "e2e" / "test_matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert f"{len(matrix.ROWS)} configs covering every pair" in contributing, len(matrix.ROWS)
    assert f"The {len(matrix.REFUSED)} combinations that cannot run" in contributing
    table = "\n".join(line for line in contributing.splitlines() if line.startswith("| "))
    stated = {int(n.replace(",", "")) for n in re.findall(r"\| (\d[\d,]*)(?: \(| \|)", table)}
    readme = (ROOT / "README.md").read_text()
    for count in re.findall(r"(\d[\d,]*) tests\b", readme):
        assert int(count.replace(",", "")) in stated, count


def test_every_config_key_is_described_in_the_schema_and_the_docs_alike():
    """The schema and docs/config.md describe every key, from one place
    (`tftrain.config.reference`): a key without a description, a description of a key
    that is gone, or a docs table behind the schema fails."""
    import importlib.util

    from tftrain.config import json_schema
    from tftrain.config.reference import DESCRIPTIONS, leaves

    keys = leaves(json_schema())
    assert [k for k, node in keys.items() if not node.get("description")] == []
    assert sorted(set(DESCRIPTIONS) - set(keys)) == []
    spec = importlib.util.spec_from_file_location("reference", ROOT / "scripts" / "config_reference.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = (ROOT / "docs" / "config.md").read_text()
    documented = page[page.index(script.BEGIN) + len(script.BEGIN):page.index(script.END)]
    assert documented.strip() == script.table(), "run python scripts/config_reference.py"
