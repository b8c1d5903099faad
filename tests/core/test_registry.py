"""The Registry: lookups, helpful unknown-name errors, param checks."""
import pytest

from tftrain.config import ConfigError
from tftrain.core.registry import Registry, check_params, closest


def test_get_and_suggest():
    reg = Registry("widget", "parts.widget")
    reg.register("sprocket")(1)
    reg.register("gear")(2)
    assert reg.get("gear") == 2 and reg.names() == ["gear", "sprocket"]
    with pytest.raises(ConfigError, match=r"^parts\.widget: unknown widget 'sprockt'; expected one of gear, sprocket; did you mean 'sprocket'\?$"):
        reg.get("sprockt")
    with pytest.raises(ConfigError, match=r"expected one of gear, sprocket$"):
        reg.get("zzz")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("gear")(3)


def test_check_params():
    def fn(spec, width=1, depth=2):
        return spec
    check_params(fn, {"width": 3}, "model.params", skip=1)
    with pytest.raises(ConfigError, match=r"model\.params\.spec: unknown parameter"):
        check_params(fn, {"spec": 3}, "model.params", skip=1)
    with pytest.raises(ConfigError, match=r"model\.params\.dept: unknown parameter; did you mean depth\?"):
        check_params(fn, {"dept": 3}, "model.params", skip=1)
    assert closest("adm", ["adam", "sgd"]) == "adam"
