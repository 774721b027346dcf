import pytest
from torch import nn

from mmfsdp.config import ConfigError
from mmfsdp.parallel import compile_module_pattern, match_module_names


def _model() -> nn.Module:
    layer = lambda: nn.ModuleDict({"self_attn": nn.Linear(2, 2), "mlp": nn.Linear(2, 2)})  # noqa: E731
    model = nn.Module()
    model.vision = nn.ModuleDict({"blocks": nn.ModuleList(layer() for _ in range(3))})
    model.language_model = nn.ModuleDict({"layers": nn.ModuleList(layer() for _ in range(12)), "norm": nn.LayerNorm(2)})
    model.lm_head = nn.Linear(2, 2)
    return model


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("layers.{*}", "layers.0", True),
        ("layers.{*}", "layers.17", True),
        ("layers.{*}", "layers.x", False),
        ("layers.{*}", "layers.3.mlp", False),
        ("layers.{*}", "model.layers.3", False),
        ("layers.{*}", "layers.", False),
        ("layers.{*}.mlp", "layers.3.mlp", True),
        ("layers.{2-4}", "layers.2", True),
        ("layers.{2-4}", "layers.4", True),
        ("layers.{2-4}", "layers.5", False),
        ("layers.{2-4}", "layers.1", False),
        ("layers.{0-10}", "layers.10", True),
        ("layers.{0-10}", "layers.01", False),
        ("a.b", "a.b", True),
        ("a.b", "aXb", False),
        ("{*}.{1-1}", "7.1", True),
        ("{*}.{1-1}", "7.2", False),
        ("lm_head", "lm_head", True),
        ("lm_head", "lm_head2", False),
    ],
)
def test_parallel_pattern_full_name_match(pattern, name, expected):
    assert compile_module_pattern(pattern).matches(name) is expected


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("layers.{3-1}", "empty"),
        ("layers.{x}", "not an index pattern"),
        ("layers.{}", "not an index pattern"),
        ("layers.{1-}", "not an index pattern"),
        ("layers.{*", "unmatched brace"),
        ("layers.*}", "unmatched brace"),
        ("", "empty module pattern"),
    ],
)
def test_parallel_malformed_patterns_are_config_errors(pattern, words):
    with pytest.raises(ConfigError) as err:
        compile_module_pattern(pattern, key="parallel.fsdp_plan.apply_modules[0]")
    assert err.value.key == "parallel.fsdp_plan.apply_modules[0]"
    assert words in err.value.message


def test_parallel_match_module_names_in_model_order_each_once():
    names = match_module_names(_model(), ["lm_head", "language_model.layers.{10-11}", "vision.blocks.{*}", "vision.blocks.{1-2}"])
    assert names == ["vision.blocks.0", "vision.blocks.1", "vision.blocks.2", "language_model.layers.10", "language_model.layers.11", "lm_head"]


def test_parallel_empty_pattern_list_matches_nothing():
    assert match_module_names(_model(), []) == []
    assert match_module_names(_model(), ["lm_head"]) == ["lm_head"]


def test_parallel_unmatched_pattern_names_the_key_and_similar_modules():
    with pytest.raises(ConfigError) as err:
        match_module_names(_model(), ["lm_head", "language_model.layer.{*}"], key="parallel.fsdp_plan.apply_modules")
    assert err.value.key == "parallel.fsdp_plan.apply_modules[1]"
    assert "matches no module" in err.value.message
    assert "language_model.layers.{*}" in err.value.message


def test_parallel_range_beyond_the_model_is_an_error_when_nothing_matches():
    with pytest.raises(ConfigError, match=r"patterns\[0\].*language_model\.layers\.\{\*\}"):
        match_module_names(_model(), ["language_model.layers.{40-47}"])
