"""Shared, session-scoped fixtures of the data tests: real tokenizer files, a tiny processor, small images.

The Mistral tokenizer is the real Tekken vocabulary that `mistral-common` ships
(`tekken_240911.json`, Pixtral's, with an image section). That file declares chat
format v3, which folds the system prompt into the last user message; Magistral-class
models use v7+ (`[SYSTEM_PROMPT]` tokens), so the fixture writes the same file with
`config.version = "v7"` — vocabulary, merges and special tokens untouched — and
mistral-common then encodes with its v7 instruct tokenizer.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmfsdp.data.families.qwen3_omni_moe.plugin import MEDIA_TOKEN_NAMES
import torch
from PIL import Image

import mistral_common
from mmfsdp.config import build
from mmfsdp.data import IGNORE_INDEX, BadSample, DataConfig, SampleEncoder, build_processor
from mmfsdp.data.families.mistral.synthetic import write_tiny_processor

TEKKEN_SOURCE = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"


def data_config(model_dir: str | Path, tmp: Path, **sections: dict[str, Any]) -> DataConfig:
    """A DataConfig for tests: `sections` are merged into preprocess_parameters / basic_parameters / attr / dataloader_param.

    Template and collator default to `mistral` / `pixtral` (the data package has no default of its own: the trainer
    takes the model family's)."""
    pp = {"model_name_or_path": str(model_dir), "template": "mistral", **sections.get("preprocess", {})}
    basic = {"dataset_dir": str(tmp), "cache_dir": str(tmp / "cache"), **sections.get("basic", {})}
    loader = {"num_workers": 0, **sections.get("loader", {})}
    loader["collate_param"] = {"model_name": "pixtral", **loader.get("collate_param", {})}
    raw = {
        "dataset_param": {"preprocess_parameters": pp, "basic_parameters": basic, "attr": sections.get("attr", {})},
        "dataloader_param": loader,
    }
    return build(DataConfig, raw, "data")


@pytest.fixture(scope="session")
def tekken_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only `tekken.json` (v7 chat format), as Mistral ships tokenizers."""
    out = tmp_path_factory.mktemp("tekken")
    raw = json.loads(TEKKEN_SOURCE.read_text())
    raw["config"]["version"] = "v7"
    (out / "tekken.json").write_text(json.dumps(raw))
    return out


@pytest.fixture(scope="session")
def tekken_processor(tekken_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return build_processor(data_config(tekken_dir, tmp_path_factory.mktemp("unused")))


@pytest.fixture(scope="session")
def tokenizer_json_dir(tekken_processor, tekken_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer saved by HF as `tokenizer.json` (+ the tekken image settings the plugin reads)."""
    out = tmp_path_factory.mktemp("tokjson")
    tekken_processor.tokenizer.save_pretrained(str(out))
    assert (out / "tokenizer.json").is_file()
    raw = json.loads((tekken_dir / "tekken.json").read_text())
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "PixtralImageProcessor",
                "patch_size": {"height": raw["image"]["image_patch_size"], "width": raw["image"]["image_patch_size"]},
                "size": {"longest_edge": raw["image"]["max_image_size"]},
            }
        )
    )
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "processor"
    write_tiny_processor(out, image_size=64, patch_size=4, spatial_merge_size=2)
    return out


@pytest.fixture(scope="session")
def tiny_processor(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return build_processor(data_config(tiny_dir, tmp_path_factory.mktemp("unused")))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir: Path):
    """A tiny `Mistral3ForConditionalGeneration` (fp32, eval) matching the tiny processor: 4-px patches, merge 2."""
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from mmfsdp.data.families.mistral.synthetic import tiny_processor_ids

    ids = tiny_processor_ids()
    config = Mistral3Config(
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 8, "patch_size": 4, "image_size": 64},
        text_config={
            "model_type": "mistral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "vocab_size": ids["vocab_size"],
            "max_position_embeddings": 1024,
        },
        image_token_index=ids["image_token_index"],
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return Mistral3ForConditionalGeneration(config).eval()


