"""Training data for multimodal chat models: templates, image plugins, collators, datasets, the loader.

The trainer uses it in this order (YAML section `data:` = `DataConfig`):

1. `prepare_dataset(data_cfg)` on every rank before process groups exist: generates
   synthetic data if asked, caches the raw rows with HF datasets.
2. `build_processor(data_cfg)`: tokenizer + HF image processor (and feature extractor) of the model.
3. `build_dataset(data_cfg, processor, split)`: tokenized samples (template + image
   plugin, cached), images, videos and audio clips decoded lazily per item; bad rows skipped and counted.
4. `build_dataloader(dataset, data_cfg, micro_batch_size=, dp_rank=, dp_size=, seed=,
   pad_to_multiple_of=)`: an endless, exactly resumable iterator over collated
   batches (the batch contract: docs/data.md, "Batches").

Reward functions for online RL are a registry too (`build_rewards`, `mmfsdp.data.rewards`).

With `attr.ranking: true` the dataset is a `PreferenceDataset` (an item is a chosen/rejected pair) and the loader
collates pairs with `PairCollator` (docs/data.md, "Preference data"). With `attr.prompt_only: true` it is a
`PromptDataset` (an item is a prompt with its ground truth, for online RL) and the loader hands the items on
uncollated (`PromptCollator`).

Each of templates, image plugins, collators and dataset types (`huggingface`, `synthetic_shapes`,
`synthetic_shapes_pairs`; `mmfsdp.data.dataset_types`) is a registry
keyed by the name written in YAML. A family's template(s), plugin and collator live in its folder under
`mmfsdp.data.families` and register through the `mmfsdp.data_families` entry points, loaded on the first lookup.
See docs/data.md.
"""

from mmfsdp.data.collators import PAIR_KEYS, Collator, PairCollator, PromptCollator, get_collator, register_collator
from mmfsdp.data.config import (
    AttrConfig,
    BasicParametersConfig,
    CollateParamConfig,
    DataConfig,
    DataloaderParamConfig,
    DatasetParamConfig,
    PreprocessParametersConfig,
    SyntheticConfig,
)
from mmfsdp.data.audio import AudioOptions, DecodedAudio, decode_audio
from mmfsdp.data.conversation import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, Conversation, Pair, parse_pair, parse_row
from mmfsdp.data.dataset import PreferenceDataset, PromptDataset, SFTDataset, build_dataset, prepare_dataset
from mmfsdp.data.dataset_types import DatasetType, dataset_files, has_eval_data, register_dataset_type
from mmfsdp.data.encoder import SampleEncoder
from mmfsdp.data.errors import BAD_REASONS, BadSample, DataError
from mmfsdp.data.loader import StatefulDataLoader, build_dataloader, pack_rows, plan_epoch
from mmfsdp.data.plugins import AudioPlugin, ImagePlugin, MediaSetting, VideoPlugin, get_plugin, register_plugin
from mmfsdp.data.video import VideoInfo, VideoOptions, decode_frames, read_video_info
from mmfsdp.data.build import build_plugin, build_processor, media_settings
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.rewards import RewardSet, RewardSpec, build_rewards, register_reward, reward_names
from mmfsdp.data.templates import IGNORE_INDEX, MediaBlocks, Template, get_template, register_template

__all__ = [
    "AUDIO_PLACEHOLDER",
    "AttrConfig",
    "AudioOptions",
    "AudioPlugin",
    "BAD_REASONS",
    "BadSample",
    "BasicParametersConfig",
    "CollateParamConfig",
    "Collator",
    "Conversation",
    "DataConfig",
    "DataError",
    "DataloaderParamConfig",
    "DatasetParamConfig",
    "DatasetType",
    "IGNORE_INDEX",
    "IMAGE_PLACEHOLDER",
    "ImagePlugin",
    "MediaSetting",
    "VideoInfo",
    "VideoOptions",
    "VideoPlugin",
    "decode_audio",
    "decode_frames",
    "DecodedAudio",
    "read_video_info",
    "MMProcessor",
    "PAIR_KEYS",
    "Pair",
    "PairCollator",
    "PreferenceDataset",
    "PromptCollator",
    "PromptDataset",
    "PreprocessParametersConfig",
    "RewardSet",
    "RewardSpec",
    "SFTDataset",
    "SampleEncoder",
    "StatefulDataLoader",
    "SyntheticConfig",
    "MediaBlocks",
    "Template",
    "build_dataloader",
    "build_dataset",
    "build_plugin",
    "build_processor",
    "build_rewards",
    "register_reward",
    "reward_names",
    "media_settings",
    "dataset_files",
    "has_eval_data",
    "get_collator",
    "get_plugin",
    "get_template",
    "pack_rows",
    "parse_pair",
    "parse_row",
    "plan_epoch",
    "prepare_dataset",
    "register_collator",
    "register_dataset_type",
    "register_plugin",
    "register_template",
]
