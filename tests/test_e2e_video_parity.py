"""Video rows under every parallel layout: parity through the real trainer, 5 steps, fp32 on gloo.

The data (`tests/mixed_data.py`, `make_mixed_video_dataset`) mixes, by row, a video clip written with PyAV
(4–12 frames, 4–8 fps, four sizes; every other one with an image beside it), rows of 1–2 images of different
sizes, and text-only rows. With one sample per micro-batch the ranks differ in what they hold: one rank a
video, the other images or text only. Every rank runs the vision tower the same number of times whatever it
holds (`TrainingForwardMixin`: a placeholder pass for each kind of media missing), so FSDP2's collectives pair
up. Every layout must give the per-step loss and gradient norm of the 1-process run with the same global batch
(relative difference <= 1e-5) on the same number of tokens:

- tiny Qwen3-VL: FSDP2 2 processes (one sample per micro-batch), Ulysses 2 and Ring 2 (one CP group: the same
  micro-batch as 1 process), packing + Ring 2 (against packed rows on 1 process);
- tiny Qwen3-VL MoE: expert parallel 2 on 2 processes (one sample per micro-batch).

The 1-process run's first step is also plain HF's: a `Qwen3VLForConditionalGeneration` with its initial
weights, given the first batch (videos, images and text) with `labels=`, has the same loss and gradient norm.
Each world size is spawned once (module fixture) and runs its trainers in turn.
"""

from pathlib import Path

import pytest

from mixed_data import make_mixed_video_dataset, row_media
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
MOE_CONFIG = ROOT / "examples" / "qwen3vl-moe-tiny" / "config.yaml"
MOE_ASSETS = ROOT / "examples" / "qwen3vl-moe-tiny" / "assets"
STEPS = 5
TOL = 1e-5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _overrides(tmp: Path, name: str, moe: bool, **extra) -> list[str]:
    assets = MOE_ASSETS if moe else ASSETS
    items = {
        "model.model_name_or_path": str(assets),
        "data.dataset_param.preprocess_parameters.model_name_or_path": str(assets),
        "data.dataset_param.dataset_type": "huggingface",
        "data.dataset_param.attr.videos": "videos",
        "data.dataset_param.basic_parameters.dataset": str(tmp / "mixed" / "train.jsonl"),
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "mixed"),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache" / ("moe" if moe else "dense")),
        "data.dataset_param.basic_parameters.shuffle": "false",  # rows in order: video, text, images, video, ...
        "data.dataset_param.preprocess_parameters.cutoff_len": 256,
        "data.dataset_param.preprocess_parameters.video_fps": 4.0,
        "data.dataset_param.preprocess_parameters.video_maxlen": 8,
        "training.micro_batch_size": 2,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    if moe:
        items["parallel.expert_parallel_size"] = items.get("parallel.expert_parallel_size", 1)
    return [f"{k}={v}" for k, v in items.items()]


MBS1 = {"training.micro_batch_size": 1}
PACKED = {"data.dataset_param.basic_parameters.packing": "true"}

# name: (world size, MoE, overrides, reference); a reference of None is a 1-process reference run
RUNS = {
    # the reference pads its micro-batches (the batch plain HF takes); the others are padding-free (the default)
    "ref": (1, False, {"data.dataloader_param.padding_free": "false"}, None),
    "ref_packed": (1, False, PACKED, None),
    "moe_ref": (1, True, {}, None),
    "fsdp2": (2, False, MBS1, "ref"),
    "ulysses2": (2, False, {"parallel.ulysses_parallel_size": 2}, "ref"),
    "ring2": (2, False, {"parallel.ring_attention_size": 2}, "ref"),
    "packed_ring2": (2, False, {**PACKED, "parallel.ring_attention_size": 2}, "ref_packed"),
    "moe_ep2": (2, True, {**MBS1, "parallel.expert_parallel_size": 2}, "moe_ref"),
}


def _first_batch_and_weights(trainer):
    """The trainer's first micro-batch (the loader is rewound) and a full copy of its initial weights."""
    from torch.distributed.tensor import DTensor

    state = trainer.loader.state_dict()
    batch = next(trainer.loader)
    trainer.loader.load_state_dict(state)
    weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in trainer.model.state_dict().items()}
    return batch, {k: v.detach().clone() for k, v in weights.items()}