def write_image(path: Path, width: int, height: int, seed: int = 0, mode: str = "RGB") -> str:
    """A random-noise image file; returns its path."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode).save(path)
    return str(path)


def write_video(
    path: Path, num_frames: int, width: int, height: int, fps: Any = 8, codec: str = "mpeg4", seed: int = 0,
    audio: tuple[np.ndarray, int] | None = None, audio_codec: str = "aac",
) -> str:
    """A clip of a white square moving right over noise, written with PyAV (its wheels have mpeg4 and libx264);
    with `audio` (`[channels, n]` samples in [-1, 1], their rate) also an audio track of that codec; returns its
    path."""
    import av

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    background = rng.integers(0, 128, (height, width, 3), dtype=np.uint8)
    side = max(2, min(width, height) // 4)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        track = None if audio is None else _audio_stream(container, audio[0].shape[0], audio[1], audio_codec)
        for i in range(num_frames):
            frame = background.copy()
            x = (i * max(1, (width - side) // max(1, num_frames - 1))) % (width - side + 1)
            frame[height // 3 : height // 3 + side, x : x + side] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
        if track is not None:
            _mux_audio(container, track, audio[0])
    return str(path)


def _audio_stream(container: Any, channels: int, rate: int, codec: str) -> Any:
    return container.add_stream(codec, rate=rate, layout="mono" if channels == 1 else "stereo")


def _mux_audio(container: Any, stream: Any, samples: np.ndarray) -> None:
    """`samples` (`[channels, n]`, floats in [-1, 1]) as 16-bit integers into `stream` of `container` (its rate),
    resampled to the encoder's own sample format, with timestamps (an MP4 gets its edit list, an Ogg its
    pre-skip)."""
    import av

    rate, layout = stream.codec_context.sample_rate, "mono" if samples.shape[0] == 1 else "stereo"
    pcm = np.round(np.clip(samples, -1, 1) * 32767).astype(np.int16)
    frame_size = stream.codec_context.frame_size or 1024
    fmt = stream.codec_context.codec.audio_formats[0].name
    resampler = av.AudioResampler(format=fmt, layout=layout, rate=rate, frame_size=frame_size)
    for start in range(0, pcm.shape[1], frame_size):
        frame = av.AudioFrame.from_ndarray(pcm[:, start : start + frame_size].T.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = rate, start, Fraction(1, rate)
        for chunk in resampler.resample(frame):
            container.mux(stream.encode(chunk))
    for chunk in resampler.resample(None):
        container.mux(stream.encode(chunk))
    container.mux(stream.encode(None))


def write_audio(path: Path, samples: np.ndarray, rate: int, codec: str = "pcm_s16le", container: str | None = None) -> str:
    """`samples` (`[channels, n]`, floats in [-1, 1]) as an audio file written with PyAV (its wheels have the PCM,
    FLAC, MP3, Opus and AAC encoders): 16-bit integers, resampled to each encoder's own sample format, with
    timestamps (so that an MP4 gets its edit list and an Ogg its pre-skip); returns its path."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format=container) as out:
        _mux_audio(out, _audio_stream(out, samples.shape[0], rate, codec), samples)
    return str(path)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def chat_row(system: str, turns: list[tuple[str, str]], images: list[str]) -> dict:
    """A row of our chat format: a system prompt, then (user, assistant) turns with `<image>` placeholders."""
    messages = [{"role": "system", "content": system}]
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "images": images}


def hf_chat_messages(system: str, turns: list[tuple[str, str]], images: list[str]) -> list[dict]:
    """The same conversation in HF's format: content lists with image items where the placeholders are."""
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}]
    image_iter = iter(images)
    for user, assistant in turns:
        content = []
        for j, piece in enumerate(user.split("<image>")):
            if j:
                content.append({"type": "image", "image": Image.open(next(image_iter)).convert("RGB")})
            if piece:
                content.append({"type": "text", "text": piece})
        messages += [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": assistant}]},
        ]
    return messages


def write_run_yaml(tmp_path: Path, preprocess: dict[str, Any], attr: dict[str, Any] | None = None) -> Path:
    """`tmp_path/run.yaml`: a training YAML whose `data:` reads `tmp_path/d.jsonl` (images and clips relative to
    `tmp_path`, the cache in `tmp_path/cache`, no loader workers) with these `preprocess_parameters` and `attr`."""
    import yaml

    basic = {"dataset_dir": str(tmp_path), "dataset": "d.jsonl", "cache_dir": str(tmp_path / "cache")}
    dataset_param = {"attr": attr or {}, "preprocess_parameters": preprocess, "basic_parameters": basic}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"data": {"dataset_param": dataset_param, "dataloader_param": {"num_workers": 0}}}))
    return path


def media_messages(turns: list[tuple[str, str]], system: str | None = None) -> list[dict]:
    """A conversation in HF's chat format for rendering with `tokenize=False`: content lists with an item of type
    image, video or audio (no payload) where each `<image>`, `<video>` or `<audio>` placeholder is."""
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    for user, assistant in turns:
        content = []
        for piece in re.split(r"(<image>|<video>|<audio>)", user):
            if piece in ("<image>", "<video>", "<audio>"):
                content.append({"type": piece[1:-1]})
            elif piece:
                content.append({"type": "text", "text": piece})
        messages += [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": assistant}]},
        ]
    return messages


def bad_reason(encoder: SampleEncoder, row: dict) -> str:
    """The bad-row reason `encoder.encode_row(row)` raises (it must raise)."""
    with pytest.raises(BadSample) as bad:
        encoder.encode_row(row)
    return bad.value.reason


def trained_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of consecutive trained tokens (label == token; any other label must be IGNORE_INDEX)."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(ids, labels):
        trained = label != IGNORE_INDEX
        if trained:
            assert label == token
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = trained
    return runs


