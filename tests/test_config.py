"""Config loading: YAML + overrides into frozen dataclasses, with errors naming the dotted key."""

import dataclasses
from typing import Literal

import pytest

from trace_jax.config import ConfigError, apply_overrides, from_dict, load_yaml, to_dict


@dataclasses.dataclass(frozen=True)
class Inner:
    width: int = 4
    fmt: Literal["nvfp4", "mxfp4"] = "nvfp4"

    def __post_init__(self):
        if self.width <= 0:
            raise ConfigError(f"width: {self.width} must be positive")


@dataclasses.dataclass(frozen=True)
class Outer:
    lr: float = 1e-3
    name: str = "x"
    layers: tuple[int, ...] = (1, 2)
    flag: bool = False
    inner: Inner = dataclasses.field(default_factory=Inner)
    maybe: int | None = None


def test_defaults_overrides_and_round_trip():
    data = apply_overrides({"inner": {"width": 8}}, ["lr=0.5", "inner.fmt=mxfp4", "layers=[3,4]"])
    cfg = from_dict(Outer, data)
    assert cfg == Outer(lr=0.5, layers=(3, 4), inner=Inner(width=8, fmt="mxfp4"))
    assert from_dict(Outer, to_dict(cfg)) == cfg
    assert from_dict(Outer, {"lr": 1}).lr == 1.0 and isinstance(
        from_dict(Outer, {"lr": 1}).lr, float
    )
    assert from_dict(Outer, {"maybe": None}).maybe is None


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"lrr": 1.0}, r"^lrr: unknown config key; known: flag, inner"),
        ({"lrr": 1.0, "x": 2}, r"^lrr, x: unknown config keys"),
        ({"inner": {"depth": 2}}, r"inner\.depth"),
        ({"inner": {"fmt": "fp8"}}, r"inner\.fmt: 'fp8' is not one of"),
        ({"inner": {"width": "wide"}}, r"inner\.width: expected an integer"),
        ({"inner": {"width": 0}}, r"inner\.width: 0 must be positive"),
        ({"flag": "yes"}, r"flag: expected true/false"),
        ({"layers": [1, "a"]}, r"layers\[1\]: expected an integer"),
        ({"inner": 3}, r"inner: expected a mapping"),
    ],
)
def test_bad_keys_and_values_name_the_dotted_key(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(Outer, data)


def test_exponents_without_a_point_are_numbers_in_files_and_overrides(tmp_path):
    # YAML 1.1 (PyYAML's) reads 1e-4 as a string; a learning rate written so must still load.
    file = tmp_path / "x.yaml"
    file.write_text("lr: 1e-4\nname: 1e4x\n")
    cfg = from_dict(Outer, load_yaml(file))
    assert cfg.lr == 1e-4 and cfg.name == "1e4x"
    assert from_dict(Outer, apply_overrides({}, ["lr=-5E+3"])).lr == -5e3
    with pytest.raises(ConfigError, match=r"layers\[0\]: expected an integer, got 20.0"):
        from_dict(Outer, apply_overrides({}, ["layers=[2e1, 3]"]))


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["lr"])
    with pytest.raises(ConfigError, match="lr is not a section"):
        apply_overrides({"lr": 1}, ["lr.x=2"])


def test_config_diff_names_dotted_keys_old_and_new():
    from trace_jax.config import UNSET, config_diff, flatten, format_diff

    old = {"lr": 0.001, "inner": {"width": 4, "fmt": "nvfp4"}, "layers": [1, 2], "args": {}}
    new = {"lr": 0.001, "inner": {"width": 8, "fmt": "nvfp4"}, "layers": [1, 3], "extra": True}
    assert flatten(old) == {"lr": 0.001, "inner.width": 4, "inner.fmt": "nvfp4",
                            "layers": [1, 2], "args": {}}  # fmt: skip
    diff = config_diff(old, new)
    assert diff == [
        ("args", {}, UNSET),
        ("extra", UNSET, True),
        ("inner.width", 4, 8),
        ("layers", [1, 2], [1, 3]),
    ]
    assert format_diff(diff) == (
        "args {} -> <unset>, extra <unset> -> true, inner.width 4 -> 8, layers [1, 2] -> [1, 3]"
    )
    assert config_diff(old, old) == [] and config_diff({"lr": 1}, {"lr": 1.0}) == []
