"""The `data:` config section: where the conversations are, how they are tokenized and batched.

The layout follows MindSpeed-MM's FSDP2 data section (itself LLaMA-Factory's data
arguments): `data.dataset_param` describes the dataset and its preprocessing,
`data.dataloader_param` the batching. Where MindSpeed-MM puts a key elsewhere or
names a value differently, each section's `foreign_keys` says where it goes (or why
it is ignored); `mmfsdp.config.foreign` applies them before the section is built. Only per-field checks live here; whether the
padding multiple fits the context-parallel split is the trainer's cross-section
check (it passes the multiple into `build_dataloader`).
"""

from __future__ import annotations

import math
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from mmfsdp.config import Alias, ConfigError, ForeignKey, Ignored, Translate

from mmfsdp.data.audio import AUDIO_MAX_SECONDS, AUDIO_TIMEOUT_S

_PRE = "data.dataset_param.preprocess_parameters"
_BASIC = "data.dataset_param.basic_parameters"

__all__ = [
    "AttrConfig",
    "BasicParametersConfig",
    "CollateParamConfig",
    "DataConfig",
    "DataloaderParamConfig",
    "DatasetParamConfig",
    "PreprocessParametersConfig",
    "SyntheticConfig",
]


@dataclass(kw_only=True, slots=True)
class AttrConfig:
    """Column and role names of the dataset rows (YAML `data.dataset_param.attr:`)."""

    formatting: Literal["sharegpt", "alpaca"] = "sharegpt"
    """Row layout: `sharegpt` = a list of role-tagged messages per row (the mllm and sharegpt formats are both this
    layout); `alpaca` = one exchange per row, from the `prompt`, `query` and `response` columns (LLaMA-Factory's)."""
    ranking: bool = False
    """Preference (pairwise) data for DPO: each row is a prompt with a chosen and a rejected answer, and a dataset
    item is one pair (docs/data.md, "Preference data"). LLaMA-Factory's `ranking` of dataset_info."""
    prompt_only: bool = False
    """Prompts for online RL (`training.stage: grpo` sets it): a row is a prompt without its answer and a ground truth
    for the rewards (docs/data.md, "Prompt data")."""
    solution: str = "solution"
    """Column of a prompt row's ground truth (any JSON value); `answer` is read when the row has no such column, and
    a row whose messages end with the answer has that answer as its ground truth."""
    chosen: str = "chosen"
    """Column of a pair's chosen answer (a string or one message) when the messages end with the user turn."""
    rejected: str = "rejected"
    """Column of a pair's rejected answer (a string or one message); ms-swift's `rejected_response` is read too."""
    prompt: str = "instruction"
    """`alpaca` rows: column of the user's instruction."""
    query: str = "input"
    """`alpaca` rows: column of the user's input, appended to the instruction after a newline when not empty."""
    response: str = "output"
    """`alpaca` rows: column of the answer (with `ranking: true`, the `chosen` and `rejected` columns instead)."""
    messages: str = "messages"
    """Column holding the list of messages (`conversations` for sharegpt files)."""
    images: str | None = "images"
    """Column holding the image paths (a list, or one string), relative to `basic_parameters.dataset_dir`; null = text only."""
    videos: str | None = None
    """Column holding the video paths (a list, or one string), relative to `basic_parameters.dataset_dir`, one per
    `<video>` placeholder; null = no video column (MindSpeed-MM's Qwen3-VL configs set `videos`)."""
    audios: str | None = None
    """Column holding the audio paths (a list, or one string), relative to `basic_parameters.dataset_dir`, one per
    `<audio>` placeholder; null = no audio column (LLaMA-Factory's and MindSpeed-MM's `audios`)."""
    system: str | None = None
    """Column holding a per-row system prompt; null = only a leading system message counts."""
    role_tag: str = "role"
    """Key of a message's role (`from` for sharegpt)."""
    content_tag: str = "content"
    """Key of a message's text (`value` for sharegpt)."""
    user_tag: str = "user"
    """Role value of a user turn (`human` for sharegpt)."""
    assistant_tag: str = "assistant"
    """Role value of an assistant turn (`gpt` for sharegpt)."""
    system_tag: str | None = "system"
    """Role value of a system message (allowed only as the first message); null = none."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "tools": Ignored("tool-calling rows are not supported", allowed=(None,)),
        "observation_tag": Ignored("tool-calling roles are not read; a row using one is a bad row"),
        "function_tag": Ignored("tool-calling roles are not read; a row using one is a bad row"),
    }

    def __post_init__(self) -> None:
        columns = ("chosen", "rejected", "prompt", "query", "response", "solution")
        for key in ("messages", "role_tag", "content_tag", "user_tag", "assistant_tag", *columns):
            if not getattr(self, key):
                raise ConfigError(key, "must be a non-empty string")
        if self.user_tag == self.assistant_tag or self.system_tag in (self.user_tag, self.assistant_tag):
            raise ConfigError("assistant_tag", "user_tag, assistant_tag and system_tag must all differ")
        if self.prompt_only and self.ranking:
            raise ConfigError("prompt_only", "prompt rows (online RL) and preference pairs (ranking) exclude each other")
        if self.chosen == self.rejected:
            raise ConfigError("rejected", f"must differ from chosen (both are {self.chosen!r})")


@dataclass(kw_only=True, slots=True)
class PreprocessParametersConfig:
    """Tokenizer, image processor, template and label masking (YAML `data.dataset_param.preprocess_parameters:`)."""

    model_name_or_path: str | None = None
    """Local directory of the HF model (tokenizer.json or tekken.json, image processor config); required."""
    template: str | None = None
    """Chat template name (`mmfsdp.data.templates` registry); null = the model family's default (the trainer fills it
    from `model.model_id`'s entry)."""
    image_plugin: str | None = None
    """Image plugin name (`mmfsdp.data.plugins` registry); null = the template's default."""
    cutoff_len: int = 4096
    """Maximum tokens per sample (and per packed row); longer samples are cut in text only or dropped."""
    fix_mistral_regex: bool | None = None
    """Passed to `AutoTokenizer.from_pretrained` to repair the pre-tokenizer regex of older Mistral tokenizer.json files; null = not passed."""
    use_fast_tokenizer: bool = True
    """Passed to `AutoTokenizer.from_pretrained` as `use_fast`."""
    trust_remote_code: bool = False
    """Allow code shipped with the model directory to run while loading the tokenizer/processor."""
    image_max_pixels: int | None = None
    """Image pixel upper limit (`pixtral`: downscale before the image processor; `qwen3_vl`: the resize's area bound);
    null = the model directory's image processor (`pixtral`: no pre-resize; `qwen3_vl`: its `size.longest_edge`)."""
    image_min_pixels: int | None = None
    """Image pixel lower limit (`pixtral`: upscale before the image processor; `qwen3_vl`: the resize's area bound);
    null = the model directory's image processor (`pixtral`: no pre-resize; `qwen3_vl`: its `size.shortest_edge`)."""
    video_fps: float | None = None
    """Frames sampled per second of video (before `video_maxlen` caps them); null = the model directory's video
    processor's `fps` (`video_preprocessor_config.json`, else transformers' default for the model type: Qwen3-VL 2)."""
    video_maxlen: int | None = None
    """Most frames sampled from one video; null = the model directory's video processor's `max_frames`
    (`video_preprocessor_config.json`, else transformers' default for the model type: Qwen3-VL 768)."""
    video_max_pixels: int | None = None
    """Downscale each video frame with more pixels than this (aspect kept) before the video processor; null = none
    (the video processor's own `size`, from the model directory, applies either way)."""
    video_min_pixels: int | None = None
    """Upscale each video frame with fewer pixels than this (aspect kept) before the video processor; null, 0 = none
    (the video processor's own `size` applies either way)."""
    video_total_pixels: int | None = None
    """Budget of one sample's video pixels (all sampled frames of all its videos): each frame's limit becomes at most
    this ÷ the sample's frame count (never under `video_min_pixels`), so a long video shrinks its frames instead of
    blowing a micro-batch; null = no budget."""
    video_timeout: float = 60.0
    """Seconds one video may take to open or to decode its sampled frames before it is skipped (`video_timeout`)."""
    audio_max_seconds: float = AUDIO_MAX_SECONDS
    """Longest audio clip, in seconds (after decoding); a longer clip makes its row bad (`audio_too_long`), it is
    never cut. The default is Qwen3-Omni's published feature-extractor window (300 s)."""
    audio_timeout: float = AUDIO_TIMEOUT_S
    """Seconds one audio clip may take to open and decode before its row is skipped (`audio_timeout`)."""
    use_audio_in_video: bool = False
    """Read a video's own audio track too (Qwen3-Omni): its audio tokens are interleaved with the video's by time
    and its features join the sample's clips, as `Qwen3OmniMoeProcessor(..., use_audio_in_video=True)` makes them; a
    video without an audio stream stays video only. A plugin that reads no audio refuses it."""
    train_on_prompt: bool = False
    """Also train on system and user text (image tokens stay masked)."""
    mask_history: bool = False
    """Train only on the last assistant turn of each conversation."""
    enable_thinking: bool = True
    """Templates with a think block (qwen3_vl): true = the answer's reasoning is kept and trained; false = reasoning is dropped and an empty think block goes before the answer, untrained (LLaMA-Factory's meaning). Templates without one ignore it."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "split_special_tokens": Ignored("control-token strings inside message text are always read as plain text"),
        "audio_sampling_rate": Ignored(
            "audio is resampled to the sampling_rate of the model directory's feature extractor "
            "(16000 for Qwen3-Omni)",
            allowed=(16000,),
        ),
    }

    def __post_init__(self) -> None:
        if self.cutoff_len < 1:
            raise ConfigError("cutoff_len", f"must be >= 1, got {self.cutoff_len}")
        for key in ("image_max_pixels", "image_min_pixels"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(key, f"must be >= 1 or null, got {value}")
        if self.image_max_pixels is not None and self.image_min_pixels is not None and self.image_min_pixels > self.image_max_pixels:
            raise ConfigError("image_min_pixels", f"{self.image_min_pixels} is larger than image_max_pixels {self.image_max_pixels}")
        if self.video_fps is not None and not (self.video_fps > 0 and math.isfinite(self.video_fps)):
            raise ConfigError("video_fps", f"must be a positive number or null, got {self.video_fps}")
        if self.video_maxlen is not None and self.video_maxlen < 1:
            raise ConfigError("video_maxlen", f"must be >= 1 or null, got {self.video_maxlen}")
        for key in ("video_max_pixels", "video_total_pixels"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(key, f"must be >= 1 or null, got {value}")
        if self.video_min_pixels is not None and self.video_min_pixels < 0:
            raise ConfigError("video_min_pixels", f"must be >= 0 or null, got {self.video_min_pixels}")
        low, high = self.video_min_pixels, self.video_max_pixels
        if low is not None and high is not None and low > high:
            raise ConfigError("video_min_pixels", f"{low} is larger than video_max_pixels {high}")
        for key in ("video_timeout", "audio_max_seconds", "audio_timeout"):
            if not (getattr(self, key) > 0 and math.isfinite(getattr(self, key))):
                raise ConfigError(key, f"must be a positive number of seconds, got {getattr(self, key)}")
        if self.train_on_prompt and self.mask_history:
            raise ConfigError("mask_history", "cannot be combined with train_on_prompt; set one of them to false")


@dataclass(kw_only=True, slots=True)
class BasicParametersConfig:
    """Which files, caching, order and sample handling (YAML `data.dataset_param.basic_parameters:`)."""

    dataset_dir: str = "./data"
    """Root directory that image paths (and relative dataset paths not found as given) are resolved against."""
    allow_paths_outside_dataset_dir: bool = False
    """Accept relative image paths whose `..` components leave `dataset_dir`; false = such rows are bad (`image_outside_dataset_dir`). Symlinks inside `dataset_dir` are always followed; absolute paths are always accepted and counted."""
    dataset: str | None = None
    """Training data: a JSON/JSONL file, or a comma-separated list of them."""
    eval_dataset: str | None = None
    """Evaluation data, same form as `dataset`; null = no evaluation set."""
    cache_dir: str | None = None
    """Where HF datasets and the tokenized cache are stored; null = ~/.cache/mmfsdp/data. Use a node-local path on multi-node runs."""
    overwrite_cache: bool = False
    """Rebuild the tokenized cache even if a matching one exists."""
    max_samples: int | None = None
    """Use only the first N rows of each file (before bad rows are removed); null = all."""
    shuffle: bool = True
    """Reshuffle the sample order every epoch (deterministically from the seed and the epoch)."""
    seed: int | None = None
    """Seed of the data order; null = the training seed."""
    packing: bool = False
    """Pack several samples into each row of up to `cutoff_len` tokens (positions restart per sample, `cu_seq_lens` marks them)."""
    strict: bool = False
    """Stop at the first bad row with an error naming the file, row and reason, instead of skipping and counting it."""
    num_proc: int | None = None
    """Processes for the one-time tokenization pass (forked worker processes, each tokenizing whole raw batches;
    at most two batches per process in flight); null = one."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        **{key: Alias(f"{_PRE}.{key}") for key in ("cutoff_len", "template", "train_on_prompt", "mask_history", "enable_thinking")},
        **{
            key: Alias(f"{_PRE}.{key}")
            for key in ("video_fps", "video_maxlen", "video_max_pixels", "video_min_pixels", "video_total_pixels")
        },
        "preprocessing_num_workers": Alias(f"{_BASIC}.num_proc"),
        "val_dataset": Alias(f"{_BASIC}.eval_dataset"),
        "preprocessing_batch_size": Ignored("rows per tokenization call; the tokens are the same"),
        "preprocess_on_fly": Ignored("rows are tokenized once before training and cached; the tokens are the same"),
        "tool_format": Ignored("tool-calling formats are not supported", allowed=(None,)),
        "streaming": Ignored("datasets are tokenized into a cache, not streamed", allowed=(False,)),
    }

    def __post_init__(self) -> None:
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError("max_samples", f"must be >= 1 or null, got {self.max_samples}")
        if self.num_proc is not None and self.num_proc < 1:
            raise ConfigError("num_proc", f"must be >= 1 or null, got {self.num_proc}")
        if self.dataset is not None and not [p for p in self.dataset.split(",") if p.strip()]:
            raise ConfigError("dataset", "is empty; give a JSON/JSONL path or a comma-separated list of them")


