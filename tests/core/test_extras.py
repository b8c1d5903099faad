"""Optional extras: a config that needs a package not installed is a config error naming
the extra (exit 2, nothing written)."""

import importlib.util

import pytest
from helpers import ROOT

from tftrain import run
from tftrain.core import extras
from tftrain.config import ConfigError, load_config


@pytest.fixture
def without(monkeypatch):
    """Hide the given top-level packages from `importlib.util.find_spec`."""
    hidden = set()
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.split(".")[0] in hidden else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return hidden


def test_onnx_without_its_packages_names_the_extra(without):
    without.add("tf2onnx")
    with pytest.raises(ConfigError) as err:
        extras.require(load_config(None, ["export.onnx=true"]))
    assert err.value.problems == ['export.onnx: needs tf2onnx, not installed: pip install -e '
                                  '".[onnx]" (or set export.onnx: false)']
    extras.require(load_config(None, ["export.onnx=false"]))            # not asked: fine


def test_mlflow_without_its_package_names_the_extra(without):
    without.add("mlflow")
    with pytest.raises(ConfigError, match=r'tracking.mlflow: needs mlflow.*\.\[mlflow\]'):
        extras.require(load_config(None, ["tracking.mlflow={uri: 'sqlite:///x.db'}"]))


def test_the_cli_exits_2_before_writing_anything(without, tmp_path, capsys):
    without.update({"tf2onnx", "onnxruntime"})
    code = run.main(["--set", "export.onnx=true", "--set", f"run.dir={tmp_path}",
                     "--set", "run.name=x", str(ROOT / "configs/quickstart.yaml")])
    assert code == 2 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.strip() == (
        'tftrain: config error: export.onnx: needs tf2onnx, onnxruntime, not installed: '
        'pip install -e ".[onnx]" (or set export.onnx: false)')
