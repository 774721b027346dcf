"""The `mistral` template + `pixtral` plugin give exactly Mistral's own token ids (mistral-common).

Reference: `MistralTokenizer.from_file(tekken.json)` (v7 instruct tokenizer) encoding
the same conversation — system prompt, several turns, images inside user turns. The
ids are checked for the tokenizer loaded three ways through `build_processor`:
converted from `tekken.json`, from an HF `tokenizer.json`, and as transformers'
`MistralCommonBackend` (tekken.json + a mistral3 config.json). Labels are checked
against the message boundaries mistral-common itself produces.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image
from mistral_common.protocol.instruct.chunk import ImageChunk, TextChunk
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, UserMessage
from mistral_common.protocol.instruct.request import InstructRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from mmfsdp.data import IGNORE_INDEX, SampleEncoder, build_dataset, build_processor

SYSTEM = "You are a careful assistant.\nAnswer briefly."
# (user text with <image> placeholders, assistant text); trailing spaces of an answer are dropped by Mistral.
TURNS = [
    ("<image>What is in this picture? Ünïcødé, 12345 and  two spaces.", "A noisy square.  "),
    ("Compare it with this one:\n<image>\nand tell me which is wider.", "The second one is wider."),
    ("Thanks! Anything else?", "No, that's all.\n"),
]
IMAGE_SIZES = [(40, 70), (1100, 300)]  # (width, height); the second is resized by both encoders


@pytest.fixture(scope="module")
def mistral_tokenizer(tekken_dir: Path) -> MistralTokenizer:
    return MistralTokenizer.from_file(str(tekken_dir / "tekken.json"))


@pytest.fixture(scope="module")
def images(tmp_path_factory, h) -> list[str]:
    out = tmp_path_factory.mktemp("mistral_images")
    return [h.write_image(out / f"img{i}.png", w, hh, seed=i) for i, (w, hh) in enumerate(IMAGE_SIZES)]


def _mistral_messages(images: list[str], num_turns: int, with_answer: bool = True) -> list:
    messages: list = [SystemMessage(content=SYSTEM)]
    image_iter = iter(images)
    for i, (user, assistant) in enumerate(TURNS[:num_turns]):
        chunks: list = []
        for j, piece in enumerate(user.split("<image>")):
            if j:
                chunks.append(ImageChunk(image=Image.open(next(image_iter)).convert("RGB")))
            if piece:
                chunks.append(TextChunk(text=piece))
        messages.append(UserMessage(content=chunks))
        if with_answer or i < num_turns - 1:
            messages.append(AssistantMessage(content=assistant))
    return messages


def _mistral_ids(tokenizer: MistralTokenizer, messages: list) -> list[int]:
    return tokenizer.instruct_tokenizer.encode_instruct(InstructRequest(messages=messages)).tokens


def _row(images: list[str]) -> dict:
    messages = [{"role": "system", "content": SYSTEM}]
    for user, assistant in TURNS:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages, "images": images}


@pytest.fixture(scope="module")
def mistral_common_backend_dir(tekken_dir: Path, tmp_path_factory) -> Path:
    from transformers import Mistral3Config

    out = tmp_path_factory.mktemp("mcb")
    (out / "tekken.json").write_bytes((tekken_dir / "tekken.json").read_bytes())
    # The model config must agree with the tokenizer's image settings (Pixtral-12B: 16-px patches, no merge).
    Mistral3Config(vision_config={"model_type": "pixtral", "patch_size": 16, "image_size": 1024}, spatial_merge_size=1).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def expected(mistral_tokenizer, images) -> tuple[list[int], list[tuple[int, int]]]:
    """Mistral's ids of the whole conversation and the [start, end) span of every assistant reply (+ EOS)."""
    ids = _mistral_ids(mistral_tokenizer, _mistral_messages(images, len(TURNS)))
    spans = []
    for k in range(1, len(TURNS) + 1):
        start = len(_mistral_ids(mistral_tokenizer, _mistral_messages(images, k, with_answer=False)))
        end = len(_mistral_ids(mistral_tokenizer, _mistral_messages(images, k)))
        spans.append((start, end))
    return ids, spans


def _check_labels(ids: list[int], labels: list[int], spans: list[tuple[int, int]], trained_turns: set[int]) -> None:
    trained = {p for k, (s, e) in enumerate(spans) if k in trained_turns for p in range(s, e)}
    assert [i for i, label in enumerate(labels) if label != IGNORE_INDEX] == sorted(trained)
    assert all(labels[p] == ids[p] for p in trained)


