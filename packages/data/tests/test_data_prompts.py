"""Prompt data for online RL (`attr.prompt_only: true`): formats, the ground truth's column, the prompt tokens
(exactly the SFT encoding up to where the answer's trained tokens start), bad prompts, the dataset and the loader's
uncollated prompt micro-batches."""

from __future__ import annotations

import pytest
import torch

from mmfsdp.data import BadSample, SampleEncoder, build_dataloader, build_dataset
from mmfsdp.data.conversation import parse_prompt
from mmfsdp.data.templates import IGNORE_INDEX

FAMILIES = {"qwen3_vl": "qwen_processor", "qwen3_vl_nothink": "qwen_processor", "mistral": "tekken_processor"}
COLLATOR = {"qwen_processor": "qwen3_vl", "tekken_processor": "pixtral"}


def _attr(**extra):
    from mmfsdp.config import build
    from mmfsdp.data import AttrConfig

    return build(AttrConfig, {"prompt_only": True, **extra}, "attr")


USER = {"role": "user", "content": "<image>How many circles?"}


@pytest.mark.parametrize(
    ("row", "truth"),
    [
        ({"messages": [USER], "images": ["a.png"], "solution": "3"}, "3"),
        ({"messages": [USER], "images": ["a.png"], "answer": 3}, 3),
        ({"messages": [USER], "images": ["a.png"], "solution": [1, 2, 3, 4], "answer": "x"}, [1, 2, 3, 4]),
        ({"messages": [USER, {"role": "assistant", "content": "three"}], "images": ["a.png"]}, "three"),
        ({"messages": [USER, {"role": "assistant", "content": "three"}], "images": ["a.png"], "solution": "3"}, "3"),
    ],
)
def test_prompt_rows_give_the_prompt_and_its_ground_truth(row, truth):
    prompt = parse_prompt(row, _attr())
    assert prompt.ground_truth == truth
    assert prompt.conversation.turns == [("<image>How many circles?", "")]
    assert prompt.conversation.images == ["a.png"]


def test_alpaca_prompts_and_missing_ground_truth():
    alpaca = _attr(formatting="alpaca")
    prompt = parse_prompt({"instruction": "Add", "input": "1 + 2", "output": "3"}, alpaca)
    assert prompt.ground_truth == "3" and prompt.conversation.turns == [("Add\n1 + 2", "")]
    for row in ({"messages": [USER], "images": ["a.png"]}, {"messages": [USER], "images": ["a.png"], "solution": " "}):
        with pytest.raises(BadSample) as bad:
            parse_prompt(row, _attr())
        assert bad.value.reason == "missing_solution"


@pytest.mark.parametrize("option", [{}, {"mask_history": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("template", list(FAMILIES))
def test_prompt_tokens_are_the_sft_encoding_before_the_answer(template, option, request, tmp_path, h):
    processor = request.getfixturevalue(FAMILIES[template])
    pp = {"template": template, **option}
    sft = SampleEncoder(h.data_config(processor.name_or_path, tmp_path, preprocess=pp), processor)
    encoder = SampleEncoder(h.data_config(processor.name_or_path, tmp_path, preprocess=pp, attr={"prompt_only": True}),
                            processor)
    image = h.write_image(tmp_path / "a.png", 40, 70, seed=1)
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, ask me."}]
    for before in ([], history):
        messages = [*before, {"role": "user", "content": "<image>What shape is this?"}]
        answer = {"role": "assistant", "content": "a red circle"}
        out = encoder.encode_row({"messages": messages, "images": ["a.png"], "solution": "a red circle"})
        want = sft.encode_row({"messages": [*messages, answer], "images": ["a.png"]})
        n = len(out["input_ids"])
        assert out["input_ids"] == want["input_ids"][:n] and out["labels"] == [IGNORE_INDEX] * n
        assert want["labels"][n] != IGNORE_INDEX and all(label == IGNORE_INDEX for label in want["labels"][n - 3 : n])
        assert out["solution"] == '"a red circle"' and out["prompt_text"] == "<image>What shape is this?"
        assert out["image_grids"] == want["image_grids"] and out["images"] == [image]
    last_trained = max(i for i, label in enumerate(want["labels"]) if label != IGNORE_INDEX)
    assert encoder.answer_end_ids() == [want["input_ids"][last_trained]]


def test_prompt_dataset_and_loader(qwen_processor, tmp_path, h):
    h.write_image(tmp_path / "a.png", 40, 70, seed=1)
    rows = [
        {"messages": [{"role": "user", "content": "<image>What shape?"}], "images": ["a.png"], "solution": "circle"},
        {"messages": [{"role": "user", "content": "What colour is a banana?"},
                      {"role": "assistant", "content": "yellow"}]},
        {"messages": [{"role": "user", "content": "No truth here"}]},
    ]
    h.write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = h.data_config(qwen_processor.name_or_path, tmp_path, preprocess={"template": "qwen3_vl_nothink"},
                        basic={"dataset": "prompts.jsonl", "shuffle": False}, attr={"prompt_only": True},
                        loader={"collate_param": {"model_name": "qwen3_vl"}})
    dataset = build_dataset(cfg, qwen_processor)
    assert dataset.is_prompt and len(dataset) == 2 and dataset.bad_row_counts == {"missing_solution": 1}
    first, second = dataset[0], dataset[1]
    assert (first["prompt_index"], first["solution"], second["solution"]) == (0, "circle", "yellow")
    assert "pixel_values" in first and "pixel_values" not in second
    assert torch.all(first["labels"] == IGNORE_INDEX)
    loader = build_dataloader(dataset, cfg, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0)
    batch = next(iter(loader))
    assert list(batch) == ["prompts"] and [p["prompt_index"] for p in batch["prompts"]] == [0, 1]
    assert torch.equal(batch["prompts"][0]["input_ids"], first["input_ids"])
