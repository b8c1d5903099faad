"""What a run prints: phases with their times, lines within 120 columns."""
import re

import pytest

from tftrain.core import console


def test_a_phase_says_when_it_starts_and_ends_and_keeps_its_seconds(capsys, monkeypatch):
    monkeypatch.setattr(console, "PHASE_SECONDS", {})
    with console.phase("export", "converting") as note:
        note["detail"] = "2 of 2 verified"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[export] converting..."
    assert re.fullmatch(r"\[export\] done in \d\.\d s: 2 of 2 verified", lines[1]), lines
    # a phase whose result reports its time (the preflight's plan line) ends silently
    with console.phase("preflight", "converting every export", ended=False):
        pass
    assert capsys.readouterr().out.splitlines() == ["[preflight] converting every export..."]
    assert set(console.PHASE_SECONDS) == {"export", "preflight"}
    with pytest.raises(KeyError), console.phase("preflight", ended=False):
        raise KeyError
    assert re.fullmatch(r"\[preflight\] \.\.\.\n\[preflight\] stopped after \d\.\d s\n",
                        capsys.readouterr().out)


def test_a_long_line_wraps_at_120_columns_with_its_words_whole():
    text = " ".join(["word"] * 40)
    lines = console.wrap(text).splitlines()
    assert len(lines) == 2 and all(len(line) <= 120 for line in lines)
    assert lines[1].startswith("    word") and console.wrap("short") == "short"


def test_a_problem_of_several_lines_has_its_prefix_once_and_every_line_within_120_columns():
    from tftrain.core import console
    text = "model.name: " + "/very/long/path/" * 5 + " is bad:\ndetail one\n" + "word " * 40
    lines = console.problem("tftrain: config error: ", text).splitlines()
    assert lines[0].startswith("tftrain: config error: model.name:")
    assert sum("config error" in line for line in lines) == 1
    assert all(len(line) <= 120 for line in lines) and all(line.startswith("    ") for line in lines[1:])
    assert "    detail one" in lines
    # one line stays one line, however long (scripts read a problem per line)
    assert console.problem("p: ", "x" * 300) == "p: " + "x" * 300


def test_a_list_of_parts_is_one_problem_with_the_rest_counted():
    from tftrain.core import console
    assert console.listed("head:", ["only"]) == "head: only"
    assert console.listed("head:", ["a", "b"], most=2) == "head:\na\nb"
    assert console.listed("head:", list("abcde"), most=3) == "head:\na\nb\nand 3 more"
