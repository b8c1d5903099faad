"""The benchmark harness: every documented figure needs the entry its command wrote."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil

import pytest

from helpers import ROOT


def _harness():
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "__main__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _complete(harness) -> dict:
    """An entry, written by its command on a named machine, for every documented benchmark."""
    return {name: {"date": "2026-12-05", "machine": "AMD EPYC, 2 cores",
                   "command": " ".join([f"python benchmarks/{name}.py",
                                        *harness.SCRIPTS.get(name, [])]),
                   "rows": [{"figure": f"{name} figure", "value": "1.0"}]}
            for name in harness.cited()}


def test_the_documented_benchmarks_are_the_tables_and_those_the_pages_cite():
    harness = _harness()
    cited = harness.cited()
    assert set(harness.SCRIPTS) <= set(cited)
    assert "docs/compression_search.md" in cited["search"] and "docs/compression.md" in cited["fallback"]
    assert harness.missing(_complete(harness)) == []


def test_the_table_fails_when_a_documented_figure_is_removed_or_copied(tmp_path, monkeypatch):
    harness = _harness()
    table = tmp_path / "performance.md"
    shutil.copy(ROOT / "docs" / "performance.md", table)
    monkeypatch.setattr(harness, "TABLE", table)
    # (the docs' ratios against the entries: `unrecorded`, tested below)
    monkeypatch.setattr(harness, "unrecorded", lambda results: [])
    complete = _complete(harness)
    for name, broken in [("search", {k: v for k, v in complete.items() if k != "search"}),
                         ("planner", {**complete, "planner": {**complete["planner"],
                                                              "note": "copied from README once"}})]:
        path = tmp_path / f"results-{name}.json"
        path.write_text(json.dumps(broken))
        monkeypatch.setattr(harness, "RESULTS", path)
        with pytest.raises(SystemExit) as err:
            harness.main(["--table"])
        lines = [line for line in str(err.value).splitlines() if line.startswith("  ")]
        assert len(lines) == 1 and lines[0].startswith(f"  {name}: "), err.value
    path = tmp_path / "results.json"
    path.write_text(json.dumps(complete))
    monkeypatch.setattr(harness, "RESULTS", path)
    harness.main(["--table"])                  # complete: the table written, no exit


def test_an_entry_names_the_machine_with_its_bfloat16_and_int8_instructions(monkeypatch):
    """bfloat16 and int8 speed flip with the CPU's instructions: the machine an entry
    names says which it has."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("benchmarks.record", None)
    from benchmarks import record
    harness = _harness()
    flags = "flags\t: fpu avx2 avx512f avx512_vnni\n"
    monkeypatch.setattr(record.Path, "read_text", lambda self: flags)
    assert harness.machine().split(" cores ")[1].startswith("(avx512_vnni)")
    flags = "flags\t: fpu avx2\n"
    assert "(no AVX-512 BF16/VNNI)" in harness.machine()


def test_an_entry_whose_command_the_harness_does_not_run_is_named():
    harness = _harness()
    complete = _complete(harness)
    assert harness.missing(complete) == []
    edited = {**complete, "overhead": {**complete["overhead"],
                                       "command": "python benchmarks/overhead.py --rounds 1"}}
    assert harness.missing(edited) == [
        "overhead: its entry's command ('python benchmarks/overhead.py --rounds 1') is not one "
        "python -m benchmarks runs; run python -m benchmarks overhead"]
    other = {**complete, "overhead:short": {**complete["overhead"],
                                            "command": "python benchmarks/pipeline.py"}}
    assert harness.missing(other)[0].startswith("overhead:short: its entry's command")


def test_a_ratio_written_beside_a_benchmark_that_its_entries_lack_is_named(tmp_path):
    """The docs' speed ratios beside a benchmark's command are its entries' figures: as
    committed, every one is; a figure from another run (in a list item or a paragraph,
    not in a table) is named with its page."""
    harness = _harness()
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    assert harness.unrecorded(results) == []
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Intro.\n")
    ratio = re.search(r"\d+\.\d+", results["overhead"]["rows"][0]["value"]).group()
    (tmp_path / "docs" / "page.md").write_text(
        f"- Measured by `python -m benchmarks overhead`: {ratio}x as fast.\n"
        "- Another run of `python benchmarks/overhead.py` gave 9.87x.\n\n"
        "| table | 5.55x |\n\nNo benchmark cited here: 7.77x.\n")
    assert harness.unrecorded(results, tmp_path) == [
        "docs/page.md: 9.87x, beside overhead, is in none of its entries; rerun the "
        "benchmark or take the figure out"]


def _module_attributes(source: str) -> list[tuple[str, str]]:
    """(tftrain module, attribute) for every `alias.name` a script reads from a tftrain
    module it imported (`from tftrain.x import y` where y is a module, `import tftrain.x as y`)."""
    import ast
    import importlib
    import types

    tree = ast.parse(source)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tftrain"):
            for name in node.names:
                full = f"{node.module}.{name.name}"
                try:
                    if isinstance(importlib.import_module(full), types.ModuleType):
                        aliases[name.asname or name.name] = full
                except ImportError:
                    pass                     # a function or class, not a module
        elif isinstance(node, ast.Import):
            for name in node.names:
                if name.name.startswith("tftrain") and name.asname:
                    aliases[name.asname] = name.name
    return [(aliases[n.value.id], n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in aliases]


def test_every_tftrain_name_a_benchmark_or_script_reads_exists():
    """The benchmarks and scripts run outside the tests: a name they read from a tftrain
    module that has moved (`epoch_logs.InputWait`, once) fails here, not hours into a
    benchmark."""
    import importlib
    planted = _module_attributes("from tftrain.training import epoch_logs\n"
                                 "epoch_logs.InputWait()\nepoch_logs.Throughput(1)\n")
    assert planted == [("tftrain.training.epoch_logs", "InputWait"),
                       ("tftrain.training.epoch_logs", "Throughput")]
    assert not hasattr(importlib.import_module(planted[0][0]), planted[0][1])
    missing = []
    for path in sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        for module, attr in _module_attributes(path.read_text()):
            if not hasattr(importlib.import_module(module), attr):
                missing.append(f"{path.relative_to(ROOT)}: {module}.{attr}")
    assert missing == []