@dataclass(kw_only=True, slots=True)
class SyntheticConfig:
    """Generated data for `dataset_type: synthetic_shapes` and `synthetic_shapes_pairs` (coloured shapes) and
    `synthetic_beeps` (beeps to count beside shapes and text rows) (YAML `data.dataset_param.synthetic:`)."""

    num_train: int = 512
    """Training samples to generate."""
    num_eval: int = 64
    """Evaluation samples to generate."""
    image_size: int = 64
    """Side of the square PNG images in pixels."""
    seed: int = 0
    """Seed of the generator."""
    text_only_share: float = 0.3
    """Share of the training rows that have no image (a text question, "What colour is a banana?" -> "yellow"); the eval rows all have one, so the held-out accuracy stays the image task's. In [0, 1). `synthetic_beeps`: the share of text-only training rows."""
    image_share: float = 0.1
    """`synthetic_beeps` only: the share of training rows that are the shapes image question (the rest are clips). With `text_only_share`, in [0, 1)."""
    patch_size: int = 8
    """Vision patch size of the tiny processor written when `model_name_or_path` does not exist yet."""
    spatial_merge_size: int = 2
    """Spatial merge size of the tiny processor written when `model_name_or_path` does not exist yet."""

    def __post_init__(self) -> None:
        for key in ("num_train", "num_eval", "image_size", "patch_size", "spatial_merge_size"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if not 0.0 <= self.text_only_share < 1.0:
            raise ConfigError("text_only_share", f"must be in [0, 1), got {self.text_only_share}")
        if not 0.0 <= self.image_share < 1.0 - self.text_only_share:
            raise ConfigError("image_share", f"must be in [0, 1 - text_only_share), got {self.image_share}")
        if self.image_size < self.patch_size * self.spatial_merge_size:
            raise ConfigError("image_size", f"{self.image_size} is smaller than patch_size × spatial_merge_size")


@dataclass(kw_only=True, slots=True)
class DatasetParamConfig:
    """The dataset and its preprocessing (YAML `data.dataset_param:`)."""

    dataset_type: str = "huggingface"
    """Dataset source (registry: huggingface = JSON/JSONL files read with HF datasets; synthetic_shapes = generated;
    synthetic_shapes_pairs = generated preference pairs, with `attr.ranking: true`; synthetic_beeps = generated
    audio clips to count beeps in, with `attr.audios: audios`)."""
    attr: AttrConfig = field(default_factory=AttrConfig)
    """Column and role names of the rows."""
    preprocess_parameters: PreprocessParametersConfig = field(default_factory=PreprocessParametersConfig)
    """Tokenizer, template, image plugin and masking."""
    basic_parameters: BasicParametersConfig = field(default_factory=BasicParametersConfig)
    """Files, cache, order, packing and bad-row handling."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """Generator settings, used only by the `synthetic_*` dataset types."""


@dataclass(kw_only=True, slots=True)
class CollateParamConfig:
    """How samples become a batch (YAML `data.dataloader_param.collate_param:`)."""

    model_name: str | None = None
    """Collator name (`mmfsdp.data.collators` registry); null = the model family's default (the trainer fills it
    from `model.model_id`'s entry)."""
    pad_to_multiple_of: int = 1
    """Pad the sequence dimension to a multiple of this (the trainer also applies 2 × ring × ulysses for context parallel)."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "collator_id": Alias("data.dataloader_param.collate_param.model_name"),
        "ignore_pad_token_for_loss": Ignored("padding never counts in the loss", allowed=(True,)),
    }

    def __post_init__(self) -> None:
        if self.pad_to_multiple_of < 1:
            raise ConfigError("pad_to_multiple_of", f"must be >= 1, got {self.pad_to_multiple_of}")


@dataclass(kw_only=True, slots=True)
class DataloaderParamConfig:
    """Batching and worker processes (YAML `data.dataloader_param:`)."""

    collate_param: CollateParamConfig = field(default_factory=CollateParamConfig)
    """Collator settings."""
    num_workers: int = 2
    """DataLoader worker processes that decode images and collate; 0 = in the training process."""
    pin_memory: bool = True
    """Pin batch memory for faster host-to-device copies (ignored without an accelerator)."""
    drop_last: bool = True
    """Drop the incomplete last global batch of an epoch; false = fill it by repeating the epoch's first rows."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead (only with num_workers > 0)."""
    padding_free: bool | None = None
    """Lay each micro-batch's samples end to end in one row (`cu_seq_lens` marks them, positions restart per sample) instead of padding them to the longest: the same samples, loss and gradients, no compute spent on padding. No effect with packing (rows are packed already); false = rows padded to the longest sample of the micro-batch; null = on where the model family packs (`capabilities.packing`; on when the data package is used alone)."""
    balance: bool = False
    """Assign each optimizer step's samples to data-parallel ranks (and micro-batches) by the cost model so that the slowest rank waits least (docs/data.md#token-budget-and-balance)."""
    cost_model: str | None = None
    """A JSON file of cost-model coefficients (keys of `mmfsdp.data.balance.CostModel`) replacing the defaults for balance and the token budget; null: the defaults."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "shuffle": Alias(f"{_BASIC}.shuffle"),
        "dataloader_mode": Ignored("one loader: whole micro-batches per data-parallel rank from a resumable sampler", allowed=("sampler",)),
        "sampler_type": Ignored("one sampler: a seeded reshuffle every epoch (basic_parameters.shuffle), split over data-parallel ranks"),
        "enable_preload": Ignored("batches are copied to the device from pinned memory without blocking already"),
    }

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError("num_workers", f"must be >= 0, got {self.num_workers}")
        if self.prefetch_factor < 1:
            raise ConfigError("prefetch_factor", f"must be >= 1, got {self.prefetch_factor}")
        if self.cost_model is not None and not Path(self.cost_model).expanduser().is_file():
            raise ConfigError("cost_model", f"{self.cost_model} is not a file")


_VAL_MAY_DIFFER = ("basic_parameters.dataset", "basic_parameters.cache_dir")


def _differences(mine: Any, theirs: Any, path: str = "") -> list[str]:
    """Dotted keys whose values differ between two raw mappings (a key missing on one side differs)."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        out: list[str] = []
        for key in list(mine) + [k for k in theirs if k not in mine]:
            sub = f"{path}.{key}" if path else str(key)
            out += _differences(mine.get(key), theirs.get(key), sub) if key in mine and key in theirs else [sub]
        return out
    return [] if mine == theirs else [path]


def _validation_files(value: Any, data: dict[str, Any], path: str) -> dict[str, Any]:
    """MindSpeed-MM's `data.val_dataset_param` (a whole second dataset section, usually the training one with
    other files): mmfsdp validates with the training preprocessing on the files of `eval_dataset`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping, got {value!r}")
    files = (value.get("basic_parameters") or {}).get("dataset")
    if not files:
        raise ConfigError(f"{path}.basic_parameters.dataset", "is not set; give the validation JSON/JSONL file(s)")
    for key in _differences(value, data.get("dataset_param") or {}):
        if key not in _VAL_MAY_DIFFER:
            raise ConfigError(
                f"{path}.{key}",
                f"differs from data.dataset_param.{key}: validation uses the training preprocessing and only its own "
                "files (basic_parameters.dataset); give it the same value",
            )
    return {f"{_BASIC}.eval_dataset": ",".join(files) if isinstance(files, list) else files}


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training data (YAML `data:`)."""

    dataset_param: DatasetParamConfig = field(default_factory=DatasetParamConfig)
    """The dataset and its preprocessing."""
    dataloader_param: DataloaderParamConfig = field(default_factory=DataloaderParamConfig)
    """Batching and worker processes."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "val_dataset_param": Translate(
            _validation_files,
            "its `basic_parameters.dataset` becomes `data.dataset_param.basic_parameters.eval_dataset`; every other key "
            "must equal `dataset_param`'s (`cache_dir` may differ)",
        ),
    }

