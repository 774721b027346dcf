"""`mmfsdp.config.foreign`: another schema's keys translated into ours before the strict builder."""

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from mmfsdp.config import Alias, ConfigError, Ignored, Translate, build, foreign_entries, load_translated, translate


@dataclass(kw_only=True, slots=True)
class Loss:
    kind: str = "mean"
    """Normalisation."""

    foreign_keys: ClassVar[dict] = {
        "kind": Alias(values={"per_token_loss": "token"}),
        "offload": Ignored("stays", allowed=(False,)),
    }


@dataclass(kw_only=True, slots=True)
class Model:
    size: int = 1
    """Size."""
    loss: Loss = field(default_factory=Loss)
    """Loss."""

    foreign_keys: ClassVar[dict] = {
        "width": Alias("model.size"),
        "plugin": Ignored("code is registered"),
        "prof.start": Alias("tools.start"),
        "prof.level": Ignored("another profiler"),
        "old_loss": Alias("model.loss"),
        "pair": Translate(lambda value, section, path: {"model.size": value[0], "tools.start": value[1]}, "two keys"),
        "sized": Translate(lambda value, section, path: {"model.size": value, "tools.start": 1}, "and a constant"),
    }


@dataclass(kw_only=True, slots=True)
class Tools:
    start: int = 0
    """Start."""


@dataclass(kw_only=True, slots=True)
class Root:
    model: Model = field(default_factory=Model)
    """Model."""
    tools: Tools = field(default_factory=Tools)
    """Tools."""


def _built(data: dict) -> Root:
    return build(Root, translate(Root, data).data)


def test_aliases_move_values_and_translate_value_names():
    out = translate(
        Root, {"model": {"width": 4, "prof": {"start": 2, "level": "l1"}, "loss": {"kind": "per_token_loss"}}}
    )
    assert out.data == {"model": {"size": 4, "loss": {"kind": "token"}}, "tools": {"start": 2}}
    assert out.ignored == [("model.prof.level", "another profiler")]
    assert ("model.width", "model.size") in out.renamed


def test_a_moved_section_is_translated_again_where_it_lands():
    assert _built({"model": {"old_loss": {"kind": "per_token_loss", "offload": False}}}).model.loss.kind == "token"


def test_translate_returns_several_targets():
    root = _built({"model": {"pair": [3, 5]}})
    assert (root.model.size, root.tools.start) == (3, 5)


def test_conflicts_and_disallowed_values_are_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"^model\.width: 4 conflicts with model\.size: 2"):
        translate(Root, {"model": {"size": 2, "width": 4}})
    assert translate(Root, {"model": {"size": 2, "width": 2}}).data == {"model": {"size": 2}}
    with pytest.raises(
        ConfigError, match=r"^model\.loss\.offload: True is not supported: stays; remove the key or set it to false"
    ):
        translate(Root, {"model": {"loss": {"offload": True}}})
    with pytest.raises(ConfigError, match=r"^model\.prof\.levle: unknown key \(did you mean 'model\.prof\.level'\?\)"):
        translate(Root, {"model": {"prof": {"levle": 1}}})


def test_unknown_keys_are_left_for_build_with_hints_over_both_schemas():
    out = translate(Root, {"model": {"widht": 3}})
    assert out.data == {"model": {"widht": 3}}
    with pytest.raises(
        ConfigError, match=r"^model\.widht: unknown key \(did you mean 'model\.width'\?\); valid keys here: size, loss$"
    ):
        build(Root, out.data)


def test_file_with_anchors_and_overrides_in_either_spelling(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("SIZE: &SIZE 7\nNOTE: plain\nmodel:\n  width: *SIZE\n  plugin: [x]\n")
    with pytest.raises(ConfigError):
        build(Root, load_translated(Root, path).data)  # NOTE holds no anchor: an unknown key
    path.write_text("SIZE: &SIZE 7\nmodel:\n  width: *SIZE\n  plugin: [x]\n")
    out = load_translated(Root, path)
    assert build(Root, out.data).model.size == 7
    assert [key for key, _ in out.ignored] == ["SIZE", "model.plugin"]
    assert "SIZE, " not in out.warning() and "SIZE (holds only a YAML anchor" in out.warning()
    for override in ("model.size=9", "model.width=9"):
        assert build(Root, load_translated(Root, path, [override]).data).model.size == 9
    assert build(Root, load_translated(Root, path, ["model.loss.kind=per_token_loss"]).data).model.loss.kind == "token"
    sized = build(Root, load_translated(Root, path, ["model.sized=3"]).data)  # an override sets every key it becomes
    assert (sized.model.size, sized.tools.start) == (3, 1)
    section = load_translated(Model, path, ["model.width=5", "tools.start=1"], section="model")
    assert build(Model, section.data, "model").size == 5


def test_foreign_entries_lists_every_table():
    assert [path for path, _ in foreign_entries(Root)][:3] == ["model.width", "model.plugin", "model.prof.start"]
    assert "model.loss.kind" in [path for path, _ in foreign_entries(Root)]
