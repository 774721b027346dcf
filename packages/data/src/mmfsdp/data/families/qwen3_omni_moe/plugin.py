"""The `qwen3_omni` plugin: Qwen3-Omni's audio clips, and its images as the `qwen3_vl` plugin makes them.

The HF side is the `Qwen3OmniMoeProcessor` that this plugin builds from the model directory (`load_hf_processor`:
its `Qwen2VLImageProcessor`, `Qwen2VLVideoProcessor` and `WhisperFeatureExtractor`, around the tokenizer).

Audio, one sample's clips together as one processor call (one conversation at inference) takes them:

1. Each clip is decoded, resampled to the feature extractor's `sampling_rate` and averaged to mono
   (`mmfsdp.data.audio.decode_audio`); a clip needs at least `n_fft` samples (one feature window), else its row is
   `empty_audio`.
2. Frames: the processor runs the feature extractor on all the call's clips padded to the longest (its audio kwargs:
   `padding=True`, `truncation=False`), and the attention mask counts one frame per hop that starts inside a clip,
   dropping the last column when the padded length is not a multiple of the hop. So the longest clip of `L` samples
   has `L // hop` frames and every other clip `ceil(L / hop)`, capped at the longest's (`feature_frames`): a clip's
   frames depend on the longest clip of its sample, as in the processor.
3. Tokens: the processor's own `_get_feat_extract_output_lengths(frames, n_window)` (the audio encoder's
   convolutions over chunks of `2 · n_window` frames). The clip becomes `<|audio_start|>`,
   `<|audio_pad|>` × tokens, `<|audio_end|>`.
4. `audio_inputs` (workers) decodes the clips again (they must give the same samples) and returns the feature
   extractor's own output with the processor's audio kwargs: `input_features` `[n, feature_size, T]` and
   `feature_attention_mask` `[n, T]`, `T` the longest clip's frames.

An audio clip's grid is `(samples, frames, tokens, source_rate, source_channels)`.

Images are the `qwen3_vl` plugin's (Qwen3-Omni's processor expands an image as Qwen3-VL's does: `<|vision_start|>`,
`<|image_pad|>` per merged patch, `<|vision_end|>`). Videos are not read yet: Qwen3-Omni's differ from Qwen3-VL's (no
timestamps, `Qwen2VLVideoProcessor` sampling, `video_second_per_grid`, the audio track interleaved with
`use_audio_in_video`), so a video row is `video_not_supported`. No `mm_token_type_ids`: the processor returns none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmfsdp.config import ConfigError
from mmfsdp.data.audio import AUDIO_MAX_SECONDS, AUDIO_TIMEOUT_S, RESAMPLER, AudioOptions, DecodedAudio, decode_audio
from mmfsdp.data.errors import BadSample
from mmfsdp.data.families.qwen3_vl.plugin import Qwen3VLPlugin
from mmfsdp.data.plugins import MediaSetting, processor_file, register_plugin, setting_source
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.video import VideoOptions

__all__ = ["MEDIA_TOKEN_NAMES", "Qwen3OmniPlugin"]

MEDIA_TOKEN_NAMES = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
}
"""Qwen3-Omni's named media tokens, as its `tokenizer_config.json` maps them (`extra_special_tokens`): the processor
reads them by name."""

_KEY = "data.dataset_param.preprocess_parameters"
_AUDIO_FILES = ("preprocessor_config.json",)


@register_plugin
class Qwen3OmniPlugin(Qwen3VLPlugin):
    """Qwen3-Omni's audio tokens and features (module docstring); images as `qwen3_vl`."""

    name, aliases = "qwen3_omni", ()
    supports_video, supports_audio = False, True
    audio_start_token, audio_token, audio_end_token = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"
    """An audio block: its start, one pad per audio token, its end."""

    @classmethod
    def load_hf_processor(cls, model_dir: Path, tokenizer: Any, *, trust_remote_code: bool = False) -> Any:
        """A `Qwen3OmniMoeProcessor` around `tokenizer` with the image, video and audio processors transformers loads
        from the model directory (what the file lacks takes transformers' defaults)."""
        from transformers import (
            Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3OmniMoeProcessor, WhisperFeatureExtractor,
        )

        cls.require_image_settings(model_dir)
        kwargs = {"local_files_only": True}
        parts = {
            "image_processor": Qwen2VLImageProcessor.from_pretrained(str(model_dir), **kwargs),
            "video_processor": Qwen2VLVideoProcessor.from_pretrained(str(model_dir), **kwargs),
            "feature_extractor": WhisperFeatureExtractor.from_pretrained(str(model_dir), **kwargs),
        }
        try:
            return Qwen3OmniMoeProcessor(**parts, tokenizer=tokenizer)
        except AttributeError as err:  # the processor reads the tokenizer's named media tokens
            raise ConfigError(
                f"{_KEY}.model_name_or_path",
                f"the tokenizer in {str(model_dir)!r} does not name Qwen3-Omni's media tokens ({err}); its "
                f"tokenizer_config.json must map {', '.join(MEDIA_TOKEN_NAMES)} in extra_special_tokens",
            ) from None

    def __init__(
        self, processor: MMProcessor, *, image_max_pixels: int | None = None, image_min_pixels: int | None = None,
        video: VideoOptions | None = None, audio: AudioOptions | None = None,
    ):
        self._init_images(processor, image_max_pixels, image_min_pixels)
        tid = processor.token_id
        self.audio_id = tid(self.audio_token)
        self.audio_start_id = tid(self.audio_start_token)
        self.audio_end_id = tid(self.audio_end_token)
        self.image_token_ids = self.image_token_ids | {self.audio_id, self.audio_start_id, self.audio_end_id}
        self.audio_options = audio or AudioOptions()
        hf = processor.hf_processor
        self.feature_extractor = hf.feature_extractor
        self.sampling_rate = int(self.feature_extractor.sampling_rate)
        self.hop_length = int(self.feature_extractor.hop_length)
        self.min_samples = int(self.feature_extractor.n_fft)
        """Fewest samples a clip may have: one window of the feature extractor's STFT."""
        self.n_window = int(hf.n_window)
        # The feature extractor's arguments exactly as the processor's __call__ merges them (its defaults, the
        # tokenizer's init kwargs); `n_window` is the processor's own.
        merged = hf._merge_kwargs(tokenizer_init_kwargs=hf.tokenizer.init_kwargs, audio_kwargs={})["audio_kwargs"]
        merged.pop("n_window", None)
        if merged.get("padding") is not True or merged.get("truncation") or not merged.get("return_attention_mask"):
            raise ConfigError(
                f"{_KEY}.template",
                f"the Qwen3-Omni processor's audio kwargs {merged} are not the padding=True, truncation=False, "
                "return_attention_mask=True whose frame counts this plugin computes",
            )
        self._audio_kwargs = {**merged, "return_tensors": "pt"}

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """None: Qwen3-Omni's processor returns no `mm_token_type_ids`."""
        return {}

    def fingerprint(self) -> list[Any]:
        extractor = json.loads(json.dumps(self.feature_extractor.to_dict(), sort_keys=True, default=str))
        return [
            self.name, self.patch_size, self.merge_size, self.min_pixels, self.max_pixels, extractor,
            repr(self.audio_options), self._audio_kwargs, self.n_window, RESAMPLER,
        ]

    def media_settings(self) -> list[MediaSetting]:
        """Image pixel bounds and the audio settings as applied, each with its source."""
        found = processor_file(Path(self.processor.name_or_path), "feature_extractor", _AUDIO_FILES)
        fe, options = self.feature_extractor, self.audio_options

        def extractor(name: str) -> MediaSetting:
            return MediaSetting(f"feature_extractor.{name}", getattr(fe, name), setting_source(found, (name,), fe, name))

        def configured(key: str, value: float, default: float) -> MediaSetting:
            return MediaSetting(key, value, "config" if value != default else "default")

        processor = type(self.processor.hf_processor).__name__
        return [
            *self.image_settings(),
            configured("audio_max_seconds", options.max_seconds, AUDIO_MAX_SECONDS),
            configured("audio_timeout", options.timeout_s, AUDIO_TIMEOUT_S),
            extractor("sampling_rate"),
            extractor("feature_size"),
            extractor("hop_length"),
            extractor("n_fft"),
            MediaSetting("processor.n_window", self.n_window, f"transformers default ({processor}.n_window)"),
        ]

    # ---------------------------------------------------------------- audio

    def decode(self, path: str, *, waveform: bool = True) -> DecodedAudio:
        """The clip at `path` at the feature extractor's rate, mono (without `waveform`: its length only);
        `BadSample` if unusable or too short."""
        options = self.audio_options
        clip = decode_audio(
            path, self.sampling_rate, max_seconds=options.max_seconds, timeout_s=options.timeout_s, waveform=waveform,
        )
        if clip.num_samples < self.min_samples:
            raise BadSample(
                "empty_audio",
                f"{path} decodes to {clip.num_samples} samples at {self.sampling_rate} Hz, fewer than one feature "
                f"window (n_fft = {self.min_samples})",
            )
        return clip

    def feature_frames(self, lengths: list[int]) -> list[int]:
        """The feature frames the processor gives clips of these lengths (samples) in one call (module docstring)."""
        longest = max(lengths) // self.hop_length
        return [min(-(-length // self.hop_length), longest) for length in lengths]

    def num_tokens(self, frames: int) -> int:
        """Audio tokens of a clip of `frames` feature frames: the processor's own count."""
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

        return int(_get_feat_extract_output_lengths(frames, self.n_window))

    def read_audio_grids(self, paths: list[str]) -> list[tuple[int, ...]]:
        clips = [self.decode(path, waveform=False) for path in paths]
        lengths = [clip.num_samples for clip in clips]
        return [
            (length, frames, self.num_tokens(frames), clip.source_rate, clip.channels)
            for clip, length, frames in zip(clips, lengths, self.feature_frames(lengths))
        ]

    def audio_tokens(self, grid: tuple[int, ...]) -> list[int]:
        return [self.audio_start_id] + [self.audio_id] * grid[2] + [self.audio_end_id]

    def audio_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """`input_features` `[n, feature_size, T]` and `feature_attention_mask` `[n, T]`, as the feature extractor
        returns them for the sample's clips with the processor's audio kwargs."""
        clips = []
        for path, grid in zip(paths, grids):
            samples = self.decode(path).samples
            if len(samples) != grid[0]:
                raise BadSample(
                    "corrupt_audio",
                    f"{path} now decodes to {len(samples)} samples, not the {grid[0]} it was tokenized with; "
                    "clear the cache",
                )
            clips.append(samples)
        out = self.feature_extractor(clips, **self._audio_kwargs)
        mask = out["attention_mask"]
        assert mask.sum(-1).tolist() == [grid[1] for grid in grids], "feature frames differ from feature_frames()"
        return {"input_features": out["input_features"], "feature_attention_mask": mask}

    def audio_seconds(self, grid: tuple[int, ...]) -> float:
        return grid[0] / self.sampling_rate

    def describe_audio(self, grid: tuple[int, ...]) -> str:
        samples, frames, tokens, rate, channels = grid[:5]
        return (
            f"{self.audio_seconds(grid):.2f} s ({rate} Hz, {channels} channel{'s' * (channels != 1)} -> "
            f"{samples} samples at {self.sampling_rate} Hz mono) -> {frames} frames -> {tokens} {self.audio_token}, "
            f"{len(self.audio_tokens(grid))} tokens with start/end"
        )

    def audio_label(self, grid: tuple[int, ...]) -> str:
        return f"{self.audio_seconds(grid):.1f}s {grid[2]}"
