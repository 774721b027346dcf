"""Data choices left null are the model family's: the trainer's config fills the template and the collator with the
first of each the entry lists (`DataNames`); the data package has no default of its own."""

import pytest

from mmfsdp.config import build
from mmfsdp.train.config import Config

PRE = "data.dataset_param.preprocess_parameters"


def _names(cfg: Config) -> tuple[str | None, str | None]:
    return cfg.data.dataset_param.preprocess_parameters.template, cfg.data.dataloader_param.collate_param.model_name


@pytest.mark.parametrize(
    "model_id, template, collator",
    [
        ("mistral3", "mistral", "pixtral"),
        ("qwen3_vl", "qwen3_vl", "qwen3_vl"),
        ("qwen3_vl_moe", "qwen3_vl", "qwen3_vl"),
    ],
)
def test_null_template_and_collator_are_the_familys_first(model_id, template, collator):
    assert _names(build(Config, {"model": {"model_id": model_id}}, "")) == (template, collator)


def test_a_named_choice_is_kept():
    raw = {
        "model": {"model_id": "qwen3_vl"},
        "data": {
            "dataset_param": {"preprocess_parameters": {"template": "qwen3_vl_nothink"}},
            "dataloader_param": {"collate_param": {"model_name": "qwen3vl"}},
        },
    }
    assert _names(build(Config, raw, "")) == ("qwen3_vl_nothink", "qwen3vl")


def test_without_a_model_id_nothing_is_filled():
    assert _names(build(Config, {}, "")) == (None, None)