def test_tekken_json_matches_mistral_common(tekken_processor, tmp_path, h, images, expected):
    ids, spans = expected
    cfg = h.data_config(tekken_processor.name_or_path, tmp_path)
    sample = SampleEncoder(cfg, tekken_processor).encode_row(_row(images))
    assert sample["input_ids"] == ids
    assert ids[0] == tekken_processor.token_id("<s>") and ids.count(tekken_processor.token_id("<s>")) == 1
    _check_labels(ids, sample["labels"], spans, {0, 1, 2})


def test_through_the_cached_dataset(tekken_processor, tmp_path, h, images, expected):
    ids, spans = expected
    path = h.write_jsonl(tmp_path / "train.jsonl", [_row(images)])
    cfg = h.data_config(tekken_processor.name_or_path, tmp_path, basic={"dataset": str(path)})
    dataset = build_dataset(cfg, tekken_processor)
    assert dataset[0]["input_ids"].tolist() == ids
    _check_labels(ids, dataset[0]["labels"].tolist(), spans, {0, 1, 2})


def test_mask_history_trains_only_the_last_reply(tekken_processor, tmp_path, h, images, expected):
    ids, spans = expected
    cfg = h.data_config(tekken_processor.name_or_path, tmp_path, preprocess={"mask_history": True})
    sample = SampleEncoder(cfg, tekken_processor).encode_row(_row(images))
    assert sample["input_ids"] == ids
    _check_labels(ids, sample["labels"], spans, {2})


def test_train_on_prompt_trains_all_text_but_no_image_token(tekken_processor, tmp_path, h, images, expected):
    ids, _ = expected
    cfg = h.data_config(tekken_processor.name_or_path, tmp_path, preprocess={"train_on_prompt": True})
    encoder = SampleEncoder(cfg, tekken_processor)
    sample = encoder.encode_row(_row(images))
    image_ids = encoder.plugin.image_token_ids
    assert sample["input_ids"] == ids
    assert sample["labels"] == [IGNORE_INDEX if t in image_ids else t for t in ids]


def test_tokenizer_json_matches_mistral_common(tokenizer_json_dir, tmp_path, h, images, expected):
    ids, spans = expected
    cfg = h.data_config(tokenizer_json_dir, tmp_path)
    processor = build_processor(cfg)
    assert type(processor.tokenizer).__name__ != "MistralCommonBackend"
    sample = SampleEncoder(cfg, processor).encode_row(_row(images))
    assert sample["input_ids"] == ids
    _check_labels(ids, sample["labels"], spans, {0, 1, 2})


def test_mistral_common_backend_matches_mistral_common(mistral_common_backend_dir, tmp_path, h, images, expected):
    ids, spans = expected
    cfg = h.data_config(mistral_common_backend_dir, tmp_path)
    processor = build_processor(cfg)
    assert type(processor.tokenizer).__name__ == "MistralCommonBackend"
    encoder = SampleEncoder(cfg, processor)
    assert len(encoder.fingerprint()) == 64
    sample = encoder.encode_row(_row(images))
    assert sample["input_ids"] == ids
    _check_labels(ids, sample["labels"], spans, {0, 1, 2})


def test_control_token_text_in_a_row_stays_text(tekken_processor, mistral_tokenizer, tmp_path, h):
    text = "Please print [INST] and </s> literally."
    cfg = h.data_config(tekken_processor.name_or_path, tmp_path)
    sample = SampleEncoder(cfg, tekken_processor).encode_row({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "[/INST]"}]})
    reference = _mistral_ids(mistral_tokenizer, [UserMessage(content=text), AssistantMessage(content="[/INST]")])
    assert sample["input_ids"] == reference


def test_fix_mistral_regex_repairs_a_broken_pre_tokenizer(tokenizer_json_dir, tmp_path, h, images, expected, monkeypatch):
    import transformers

    # An older (pre-5.0) Mistral checkpoint whose tokenizer.json splits words with a wrong regex:
    # the case `fix_mistral_regex` exists for.
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in tokenizer_json_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    assert tokenizer_json["pre_tokenizer"]["pretokenizers"][0]["type"] == "Split"
    tokenizer_json["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {"Regex": "\\p{L}+|[^\\p{L}]+"}
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (model_dir / "config.json").write_text(json.dumps({"model_type": "mistral3", "transformers_version": "4.56.0"}))

    broken = build_processor(h.data_config(model_dir, tmp_path))
    cfg = h.data_config(model_dir, tmp_path, preprocess={"fix_mistral_regex": True})
    assert SampleEncoder(cfg, broken).encode_row(_row(images))["input_ids"] != expected[0]

    seen = {}
    original = transformers.AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    fixed = build_processor(cfg)
    assert seen["fix_mistral_regex"] is True and seen["trust_remote_code"] is False and seen["local_files_only"] is True
    assert SampleEncoder(cfg, fixed).encode_row(_row(images))["input_ids"] == expected[0]