def _hf_step(batch, weights) -> tuple[float, float]:
    """Loss and gradient norm of plain HF `Qwen3VLForConditionalGeneration(**inputs, labels=)` on `batch`."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from mmfsdp.model import model_inputs

    assert batch.get("pixel_values_videos") is not None, "the first batch should hold a video"
    with torch.random.fork_rng():
        model = Qwen3VLForConditionalGeneration._from_config(
            Qwen3VLConfig.from_pretrained(ASSETS), attn_implementation="sdpa"
        )
    model.load_state_dict(weights, strict=True)
    model.train()
    loss = model(**model_inputs(batch), labels=batch["labels"]).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss), float(norm)


def _media(kwargs) -> str:
    if kwargs.get("pixel_values_videos") is not None:
        return "video"
    return "image" if kwargs.get("pixel_values") is not None else "text"


def _train(rank, world_size, runs):
    from mmfsdp.train.trainer import Trainer

    results = {}
    for name, overrides in runs:
        trainer = Trainer(load_config(MOE_CONFIG if name.startswith("moe") else CONFIG, overrides), "cpu")
        first = _first_batch_and_weights(trainer) if name == "ref" else None
        media: list[str] = []
        trainer.model.register_forward_pre_hook(lambda m, args, kwargs: media.append(_media(kwargs)), with_kwargs=True)
        trainer.train()
        results[name] = {
            "layout": {
                "world": world_size,
                "dp": trainer.dims.dp_size,
                "ring": trainer.plan.ring,
                "ulysses": trainer.plan.ulysses,
            },
            "steps": [(r.loss, r.grad_norm, r.num_tokens) for r in trainer.history],
            "media": media,
            "samples_per_row": [len(row) for key in trainer.loader._epoch_plan(0)[:STEPS] for row in key],
        }
        if first is not None:
            results[name]["hf_step1"] = _hf_step(*first)
    return results


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("video")
    make_mixed_video_dataset(tmp / "mixed", num_train=30, num_eval=3, seed=7)
    return tmp


@pytest.fixture(scope="module")
def results(tmp):
    """Every run, the 1-process ones first (they also write the tokenized caches the others read)."""
    out = {}
    for world_size in (1, 2):
        runs = [
            (name, _overrides(tmp, name, moe, **extra))
            for name, (world, moe, extra, _) in RUNS.items()
            if world == world_size
        ]
        per_rank = run_distributed(_train, world_size, runs, timeout=900)
        for name in per_rank[0]:
            out[name] = {**per_rank[0][name], "media_per_rank": [r[name]["media"] for r in per_rank]}
    return out


def _close(value: float, reference: float) -> bool:
    return abs(value - reference) <= TOL * abs(reference)


@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run[3] is not None])
def test_video_rows_match_one_process(results, name):
    world, _, _, ref = RUNS[name]
    got, expected = results[name], results[ref]
    assert got["layout"]["world"] == world and expected["layout"]["world"] == 1
    assert len(got["steps"]) == len(expected["steps"]) == STEPS
    for step, ((loss, norm, tokens), (ref_loss, ref_norm, ref_tokens)) in enumerate(
        zip(got["steps"], expected["steps"]), 1
    ):
        assert tokens == ref_tokens, f"{name}, step {step}: {tokens} tokens vs {ref_tokens} in {ref}"
        assert _close(loss, ref_loss), f"{name}, step {step}: loss {loss} vs {ref_loss} ({ref})"
        assert _close(norm, ref_norm), f"{name}, step {step}: grad norm {norm} vs {ref_norm} ({ref})"


def test_layouts_are_what_they_say(results):
    expected = {
        "fsdp2": {"world": 2, "dp": 2, "ring": 1, "ulysses": 1},
        "ulysses2": {"world": 2, "dp": 1, "ring": 1, "ulysses": 2},
        "ring2": {"world": 2, "dp": 1, "ring": 2, "ulysses": 1},
        "packed_ring2": {"world": 2, "dp": 1, "ring": 2, "ulysses": 1},
    }
    for name, layout in expected.items():
        assert results[name]["layout"] == layout, f"{name} ran as {results[name]['layout']}"
    assert max(results["ref_packed"]["samples_per_row"]) > 1, "the packed runs should pack several samples a row"


def test_first_step_matches_plain_hf(results):
    loss, norm, _ = results["ref"]["steps"][0]
    hf_loss, hf_norm = results["ref"]["hf_step1"]
    assert _close(loss, hf_loss), f"step 1: trainer loss {loss} vs HF {hf_loss}"
    assert _close(norm, hf_norm), f"step 1: trainer grad norm {norm} vs HF {hf_norm}"


def test_the_data_really_mixes(tmp, results):
    """Rows hold videos (some beside an image), images only, or nothing; with one sample per micro-batch some
    micro-batches hold a video, some only images, some only text, and on some steps the ranks differ."""
    media = row_media(tmp / "mixed")
    assert {(1, 1), (1, 0), (0, 0)} <= set(media) and any(images and not videos for videos, images in media)
    for name in ("fsdp2", "moe_ep2"):
        per_rank = [kinds[:STEPS] for kinds in results[name]["media_per_rank"]]
        seen = {kind for kinds in per_rank for kind in kinds}
        assert seen == {"video", "image", "text"}, f"{name}: micro-batches held only {seen}"
        assert any(len(set(step)) > 1 for step in zip(*per_rank)), f"{name}: ranks never differed: {per_rank}"
    for ref in ("ref", "ref_packed", "moe_ref"):
        assert "video" in results[ref]["media"], f"{ref} saw no video"
        steps = results[ref]["steps"]
        assert steps[-1][0] < steps[0][0], f"{ref} should learn"