def compare_qwen_vl_chat(processor, cfg, template: Path, system, turns, images, size: dict | None = None):
    """Encode the conversation with `cfg` and assert that ids, image grids, pixels (fp32) and token types are
    exactly HF `Qwen3VLProcessor.apply_chat_template`'s with the chat template file `template` (and the image
    processor's `size`, where given); returns (encoder, sample)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    encoder = SampleEncoder(cfg, processor)
    sample = encoder.encode_row(chat_row(system, turns, images))
    image_processor = Qwen2VLImageProcessor.from_pretrained(processor.name_or_path, **({"size": size} if size else {}))
    hf = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=processor.tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=template.read_text(),
    )
    messages = hf_chat_messages(system, turns, images)
    reference = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    assert sample["input_ids"] == reference["input_ids"][0].tolist()
    pixels = encoder.plugin.pixel_inputs(sample["images"], [tuple(g) for g in sample["image_grids"]])
    assert torch.equal(pixels["image_grid_thw"], reference["image_grid_thw"])
    assert pixels["pixel_values"].dtype == torch.float32
    assert torch.equal(pixels["pixel_values"], reference["pixel_values"])
    token_types = encoder.plugin.token_inputs(torch.tensor(sample["input_ids"]))["mm_token_type_ids"]
    assert torch.equal(token_types, torch.as_tensor(reference["mm_token_type_ids"][0]).long())
    return encoder, sample


class Helpers:
    """Test helpers, reached through the `h` fixture (conftest modules cannot be imported under importlib mode)."""

    data_config = staticmethod(data_config)
    write_image = staticmethod(write_image)
    write_video = staticmethod(write_video)
    write_audio = staticmethod(write_audio)
    write_jsonl = staticmethod(write_jsonl)
    chat_row = staticmethod(chat_row)
    hf_chat_messages = staticmethod(hf_chat_messages)
    trained_runs = staticmethod(trained_runs)
    media_messages = staticmethod(media_messages)
    write_run_yaml = staticmethod(write_run_yaml)
    bad_reason = staticmethod(bad_reason)
    compare_qwen_vl_chat = staticmethod(compare_qwen_vl_chat)


@pytest.fixture(scope="session")
def h() -> type[Helpers]:
    return Helpers


@pytest.fixture(scope="session")
def chat_images(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three noise images of different sizes (40x70, 300x120, 64x64) for the chat-template tests."""
    out = tmp_path_factory.mktemp("chat_images")
    sizes = [(40, 70), (300, 120), (64, 64)]  # (width, height)
    return [write_image(out / f"img{i}.png", width, height, seed=i) for i, (width, height) in enumerate(sizes)]


QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
QWEN_PRETOKENIZE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN_CORPUS = [
    "You are a careful assistant.\nAnswer briefly, please.",
    "What is in this picture? A noisy square. Compare it with this one and tell me which is wider.",
    "The second one is wider. Thanks! Anything else? No, that's all. What shape and colour is this? a red circle",
]


def write_qwen_tokenizer(out: Path, special_tokens: list[str], **named: str) -> None:
    """A small byte-level BPE with Qwen's regex and `special_tokens`, saved as `tokenizer.json` + config in `out`;
    `named` are the tokenizer's named special tokens (`extra_special_tokens`, e.g. `audio_token="<|audio_pad|>"`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(QWEN_CORPUS, trainer)
    extra = {"extra_special_tokens": named} if named else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", **extra).save_pretrained(str(out))


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen-VL-style model directory: a small byte-level BPE with Qwen's regex and special tokens + a 16-px, merge-2 image processor."""
    out = tmp_path_factory.mktemp("qwen")
    write_qwen_tokenizer(out, QWEN_SPECIAL_TOKENS)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "patch_size": 16,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }
        )
    )
    return out


@pytest.fixture(scope="session")
def qwen_processor(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return build_processor(data_config(qwen_dir, tmp_path_factory.mktemp("unused"), preprocess={"template": "qwen3_vl_nothink"}))


OMNI_MEDIA_TOKENS = MEDIA_TOKEN_NAMES
"""Qwen3-Omni's named media tokens, as its tokenizer_config.json maps them (the processor reads them by name)."""
OMNI_PREPROCESSOR = {
    "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "hop_length": 160, "n_fft": 400,
    "n_samples": 4800000, "sampling_rate": 16000, "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056, "nb_max_frames": 30000,
    "processor_class": "Qwen3OmniMoeProcessor",
}
"""The `preprocessor_config.json` of the Qwen3-Omni-30B-A3B checkpoints (data/README.md says where it comes from)."""


@pytest.fixture(scope="session")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-Omni-style model directory: the small Qwen BPE with Qwen3-Omni's audio tokens and named media tokens,
    the published `preprocessor_config.json` and a `config.json` naming the model type (for `AutoProcessor`)."""
    out = tmp_path_factory.mktemp("qwen3_omni")
    write_qwen_tokenizer(out, [*QWEN_SPECIAL_TOKENS, "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"], **OMNI_MEDIA_TOKENS)
    (out / "preprocessor_config.json").write_text(json.dumps(OMNI_PREPROCESSOR))
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    return out


@pytest.fixture(scope="session")
def omni_processor(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return build_processor(data_config(omni_dir, tmp_path_factory.mktemp("unused"), preprocess={"template": "qwen3_omni_nothink"}))
