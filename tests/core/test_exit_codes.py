"""Exit codes and run statuses are named once (`core/exit_codes.py`): no command returns or
exits with a bare number, and each command's help names every code it returns."""
import ast

import pytest
from helpers import ROOT

from tftrain.core import exit_codes

COMMANDS = ["tftrain/run.py", "tftrain/launch.py", "tftrain/sweep.py", "tftrain/doctor.py",
            "tftrain/search/__main__.py", "tftrain/search/runner.py", "tftrain/data/service.py",
            "tftrain/runtime/forking.py"]
EXITS = ("sys.exit", "os._exit", "exit", "SystemExit")


def bare_exit_codes(source: str) -> list[str]:
    """Each `return N`, `sys.exit(N)`/`os._exit(N)` and comparison with a tuple of
    numbers (`code in (0, 3)`) written with a bare integer."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant) and \
                type(node.value.value) is int:
            found.append(f"{node.lineno}: return {node.value.value}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in EXITS and node.args and \
                isinstance(node.args[0], ast.Constant) and type(node.args[0].value) is int:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and any(
                isinstance(c, (ast.Tuple, ast.Set, ast.List)) and c.elts and all(
                    isinstance(e, ast.Constant) and type(e.value) is int for e in c.elts)
                for c in node.comparators) and "code" in ast.unparse(node.left):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", COMMANDS)
def test_no_command_returns_a_bare_exit_code(path):
    assert bare_exit_codes((ROOT / path).read_text()) == []


def test_the_check_sees_a_bare_exit_code():
    text = ("import sys\ndef main():\n    if x:\n        return 2\n    if code in (0, 3):\n"
            "        sys.exit(1)\n    return exit_codes.OK\n")
    assert bare_exit_codes(text) == ["4: return 2", "5: code in (0, 3)", "6: sys.exit(1)"]


def test_the_run_commands_help_names_every_exit_code(capsys):
    from tftrain.run import main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for code in (exit_codes.OK, exit_codes.RUNTIME, exit_codes.CONFIG, exit_codes.TARGET_MISSED,
                 exit_codes.PREEMPTED):
        assert f"{code} " in text, code
