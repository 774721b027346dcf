"""Preference (pairwise) data: formats, token-exact pair encoding, bad pairs, the pair batch contract, the loader.

Every format (LLaMA-Factory sharegpt and alpaca pairwise, ms-swift, mllm with `rejected`) parses to the same pair;
a pair's chosen (rejected) sequence is exactly the SFT encoding of the conversation with that answer, for the
qwen3_vl, qwen3_vl_nothink and mistral templates with images, under train_on_prompt and mask_history. Batches hold
chosen_0, rejected_0, chosen_1, ... as rows (padded) or `cu_seq_lens` segments (padding-free, packing), each with
its own copy of the pair's pixels, and `pair_index`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from mmfsdp.data import AttrConfig, DataError, SampleEncoder, build_dataloader, build_dataset
from mmfsdp.data.cli import main
from mmfsdp.data.conversation import Pair, parse_pair

SYSTEM = "You are a careful assistant."
HISTORY = ("Hello there, what can you do?", "I describe pictures.")
PAIRS = [  # (user, chosen, rejected, image sizes (width, height))
    ("<image>What shape and colour is this?", "a red circle", "a blue circle", [(40, 70)]),
    ("Compare these:<image><image>", "The second one is wider.", "The first one.", [(300, 120), (64, 64)]),
    ("Thanks! Anything else?", "No, that's all.", "Yes: a noisy square, a circle and many more words here.", []),
    ("What colour is the sky?", "blue", "green, as everyone knows", []),
    ("<image>And this one?", "a square", "a wide red triangle, clearly", [(64, 64)]),
]
SHAREGPT = {
    "messages": "conversations",
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
}


def _messages(user: str, answer: str | None, history: bool, tags: dict | None = None) -> list[dict]:
    tags = {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        **(tags or {}),
    }
    role, content, usr, asst = (tags[k] for k in ("role_tag", "content_tag", "user_tag", "assistant_tag"))
    out = [{role: "system", content: SYSTEM}]
    if history:
        out += [{role: usr, content: HISTORY[0]}, {role: asst, content: HISTORY[1]}]
    out.append({role: usr, content: user})
    if answer is not None:
        out.append({role: asst, content: answer})
    return out


def _formats(user, chosen, rejected, images, history=True) -> dict[str, tuple[dict, dict]]:
    """(row, attr) of one pair in every format."""
    sharegpt_user = {k: v for k, v in SHAREGPT.items()}
    return {
        "mllm": ({"messages": _messages(user, chosen, history), "rejected": rejected, "images": images}, {}),
        "mllm_message": (
            {
                "messages": _messages(user, chosen, history),
                "rejected": {"role": "assistant", "content": rejected},
                "images": images,
            },
            {},
        ),
        "swift": ({"messages": _messages(user, chosen, history), "rejected_response": rejected, "images": images}, {}),
        "sharegpt": (
            {
                "conversations": _messages(user, None, history, sharegpt_user),
                "chosen": {"from": "gpt", "value": chosen},
                "rejected": {"from": "gpt", "value": rejected},
                "images": images,
            },
            SHAREGPT,
        ),
        "sharegpt_strings": (
            {
                "conversations": _messages(user, None, history, sharegpt_user),
                "chosen": chosen,
                "rejected": rejected,
                "images": images,
            },
            SHAREGPT,
        ),
    }


def _sft_row(user, answer, images, history=True) -> dict:
    return {"messages": _messages(user, answer, history), "images": images}


def test_every_format_parses_to_the_same_pair():
    for user, chosen, rejected, _ in PAIRS:
        images = [f"x{i}.png" for i in range(user.count("<image>"))]
        pairs = [
            parse_pair(row, AttrConfig(ranking=True, **attr))
            for row, attr in _formats(user, chosen, rejected, images).values()
        ]
        assert all(p == pairs[0] for p in pairs) and isinstance(pairs[0], Pair)
        assert pairs[0].rejected == rejected and pairs[0].conversation.turns[-1] == (user, chosen)
        assert pairs[0].conversation.turns[0] == HISTORY and pairs[0].conversation.system == SYSTEM
        assert pairs[0].conversation.images == images
    # alpaca: instruction + "\n" + input is the user turn; no history, no system
    alpaca = AttrConfig(ranking=True, formatting="alpaca")
    row = {
        "instruction": "<image>What shape",
        "input": "and colour is this?",
        "chosen": "a red circle",
        "rejected": "a blue circle",
        "images": ["x.png"],
    }
    pair = parse_pair(row, alpaca)
    assert pair.conversation.turns == [("<image>What shape\nand colour is this?", "a red circle")]
    assert pair.rejected == "a blue circle" and pair.conversation.images == ["x.png"]
    sharegpt = parse_pair(
        {
            "conversations": [{"from": "human", "value": "<image>What shape\nand colour is this?"}],
            "chosen": "a red circle",
            "rejected": "a blue circle",
            "images": ["x.png"],
        },
        AttrConfig(ranking=True, **SHAREGPT),
    )
    assert sharegpt == pair


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"messages": [{"role": "user", "content": "q"}], "rejected": "r"}, "missing_chosen"),
        ({"messages": [{"role": "user", "content": "q"}], "chosen": "  ", "rejected": "r"}, "missing_chosen"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "missing_rejected"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "rejected": ""},
            "missing_rejected",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "rejected": "a"},
            "identical_pair",
        ),
        (
            {
                "messages": [{"role": "user", "content": "q"}],
                "chosen": {"role": "user", "content": "a"},
                "rejected": "r",
            },
            "wrong_role_order",
        ),
        ({"messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "<image>"}, "image_in_wrong_turn"),
        (
            {
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "chosen": "b",
                "rejected": "r",
            },
            "bad_content",
        ),
        ({"messages": []}, "empty_conversation"),
    ],
)
def test_bad_pair_reasons(row, reason):
    from mmfsdp.data import BadSample

    with pytest.raises(BadSample) as err:
        parse_pair(row, AttrConfig(ranking=True))
    assert err.value.reason == reason


def _pair_images(tmp_path, h) -> list[list[str]]:
    out = []
    for i, (_, _, _, sizes) in enumerate(PAIRS):
        out.append(
            [h.write_image(tmp_path / f"p{i}_{k}.png", w, hh, seed=10 * i + k) for k, (w, hh) in enumerate(sizes)]
        )
    return out


FAMILIES = {"qwen3_vl": "qwen_processor", "qwen3_vl_nothink": "qwen_processor", "mistral": "tekken_processor"}
COLLATOR = {"qwen_processor": "qwen3_vl", "tekken_processor": "pixtral"}


@pytest.mark.parametrize("option", [{}, {"train_on_prompt": True}, {"mask_history": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("template", list(FAMILIES))
def test_pair_sequences_are_the_sft_encodings(template, option, request, tmp_path, h):
    processor = request.getfixturevalue(FAMILIES[template])
    pp = {"template": template, **option}
    sft = SampleEncoder(h.data_config(processor.name_or_path, tmp_path, preprocess=pp), processor)
    images = _pair_images(tmp_path, h)
    for history in (False, True):
        for attr_name in ("mllm", "sharegpt"):
            cfg = h.data_config(
                processor.name_or_path,
                tmp_path,
                preprocess=pp,
                attr={"ranking": True, **_formats(*PAIRS[0][:3], [])[attr_name][1]},
            )
            encoder = SampleEncoder(cfg, processor)
            for (user, chosen, rejected, _), paths in zip(PAIRS, images):
                row = _formats(user, chosen, rejected, paths, history)[attr_name][0]
                out = encoder.encode_row(row)
                want_chosen = sft.encode_row(_sft_row(user, chosen, paths, history))
                want_rejected = sft.encode_row(_sft_row(user, rejected, paths, history))
                assert out["input_ids"] == want_chosen["input_ids"] and out["labels"] == want_chosen["labels"]
                prompt = out["prompt_length"]
                assert out["input_ids"][:prompt] + out["rejected_ids"] == want_rejected["input_ids"]
                assert out["labels"][:prompt] + out["rejected_labels"] == want_rejected["labels"]
                assert out["image_grids"] == want_chosen["image_grids"] and out["images"] == paths
                assert 0 < prompt < len(out["input_ids"]) and out["rejected_ids"]


def _write_pairs(tmp_path, h, images, name="pairs.jsonl", extra=()) -> str:
    rows = [_formats(u, c, r, p)["mllm"][0] for (u, c, r, _), p in zip(PAIRS, images)]
    h.write_jsonl(tmp_path / name, [*rows, *extra])
    return name


def _pair_cfg(h, processor, tmp_path, name, **sections):
    basic = {"dataset": name, **sections.pop("basic", {})}
    loader = {"collate_param": {"model_name": COLLATOR[sections.pop("fixture")]}, **sections.pop("loader", {})}
    pp = {"template": sections.pop("template"), **sections.pop("preprocess", {})}
    return h.data_config(
        processor.name_or_path, tmp_path, preprocess=pp, basic=basic, loader=loader, attr={"ranking": True}
    )


@pytest.mark.parametrize("template", ["qwen3_vl", "mistral"])
def test_the_cached_dataset_serves_each_pair_once_with_both_sequences(template, request, tmp_path, h):
    fixture = FAMILIES[template]
    processor = request.getfixturevalue(fixture)
    images = _pair_images(tmp_path, h)
    name = _write_pairs(tmp_path, h, images)
    cfg = _pair_cfg(h, processor, tmp_path, name, fixture=fixture, template=template)
    dataset = build_dataset(cfg, processor)
    assert dataset.is_preference and len(dataset) == len(PAIRS)
    sft_rows = [_sft_row(u, a, p) for (u, c, r, _), p in zip(PAIRS, images) for a in (c, r)]
    h.write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    sft_cfg = h.data_config(
        processor.name_or_path, tmp_path, preprocess={"template": template}, basic={"dataset": "sft.jsonl"}
    )
    sft = build_dataset(sft_cfg, processor)
    assert not sft.is_preference
    for i in range(len(dataset)):
        item = dataset[i]
        assert item["pair_index"] == i
        assert dataset.lengths[i] == sft.lengths[2 * i] + sft.lengths[2 * i + 1]
        for k, key in enumerate(("chosen", "rejected")):
            want = sft[2 * i + k]
            assert item[key].keys() == want.keys()
            for name_, value in want.items():
                assert _same(item[key][name_], value), (i, key, name_)
    stats, sft_stats = dataset.sample_stats(), sft.sample_stats()
    assert np.array_equal(stats.tokens, sft_stats.tokens[0::2] + sft_stats.tokens[1::2])
    assert np.array_equal(stats.patches, sft_stats.patches[0::2] + sft_stats.patches[1::2])


def test_bad_pairs_are_counted_and_strict_names_file_row_reason(qwen_processor, tmp_path, h):
    images = _pair_images(tmp_path, h)
    long_answer = " ".join(["many more words"] * 60)
    extra = [
        {"messages": _messages("q", None, False), "rejected": "r"},  # no chosen
        {"messages": _messages("q", "a", False)},  # no rejected
        {"messages": _messages("q", "same", False), "rejected": "same"},
        {"messages": _messages("q", "a", False), "rejected": long_answer},  # rejected over cutoff_len
    ]
    name = _write_pairs(tmp_path, h, images, extra=extra)
    cfg = _pair_cfg(
        h, qwen_processor, tmp_path, name, fixture="qwen_processor", template="qwen3_vl", preprocess={"cutoff_len": 200}
    )
    dataset = build_dataset(cfg, qwen_processor)
    assert len(dataset) == len(PAIRS) and dataset.num_rows == len(PAIRS) + 4
    assert dataset.bad_row_counts == {
        "missing_chosen": 1,
        "missing_rejected": 1,
        "identical_pair": 1,
        "pair_too_long": 1,
    }
    assert int(max(dataset.lengths)) <= 2 * 200
    strict = _pair_cfg(
        h,
        qwen_processor,
        tmp_path,
        name,
        fixture="qwen_processor",
        template="qwen3_vl",
        preprocess={"cutoff_len": 200},
        basic={"strict": True},
    )
    with pytest.raises(
        DataError, match=rf"{name} row {len(PAIRS)}: missing_chosen: column 'chosen' is missing \(strict"
    ):
        build_dataset(strict, qwen_processor)


def _same(a, b) -> bool:
    """Equal tensors, or equal lists of tensors (pixtral's `pixel_values`)."""
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def _sequences(batch) -> list[torch.Tensor]:
    """The batch's sequences in row-major order, without padding: rows, or the `cu_seq_lens` segments."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    if "cu_seq_lens" not in batch:
        return [ids[b][mask[b]] for b in range(ids.shape[0])]
    cu = batch["cu_seq_lens"].tolist()
    flat_ids, flat_mask = ids.reshape(-1), mask.reshape(-1)
    return [flat_ids[a:b][flat_mask[a:b]] for a, b in zip(cu[:-1], cu[1:])]


def _check_batch(batch, dataset, sample_multiple=1) -> int:
    pairs = batch["pair_index"]
    assert pairs.dtype == torch.int64 and pairs.dim() == 1
    items = [dataset[int(i)] for i in pairs]
    want = [item[key] for item in items for key in ("chosen", "rejected")]
    got = _sequences(batch)
    assert len(got) == 2 * len(items)  # exactly one row / segment per sequence: no padding segment in between
    for g, w in zip(got, want):
        assert torch.equal(g, w["input_ids"])
    if "cu_seq_lens" in batch:
        segments = batch["cu_seq_lens"].diff()
        assert bool((segments % sample_multiple == 0).all()) and batch["max_length"] == int(segments.max())
        # every segment is one sequence: its labels are that sequence's (padding is untrained)
        flat_labels = batch["labels"].reshape(-1)
        cu = batch["cu_seq_lens"].tolist()
        for k, w in enumerate(want):
            seg = flat_labels[cu[k] : cu[k + 1]]
            assert torch.equal(seg[: len(w["labels"])], w["labels"]) and bool((seg[len(w["labels"]) :] == -100).all())
        if "position_ids" in batch:  # pixtral: positions restart at every segment, padding included
            flat_positions = batch["position_ids"].reshape(-1)
            for a, b in zip(cu[:-1], cu[1:]):
                assert torch.equal(flat_positions[a:b], torch.arange(b - a))
    else:
        for k, w in enumerate(want):
            assert torch.equal(batch["labels"][k][: len(w["labels"])], w["labels"])
    with_pixels = [w for w in want if "pixel_values" in w]
    if "image_grid_thw" in batch:  # qwen3_vl: patches concatenated in sequence order
        assert torch.equal(batch["pixel_values"], torch.cat([w["pixel_values"] for w in with_pixels]))
        assert torch.equal(batch["image_grid_thw"], torch.cat([w["image_grid_thw"] for w in with_pixels]))
    elif "image_sizes" in batch:  # pixtral: one image per placeholder, in sequence order
        assert torch.equal(
            batch["image_sizes"], torch.cat([torch.as_tensor(w["image_sizes"]).reshape(-1, 2) for w in with_pixels])
        )
        assert batch["pixel_values"].shape[0] == sum(len(w["pixel_values"]) for w in with_pixels)
    else:
        assert not with_pixels
    return len(items)


LAYOUTS = {
    "padded": {"loader": {"padding_free": False}},
    "padding_free": {"loader": {"padding_free": True}},
    "packing": {"basic": {"packing": True}, "preprocess": {"cutoff_len": 256}, "loader": {"drop_last": False}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("template", ["qwen3_vl", "mistral"])
def test_batches_keep_the_pair_order_pair_index_and_pixels_per_sequence(template, layout, request, tmp_path, h):
    fixture = FAMILIES[template]
    processor = request.getfixturevalue(fixture)
    images = _pair_images(tmp_path, h)
    name = _write_pairs(tmp_path, h, images)
    sections = {k: dict(v) for k, v in LAYOUTS[layout].items()}
    sections.setdefault("basic", {})["shuffle"] = True
    cfg = _pair_cfg(h, processor, tmp_path, name, fixture=fixture, template=template, **sections)
    dataset = build_dataset(cfg, processor)
    multiple = 4 if layout == "packing" else 1
    seen = []
    for rank in range(2):
        loader = build_dataloader(
            dataset,
            cfg,
            micro_batch_size=2,
            dp_rank=rank,
            dp_size=2,
            seed=3,
            sample_multiple=multiple,
            pad_to_multiple_of=multiple,
        )
        for _ in range(loader.batches_per_epoch):
            batch = next(loader)
            assert ("cu_seq_lens" in batch) == (layout != "padded")
            _check_batch(batch, dataset, multiple)
            seen += batch["pair_index"].tolist()
    if layout != "packing":  # drop_last: 2 steps × 2 ranks × 2 pairs = 4 of the 5 pairs, each once
        assert len(seen) == len(set(seen)) == 4
    else:  # rows of up to 2 × 256 tokens of whole pairs; the last global batch repeats the first rows
        assert set(seen) == set(range(len(PAIRS)))


def test_pair_collator_packs_several_rows_with_sample_multiple(qwen_processor, tmp_path, h):
    """Two packed rows of two pairs each: segment k is sequence k across the rows, each a multiple of 8 tokens."""
    from mmfsdp.data.collators import PairCollator
    from mmfsdp.data.families.qwen3_vl.collator import Qwen3VLCollator

    images = _pair_images(tmp_path, h)
    name = _write_pairs(tmp_path, h, images)
    cfg = _pair_cfg(h, qwen_processor, tmp_path, name, fixture="qwen_processor", template="qwen3_vl")
    dataset = build_dataset(cfg, qwen_processor)
    collator = PairCollator(Qwen3VLCollator(pad_token_id=0, pad_to_multiple_of=16, packing=True, sample_multiple=8))
    rows = [[dataset[0], dataset[2]], [dataset[1], dataset[3]]]
    batch = collator(rows)
    assert batch["input_ids"].shape[0] == 2 and batch["pair_index"].tolist() == [0, 2, 1, 3]
    assert _check_batch(batch, dataset, 8) == 4
    padded = PairCollator(Qwen3VLCollator(pad_token_id=0))([[dataset[4]], [dataset[2]]])
    assert padded["input_ids"].shape[0] == 4 and padded["pair_index"].tolist() == [4, 2]
    _check_batch(padded, dataset)


def test_token_budget_and_balance_plan_whole_pairs_and_resume(qwen_processor, tmp_path, h):
    images = _pair_images(tmp_path, h)
    name = _write_pairs(tmp_path, h, images)
    cfg = _pair_cfg(
        h,
        qwen_processor,
        tmp_path,
        name,
        fixture="qwen_processor",
        template="qwen3_vl",
        loader={"balance": True, "padding_free": True, "drop_last": False},
    )
    dataset = build_dataset(cfg, qwen_processor)
    budget = int(dataset.lengths.max())  # one pair's both sequences fit; two of the longest do not
    seen = []
    for rank in range(2):
        loader = build_dataloader(
            dataset, cfg, micro_batch_size=2, dp_rank=rank, dp_size=2, seed=1, micro_batch_tokens=budget
        )
        assert loader.stats.tokens.tolist() == dataset.lengths.tolist()
        batches = loader.next_step(1)
        for batch in batches:
            pairs = _check_batch(batch, dataset)
            trained_pairs = [int(i) for i in batch["pair_index"]]
            tokens = int(batch["attention_mask"].sum())
            assert tokens == sum(int(dataset.lengths[i]) for i in trained_pairs)
            assert tokens <= budget or pairs == 1
            if bool((batch["labels"] != -100).any()):
                seen += trained_pairs
        state = loader.state_dict()
        again = build_dataloader(
            dataset, cfg, micro_batch_size=2, dp_rank=rank, dp_size=2, seed=1, micro_batch_tokens=budget
        )
        again.load_state_dict(state)
        want = [b["pair_index"].tolist() for b in loader.next_step(1)]
        assert [b["pair_index"].tolist() for b in again.next_step(1)] == want
    assert set(seen) <= set(range(len(PAIRS))) and seen


def test_cli_inspect_and_stats_show_pairs(qwen_dir, tmp_path, h, capsys):
    images = _pair_images(tmp_path, h)
    name = _write_pairs(tmp_path, h, images, extra=[{"messages": _messages("q", "same", False), "rejected": "same"}])
    cfg = {
        "data": {
            "dataset_param": {
                "attr": {"ranking": True},
                "preprocess_parameters": {"model_name_or_path": str(qwen_dir), "template": "qwen3_vl_nothink"},
                "basic_parameters": {
                    "dataset_dir": str(tmp_path),
                    "dataset": name,
                    "cache_dir": str(tmp_path / "cache"),
                },
            },
            "dataloader_param": {"num_workers": 0, "collate_param": {"model_name": "qwen3_vl"}},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["inspect", str(path), "--index", "0"]) == 0
    out = capsys.readouterr().out
    assert "pair 0 of 5" in out and "chosen tokens:" in out and "rejected tokens:" in out
    assert "⟦a red circle<|im_end|>⟧" in out and "⟦a blue circle<|im_end|>⟧" in out
    assert main(["inspect", str(path), "--index", "0", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (
        shown["pair"]
        and shown["rejected_input_ids"][: shown["prompt_length"]] == shown["input_ids"][: shown["prompt_length"]]
    )
    assert main(["stats", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["pairs"] and stats["num_samples"] == 5 and stats["num_rows"] == 6
    assert stats["bad_rows"] == {"identical_pair": 1}
    assert main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "5 pairs (train): 3 with images" in out and "bad pairs skipped: 1 of 6 rows (identical_pair=1)" in out


def test_alpaca_rows_for_sft():
    from mmfsdp.data import parse_row

    attr = AttrConfig(formatting="alpaca", system="system")
    conversation = parse_row(
        {
            "instruction": "<image>Name it",
            "input": "",
            "output": "a circle",
            "system": "Be brief.",
            "images": ["x.png"],
        },
        attr,
    )
    assert conversation.turns == [("<image>Name it", "a circle")] and conversation.system == "Be brief."
    assert conversation.images == ["x.png"]


def test_a_filler_pair_trains_nothing_in_either_sequence():
    from mmfsdp.data.loader import _masked

    ids = torch.arange(5)
    pair = {"chosen": {"input_ids": ids, "labels": ids}, "rejected": {"input_ids": ids, "labels": ids}, "pair_index": 3}
    masked = _masked(pair)
    assert masked["pair_index"] == 3 and torch.equal(masked["chosen"]["input_ids"], ids)
    assert all(bool((masked[key]["labels"] == -100).all()) for key in ("chosen", "rejected"))


def test_video_pairs_carry_the_video_once_per_sequence(qwen_dir, tmp_path, h):
    """A pair with a video and an image (Qwen3-VL processor files): each sequence is the SFT sample, and a padded
    batch holds the pair's video patches twice, chosen's then rejected's."""
    import shutil
    from pathlib import Path

    from mmfsdp.data import build_processor
    from mmfsdp.data.collators import PairCollator
    from mmfsdp.data.families.qwen3_vl.collator import Qwen3VLCollator

    model_dir = tmp_path / "qwen3_vl_model"
    shutil.copytree(qwen_dir, model_dir)
    for file in (Path(__file__).parent / "data" / "qwen3_vl_processor").iterdir():
        shutil.copy(file, model_dir / file.name)
    h.write_video(tmp_path / "a.mp4", 12, 48, 32, fps=8)
    h.write_image(tmp_path / "b.png", 40, 70)
    pp = {"template": "qwen3_vl_nothink"}
    processor = build_processor(h.data_config(model_dir, tmp_path, preprocess=pp))
    messages = [{"role": "user", "content": "<video><image>What moves?"}, {"role": "assistant", "content": "A square."}]
    h.write_jsonl(
        tmp_path / "pairs.jsonl",
        [{"messages": messages, "rejected": "Nothing.", "images": ["b.png"], "videos": ["a.mp4"]}],
    )
    sft_rows = [
        {"messages": [messages[0], {"role": "assistant", "content": a}], "images": ["b.png"], "videos": ["a.mp4"]}
        for a in ("A square.", "Nothing.")
    ]
    h.write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    attr = {"videos": "videos"}
    pairs = build_dataset(
        h.data_config(
            model_dir, tmp_path, preprocess=pp, basic={"dataset": "pairs.jsonl"}, attr={**attr, "ranking": True}
        ),
        processor,
    )
    sft = build_dataset(
        h.data_config(model_dir, tmp_path, preprocess=pp, basic={"dataset": "sft.jsonl"}, attr=attr), processor
    )
    assert pairs.media_kinds() == {"image", "video"} and len(pairs) == 1
    item = pairs[0]
    for k, key in enumerate(("chosen", "rejected")):
        want = sft[k]
        assert item[key].keys() == want.keys() and {"pixel_values_videos", "video_grid_thw"} <= set(want)
        assert all(_same(item[key][name], value) for name, value in want.items())
    batch = PairCollator(Qwen3VLCollator(pad_token_id=processor.pad_token_id))([[item]])
    assert torch.equal(batch["pixel_values_videos"], torch.cat([sft[0]["pixel_values_videos"]] * 2))
    assert torch.equal(batch["video_grid_thw"], torch.cat([sft[0]["video_grid_thw"]] * 2))
    assert batch["pair_index"].tolist() == [0]
    _check_batch(batch, pairs)
