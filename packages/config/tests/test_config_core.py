from dataclasses import dataclass, field
from typing import Literal

import pytest

from mmfsdp.config import ConfigError, apply_overrides, build, dump_yaml, load_yaml, parse_override


@dataclass(kw_only=True, slots=True)
class Plan:
    apply_modules: list[str] | None = None
    """Patterns."""
    param_dtype: Literal["fp32", "bf16"] | None = None
    """Dtype."""


@dataclass(kw_only=True, slots=True)
class Section:
    size: int | Literal["auto"] = "auto"
    """A size."""
    lr: float = 1e-3
    """A rate."""
    flag: bool = False
    """A flag."""
    plan: Plan = field(default_factory=Plan)
    """Nested."""

    def __post_init__(self):
        if isinstance(self.size, int) and self.size < 1:
            raise ConfigError("size", f"must be >= 1, got {self.size}")


@dataclass(kw_only=True, slots=True)
class Root:
    section: Section = field(default_factory=Section)
    """The section."""


def test_builds_nested_sections_with_defaults():
    cfg = build(Root, {"section": {"size": 4, "lr": "1e-5", "plan": {"apply_modules": ["a.{*}"]}}})
    assert cfg.section.size == 4
    assert cfg.section.lr == pytest.approx(1e-5)
    assert cfg.section.plan.apply_modules == ["a.{*}"]
    assert cfg.section.plan.param_dtype is None
    assert build(Root, {}).section.size == "auto"


def test_unknown_key_names_path_and_closest_key():
    with pytest.raises(ConfigError) as err:
        build(Root, {"section": {"plan": {"param_dtyp": "bf16"}}})
    assert str(err.value).startswith("section.plan.param_dtyp: unknown key (did you mean 'section.plan.param_dtype'?)")


def test_wrong_type_and_literal_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"^section\.flag: expected true or false, got 'yes please'"):
        build(Root, {"section": {"flag": "yes please"}})
    with pytest.raises(ConfigError, match=r"^section\.plan\.param_dtype: expected 'fp32' \| 'bf16' \| null, got 'bf32'"):
        build(Root, {"section": {"plan": {"param_dtype": "bf32"}}})
    with pytest.raises(ConfigError, match=r"^section\.size: expected int \| 'auto', got 2\.5"):
        build(Root, {"section": {"size": 2.5}})


def test_post_init_errors_get_the_section_prefix():
    with pytest.raises(ConfigError, match=r"^section\.size: must be >= 1, got 0$"):
        build(Root, {"section": {"size": 0}})


def test_overrides_are_read_as_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("section:\n  size: 2\n")
    data = load_yaml(path, ["section.lr=1e-5", "section.flag=true", "section.plan.apply_modules=[a, b]"])
    cfg = build(Root, data)
    assert cfg.section.lr == pytest.approx(1e-5) and cfg.section.flag is True
    assert cfg.section.plan.apply_modules == ["a", "b"]
    assert parse_override("a.b=3") == (["a", "b"], 3)
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides({}, ["oops"])
    with pytest.raises(ConfigError, match=r"^section\.size: is 2, not a section"):
        apply_overrides({"section": {"size": 2}}, ["section.size.x=1"])


def test_dump_round_trips():
    cfg = build(Root, {"section": {"size": 8}})
    import yaml

    assert build(Root, yaml.safe_load(dump_yaml(cfg))) == cfg


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")


def test_registry_lookup_errors_name_the_key_and_the_closest_entry():
    from mmfsdp.config import Registry

    reg = Registry("template", "data.template")
    reg.register("mistral", 1)
    assert reg.get("mistral") == 1 and "mistral" in reg and reg.names() == ["mistral"]
    with pytest.raises(ConfigError, match=r"^data\.template: unknown template 'mistrl' \(did you mean 'mistral'\?\); registered: mistral$"):
        reg.get("mistrl")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("mistral", 2)
