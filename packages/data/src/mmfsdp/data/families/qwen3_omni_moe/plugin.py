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
`<|image_pad|>` per merged patch, `<|vision_end|>`). No `mm_token_type_ids`: the processor returns none.

Videos, as `Qwen3OmniMoeProcessor` makes them (its `Qwen2VLVideoProcessor`, not Qwen3-VL's: no timestamps):

1. Frames are sampled from the headers by the video processor's own `sample_frames` at `video_fps`, at most
   `video_maxlen` (each null = the video processor's `fps` / `max_frames`; no `fps` anywhere: every frame), and
   scaled into `video_min_pixels` / `video_max_pixels` first where set, as for Qwen3-VL.
2. Each frame is resized alone (the image `smart_resize`) into the processor's video `size`, which is the
   processor's own call default (`Qwen3OmniMoeProcessor.videos_kwargs`: 128 to 768 merged patches a frame), not the
   video processor's file; the grid is `(ceil(frames / T), h, w)`.
3. The video becomes `<|vision_start|>`, `<|video_pad|>` × `t·h·w / merge²`, `<|vision_end|>`, and
   `video_second_per_grid` is `temporal_patch_size / fps` (the processor's: 1.0 for `fps` when sampling every frame).
4. With `use_audio_in_video: true` a video with an audio stream also gives its track as a clip: decoded like any
   clip, its frames counted with the sample's other clips (the longest rule above), and its tokens interleaved with
   the video's: `<|vision_start|><|audio_start|>`, then video and audio pads in time order (a temporal group's pads at
   `t · second_per_grid · position_id_per_seconds`, the i-th audio pad at i: the video pad first on a tie),
   `<|audio_end|><|vision_end|>` (`replace_video_with_audio_token`). The sample's clips are kept in text order
   (`arrange_media`: a track where its video is), so `input_features` rows follow the audio pads as the thinker
   fills them. A video grid carries its track's audio grid (zeros: no track) before its frame indices.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mmfsdp.config import ConfigError
from mmfsdp.data.audio import (
    AUDIO_MAX_SECONDS, AUDIO_TIMEOUT_S, RESAMPLER, AudioOptions, DecodedAudio, decode_audio, has_audio_stream,
)
from mmfsdp.data.errors import BadSample
from mmfsdp.data.families.qwen3_vl.plugin import Qwen3VLPlugin
from mmfsdp.data.plugins import MediaSetting, processor_file, register_plugin, setting_source, size_value
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
    supports_video, supports_audio = True, True
    frames_at = 14
    """A video grid: Qwen3-VL's nine fields, its audio track's grid (five fields, zeros without one), the frames."""
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
        self._init_video(video or VideoOptions())

    def _init_video(self, options: VideoOptions) -> None:
        """Qwen3-VL's video settings read from this processor's `Qwen2VLVideoProcessor`, with the size, the seconds
        per grid and the interleaving settings the processor's call applies (module docstring)."""
        super()._init_video(options)
        hf = self.processor.hf_processor
        merged = hf._merge_kwargs(tokenizer_init_kwargs=hf.tokenizer.init_kwargs)
        videos_kwargs = merged.get("videos_kwargs", {})
        size = videos_kwargs.get("size")
        if size is not None:
            self.video_size = (size_value(size, "shortest_edge"), size_value(size, "longest_edge"))
        self.size_source = (f"transformers default ({type(hf).__name__}.videos_kwargs, over the video processor's)"
                            if size is not None else "the video processor's size")
        self._video_kwargs["size"] = dict(zip(("shortest_edge", "longest_edge"), self.video_size))

        def setting(name: str) -> float:
            value = merged.get(name, videos_kwargs.get(name, getattr(hf, name, None)))
            if value is None:
                raise ConfigError(f"{_KEY}.template", f"the Qwen3-Omni processor has no {name}")
            return float(value)

        self.position_id_per_seconds = setting("position_id_per_seconds")
        """Time positions per second of the interleaving (the processor's, not the model config's)."""
        self.second_per_grid = self.temporal_patch_size / (self.video_fps if self.video_fps is not None else 1.0)
        """Seconds one temporal group stands for, as the processor computes it from the `fps` it was given."""

    def video_resize(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) `Qwen2VLVideoProcessor` resizes each of `num_frames` frames of this size to: the image
        `smart_resize` into the video size (its per-frame cap where `cap_pixels_per_frame` is set)."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        factor = self.video_patch_size * self.video_merge_size
        min_pixels, max_pixels = self.video_size
        if self.cap_pixels_per_frame:
            total = int(int(getattr(self.video_processor, "max_video_tokens", 128000)) * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * self.temporal_patch_size // num_frames), int(min_pixels * 1.05))
        return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)

    def read_media_grids(
        self, video_paths: list[str], audio_paths: list[str]
    ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """A sample's video and audio grids together: with `use_audio_in_video` the videos' tracks are clips of the
        sample, so every clip's frames depend on the longest of them all (`feature_frames`)."""
        videos = super().read_video_grids(video_paths) if video_paths else []
        in_video = self.audio_options.in_video
        tracks = [
            self.decode(path, waveform=False) if in_video and has_audio_stream(path, self.audio_options.timeout_s)
            else None
            for path in video_paths
        ]
        clips = [self.decode(path, waveform=False) for path in audio_paths]
        heard = clips + [track for track in tracks if track is not None]
        frames = iter(self.feature_frames([clip.num_samples for clip in heard]) if heard else [])
        grids = [self._audio_grid(clip, next(frames)) for clip in heard]
        audio_grids, track_grids = grids[: len(clips)], iter(grids[len(clips) :])
        video_grids = [
            (*grid[:9], *(next(track_grids) if track is not None else (0,) * 5), *grid[9:])
            for grid, track in zip(videos, tracks)
        ]
        return video_grids, audio_grids

    def _audio_grid(self, clip: DecodedAudio, frames: int) -> tuple[int, ...]:
        return clip.num_samples, frames, self.num_tokens(frames), clip.source_rate, clip.channels

    def read_video_grids(self, paths: list[str]) -> list[tuple[int, ...]]:
        return self.read_media_grids(paths, [])[0]

    def read_audio_grids(self, paths: list[str]) -> list[tuple[int, ...]]:
        return self.read_media_grids([], paths)[1]

    def arrange_media(self, input_ids: list[int], media: dict[str, Any]) -> dict[str, Any]:
        """The sample's clips in text order, its videos' tracks among them (module docstring, step 4): the clip of
        each `<|audio_start|>`, a track where a `<|vision_start|>` is right before it."""
        tracks = [(path, [*grid[9:14], 1]) for path, grid in zip(media["videos"], media["video_grids"]) if grid[9]]
        if not tracks:
            return media
        standalone, tracks = iter(zip(media["audios"], media["audio_grids"])), iter(tracks)
        clips = [
            next(tracks) if before == self.start_id else next(standalone)
            for before, token in zip([None, *input_ids], input_ids) if token == self.audio_start_id
        ]
        return {**media, "audios": [path for path, _ in clips], "audio_grids": [list(grid) for _, grid in clips]}

    def video_tokens(self, grid: tuple[int, ...]) -> list[int]:
        """`<|vision_start|>`, the video's pads (and its track's, interleaved: module docstring), `<|vision_end|>`."""
        t, h, w = grid[:3]
        per_group = h * w // self.video_merge_size**2
        audio = grid[11]
        if not grid[9]:
            return [self.start_id] + [self.video_id] * (t * per_group) + [self.end_id]
        times = [g * self.second_per_grid * self.position_id_per_seconds for g in range(t) for _ in range(per_group)]
        ids, v, a = [self.start_id, self.audio_start_id], 0, 0
        while v < len(times) and a < audio:
            if times[v] <= a:
                ids.append(self.video_id)
                v += 1
            else:
                ids.append(self.audio_id)
                a += 1
        ids += [self.video_id] * (len(times) - v) + [self.audio_id] * (audio - a)
        return ids + [self.audio_end_id, self.end_id]

    def video_inputs(self, paths: list[str], grids: list[tuple[int, ...]]) -> dict[str, Any]:
        """Qwen3-VL's `pixel_values_videos` and `video_grid_thw` (this processor's video kwargs) and
        `video_second_per_grid` `[n]` (float32, as the processor returns it)."""
        out = super().video_inputs(paths, grids)
        return {**out, "video_second_per_grid": torch.tensor([self.second_per_grid] * len(paths), dtype=torch.float32)}

    def describe_video(self, grid: tuple[int, ...]) -> str:
        t, h, w = grid[:3]
        text = f"{len(grid) - self.frames_at} frames -> grid {t}x{h}x{w} patches -> "
        text += f"{t * h * w // self.video_merge_size**2} <|video_pad|>"
        if grid[9]:
            text += f", its audio track {self.describe_audio(grid[9:14])} interleaved"
        return text + f" ({self.second_per_grid:g} s a temporal group)"

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """None: Qwen3-Omni's processor returns no `mm_token_type_ids`."""
        return {}

    def fingerprint(self) -> list[Any]:
        extractor = json.loads(json.dumps(self.feature_extractor.to_dict(), sort_keys=True, default=str))
        return [
            self.name, self.patch_size, self.merge_size, self.min_pixels, self.max_pixels, extractor,
            repr(self.audio_options), self._audio_kwargs, self.n_window, RESAMPLER,
            json.loads(json.dumps(self.video_processor.to_dict(), sort_keys=True, default=str)),
            repr(self.video_options), self._video_kwargs, self.position_id_per_seconds, self.second_per_grid,
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
        video = [
            MediaSetting("processor.videos_kwargs.size", self._video_kwargs["size"], self.size_source)
            if setting.key == "video_processor.size" else setting
            for setting in self.video_settings()
        ]
        return [
            *self.image_settings(),
            *video,
            configured("use_audio_in_video", options.in_video, False),
            MediaSetting("processor.position_id_per_seconds", self.position_id_per_seconds,
                         f"transformers default ({processor})"),
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
