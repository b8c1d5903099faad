"""Builder parameters checked from the builder's source, before TensorFlow loads."""
import subprocess
import sys

import pytest

from helpers import ROOT
from tftrain.config import ConfigError, load_config
from tftrain.config.builders import Param, expected, find

USER = '''
raise RuntimeError("importing this module runs code; the check must not")


def build(spec, width: int = 8, sizes: tuple[int, ...] = (3, 3), rate: float | None = None,
          name="net", flag=False, *, extra: "Optional[str]" = None):
    pass


def open_ended(spec, depth=2, **kwargs):
    pass
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('the package runs code too')\n")
    (package / "nets.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mypkg.nets"


def test_a_user_builder_is_read_without_running_its_module(user_module):
    signature = find(f"{user_module}:build")
    assert [p.name for p in signature.params] == ["width", "sizes", "rate", "name", "flag", "extra"]
    assert signature.params[1] == Param("sizes", "tuple[int, ...]", (3, 3))
    assert not signature.var_keyword and find(f"{user_module}:open_ended").var_keyword
    assert find(f"{user_module}:missing") is None and find("no.such.module:fn") is None


@pytest.mark.parametrize("params,line", [
    ({"width": "wide"}, "model.params.width: 'wide' is not an int (mypkg.nets:build in {path} "
                        "declares width: int)"),
    ({"sizes": [3, "a"]}, "model.params.sizes: [3, 'a'] is not a list of ints (mypkg.nets:build "
                          "in {path} declares sizes: tuple[int, ...])"),
    ({"rate": "fast"}, "model.params.rate: 'fast' is not a number or null (mypkg.nets:build in "
                       "{path} declares rate: float | None)"),
    ({"flag": 1}, "model.params.flag: 1 is not true or false (mypkg.nets:build in {path} "
                  "defaults it to False)"),
    ({"extra": 3}, "model.params.extra: 3 is not a string or null (mypkg.nets:build in {path} "
                   "declares extra: Optional[str])"),
    ({"widht": 3}, "model.params.widht: unknown parameter of mypkg.nets:build in {path}; did "
                   "you mean width?"),
])
def test_a_wrong_parameter_is_a_config_error_naming_it(user_module, params, line, tmp_path):
    path = tmp_path / "mypkg" / "nets.py"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model={{name: '{user_module}:build', params: {params}}}"])
    assert err.value.problems == [line.format(path=path)]


def test_right_parameters_and_open_ended_builders_pass(user_module):
    load_config(None, [f"model={{name: '{user_module}:build', params: {{width: 4, sizes: [1, 2], "
                       "rate: 0.5, name: x, flag: true, extra: null}}"])
    load_config(None, [f"model={{name: '{user_module}:open_ended', params: {{anything: 1}}}}"])


def test_bundled_builders_and_students_are_checked_by_their_registered_name():
    with pytest.raises(ConfigError, match=r"model\.params\.filters: 'abc' is not a list of ints "
                                          r"\(cnn in tftrain/models/cnn\.py defaults it to \(32, 64\)\)"):
        load_config(None, ["model.params.filters=abc"])
    with pytest.raises(ConfigError, match=r"compression\.distillation\.student\.params\.hidden: "
                                          r"'x' is not a list of ints \(mlp in tftrain/models/mlp\.py"):
        load_config(None, ["compression.distillation={enabled: true, student: {name: mlp, "
                           "params: {hidden: x}}}"])
    assert find("keras_applications:MobileNetV2") is None       # keyword arguments: at build


def test_kinds_from_defaults_and_annotations():
    assert expected(Param("a", None, None)) is None and expected(Param("a", "SomeType", 1)) is None
    check, text = expected(Param("k", None, 3))
    assert check(3) and check([3, 5]) and not check(True) and text == "an int or a list of ints"
    check, _ = expected(Param("d", None, 0.5))
    assert check(0) and check(0.1) and not check("0.1") and not check(False)


def test_the_check_runs_before_tensorflow_is_imported():
    probe = ("import sys; from tftrain.run import main; code = main(['configs/quickstart.yaml', "
             "'--set', 'model.params.filters=abc']); print('tensorflow' in sys.modules); "
             "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout.strip() == "False", proc.stderr[-2000:]
    assert "model.params.filters: 'abc' is not a list of ints" in proc.stderr


def test_a_model_file_that_does_not_exist_is_named_before_its_parameters():
    """`model.name: file:PATH` for a missing file: the file is the problem, not the
    quickstart's `model.params` (a file's model takes none)."""
    from tftrain.config import ConfigError, load_config
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.name=file:/no/such/model.keras"])
    assert err.value.problems == ["model.name: /no/such/model.keras does not exist; give the "
                                  "path of a .keras or .h5 file or a SavedModel directory"]
