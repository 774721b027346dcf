"""The `data:` section: defaults, strict keys with key paths, cross-field checks, registry names."""

from __future__ import annotations

import dataclasses

import pytest

from mmfsdp.config import ConfigError, build
from mmfsdp.data import DataConfig, build_processor, get_plugin, get_template, prepare_dataset

QUICKSTART = {
    "dataset_param": {
        "dataset_type": "huggingface",
        "preprocess_parameters": {"model_name_or_path": "./ckpt/Magistral-Small-2509", "fix_mistral_regex": True},
        "basic_parameters": {"dataset_dir": "./data", "dataset": "./data/mllm_format_llava_instruct_data.json", "cache_dir": "./data/cache_dir"},
    },
    "dataloader_param": {"collate_param": {"model_name": "pixtral", "pad_to_multiple_of": 8}, "num_workers": 2},
}


def test_quickstart_section_builds_with_defaults():
    cfg = build(DataConfig, QUICKSTART, "data")
    pp = cfg.dataset_param.preprocess_parameters
    # template null = the model family's default, which the trainer fills in (apps/train: test_train_family_defaults)
    assert (pp.template, pp.image_plugin, pp.cutoff_len, pp.trust_remote_code, pp.fix_mistral_regex) == (None, None, 4096, False, True)
    assert cfg.dataset_param.attr.messages == "messages" and cfg.dataset_param.attr.role_tag == "role"
    assert cfg.dataset_param.basic_parameters.packing is False and cfg.dataloader_param.drop_last is True
    assert cfg.dataloader_param.collate_param.pad_to_multiple_of == 8


@pytest.mark.parametrize(
    ("patch", "key", "message"),
    [
        ({"dataset_param": {"basic_parameters": {"datset": "x"}}}, "data.dataset_param.basic_parameters.datset", "did you mean 'data.dataset_param.basic_parameters.dataset'"),
        ({"dataset_param": {"preprocess_parameters": {"cutoff_len": 0}}}, "data.dataset_param.preprocess_parameters.cutoff_len", "must be >= 1"),
        ({"dataset_param": {"preprocess_parameters": {"train_on_prompt": True, "mask_history": True}}}, "data.dataset_param.preprocess_parameters.mask_history", "cannot be combined"),
        ({"dataset_param": {"preprocess_parameters": {"image_min_pixels": 100, "image_max_pixels": 10}}}, "data.dataset_param.preprocess_parameters.image_min_pixels", "larger than"),
        ({"dataset_param": {"attr": {"user_tag": "gpt", "assistant_tag": "gpt"}}}, "data.dataset_param.attr.assistant_tag", "must all differ"),
        ({"dataloader_param": {"collate_param": {"pad_to_multiple_of": 0}}}, "data.dataloader_param.collate_param.pad_to_multiple_of", "must be >= 1"),
        ({"dataloader_param": {"num_workers": "two"}}, "data.dataloader_param.num_workers", "expected an integer"),
        ({"dataset_param": {"basic_parameters": {"dataset": " , "}}}, "data.dataset_param.basic_parameters.dataset", "is empty"),
    ],
)
def test_mistakes_name_their_key(patch, key, message):
    with pytest.raises(ConfigError) as err:
        build(DataConfig, patch, "data")
    assert err.value.key == key and message in err.value.message


def test_registry_names_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="template: unknown template 'llama3'; registered: mistral"):
        get_template("llama3")
    with pytest.raises(ConfigError, match="image_plugin: unknown image plugin 'llava'; registered: pixtral, qwen3_omni, qwen3_vl"):
        get_plugin("llava")
    cfg = build(DataConfig, {"dataset_param": {"dataset_type": "webdataset"}}, "data")
    with pytest.raises(ConfigError, match="dataset_type: unknown dataset type 'webdataset'; registered: huggingface, synthetic_beeps, synthetic_shapes"):
        prepare_dataset(cfg)


def test_model_path_must_be_a_local_directory(tmp_path):
    with pytest.raises(ConfigError, match="model_name_or_path: is not set"):
        build_processor(build(DataConfig, {}, "data"))
    cfg = build(DataConfig, {"dataset_param": {"preprocess_parameters": {"model_name_or_path": str(tmp_path / "nope")}}}, "data")
    with pytest.raises(ConfigError, match="is not a directory"):
        build_processor(cfg)


def test_every_field_has_a_default():
    def walk(cls):
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f"{cls.__name__}.{f.name}"
            if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
                walk(f.type)

    walk(DataConfig)
    assert build(DataConfig, None, "data") == DataConfig()
