"""Text-only rows under every parallel layout: parity through the real trainer, 5 steps, fp32 on gloo.

The data mixes rows of 1–2 images of different sizes with text-only rows (half of all rows,
`tests/mixed_data.py`), with one sample per micro-batch on most runs, so that ranks differ in what they
hold: steps where one rank's micro-batch has no image and steps where no rank has any (asserted from
what each rank's model received). A rank without media runs the vision side on the family's placeholder
(`TrainingForwardMixin`), so every rank runs the same FSDP2 collectives; before, gloo aborted here and
NCCL hung. Every layout must give the per-step loss and gradient norm of the 1-process run with the
same global batch (relative difference <= 1e-5) on the same number of tokens, and the same validation
loss where validation runs:

- tiny Mistral3: FSDP2 2 processes (also with validation, recompute + chunk loss, gradient accumulation 2,
  packing, LoRA on vision and decoder, meta init from an HF directory); HSDP 2 × 2, Ulysses 2 × DP 2 and
  Ring 2 × DP 2 on 4 processes;
- tiny Qwen3-VL MoE (DeepStack, M-RoPE, 8 experts): expert parallel 2 on 2 processes.

Vision data parallel (`parallel.vision_dp`, on by default under CP, `mmfsdp.model.vision_dp`): every CP run
above, and Ulysses 2 × Ring 2 (mistral3 and qwen3_vl with DeepStack, 4 processes), Ring 2 with packing
(mistral3 and qwen3_vl; their references pad packed samples to the multiple Ring 2 needs), Ulysses 2
(qwen3_vl) and expert parallel 2 × Ulysses 2 (qwen3_vl_moe) on 2 processes. Each rank records what it encoded;
the shares add up to the media of every call, and some calls have fewer media than ranks.

Each world size is spawned once (module fixture, bounded by its timeout) and runs its trainers in turn.
"""

from pathlib import Path

import pytest
import torch

from mixed_data import make_mixed_dataset, text_only_share
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
MOE = ROOT / "examples" / "qwen3vl-moe-tiny" / "config.yaml"
QWEN = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
QWEN_ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
MOE_ASSETS = ROOT / "examples" / "qwen3vl-moe-tiny" / "assets"
STEPS = 5
TOL = 1e-5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _overrides(tmp: Path, name: str, **extra) -> list[str]:
    items = {
        "data.dataset_param.dataset_type": "huggingface",
        "data.dataset_param.basic_parameters.dataset": str(tmp / "mixed" / "train.jsonl"),
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "mixed"),
        "data.dataset_param.basic_parameters.cache_dir": str(
            tmp / "cache" / next((family for family in ("moe", "qwen") if name.startswith(family)), "tiny")
        ),
        "data.dataset_param.preprocess_parameters.cutoff_len": 160,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


MBS1 = {"training.micro_batch_size": 1}
PACKED = {"data.dataset_param.basic_parameters.packing": "true"}
VAL = {
    "data.dataset_param.basic_parameters.eval_dataset": "{tmp}/mixed/eval.jsonl",
    "training.val_interval": STEPS,
    "training.eval_batch_size": 1,
}
LORA = {
    "training.lora.enable": "true",
    "training.lora.rank": 4,
    "training.lora.target_modules": "[q_proj,v_proj,o_proj]",  # Pixtral's and Mistral's attention
    "training.lr": 1.0e-2,
}
META = {
    "model.model_name_or_path": "{tmp}/hf",
    "model.random_init": "false",
}
MOE_SETTINGS = {
    "model.model_name_or_path": str(MOE_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(MOE_ASSETS),
    "parallel.expert_parallel_size": 1,
}
QWEN_SETTINGS = {
    "model.model_name_or_path": str(QWEN_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(QWEN_ASSETS),
}
MBS2 = {"training.micro_batch_size": 2}
SAMPLE_MULTIPLE = {"ref_packed_m4": 4, "qwen_ref_packed_m4": 4}
"""Packed 1-process references that pad every packed sample to the multiple Ring 2 needs, as the CP run does, so
that both pack the same rows."""

# name: (world size, config, overrides, reference); a reference of None is a 1-process reference run
RUNS = {
    "ref_mbs2": (1, TINY, {"training.micro_batch_size": 2, **VAL}, None),
    "ref_mbs4": (1, TINY, {"training.micro_batch_size": 4}, None),
    "ref_packed_mbs2": (1, TINY, {**PACKED, "training.micro_batch_size": 2}, None),
    "ref_lora": (1, TINY, {"training.micro_batch_size": 2, **LORA}, None),
    "ref_hf": (1, TINY, {"training.micro_batch_size": 2, **META}, None),
    "moe_ref": (1, MOE, {**MOE_SETTINGS, "training.micro_batch_size": 2}, None),
    "fsdp2": (2, TINY, {**MBS1, **VAL}, "ref_mbs2"),
    "fsdp2_recompute_chunk": (
        2,
        TINY,
        {
            **MBS1,
            "parallel.recompute": "true",
            "features.enable_chunk_loss": "true",
            "features.chunkloss_plan.chunk_size": 16,
        },
        "ref_mbs2",
    ),
    "fsdp2_accum2": (2, TINY, {**MBS1, "training.gradient_accumulation_steps": 2}, "ref_mbs4"),
    "fsdp2_packed": (2, TINY, {**MBS1, **PACKED}, "ref_packed_mbs2"),
    "fsdp2_lora": (2, TINY, {**MBS1, **LORA}, "ref_lora"),
    "fsdp2_meta": (
        2,
        TINY,
        {
            **MBS1,
            **META,
            "training.init_model_with_meta_device": "true",
            "training.load": "{tmp}/hf",
            "training.load_format": "hf",
        },
        "ref_hf",
    ),
    "moe_ep2": (2, MOE, {**MOE_SETTINGS, **MBS1, "parallel.expert_parallel_size": 2}, "moe_ref"),
    "hsdp2x2": (4, TINY, {**MBS1, "parallel.data_parallel_replicate_size": 2}, "ref_mbs4"),
    "ulysses2_dp2": (4, TINY, {**MBS1, "parallel.ulysses_parallel_size": 2}, "ref_mbs2"),
    "ring2_dp2": (4, TINY, {**MBS1, "parallel.ring_attention_size": 2}, "ref_mbs2"),
    # vision data parallel (on by default under CP): the CP ranks share out the micro-batch's images
    "ref_packed_m4": (1, TINY, {**PACKED, **MBS2}, None),
    "ulysses2_ring2": (
        4, TINY, {**MBS2, "parallel.ulysses_parallel_size": 2, "parallel.ring_attention_size": 2}, "ref_mbs2"
    ),
    "ring2_packed": (2, TINY, {**PACKED, **MBS2, "parallel.ring_attention_size": 2}, "ref_packed_m4"),
    "qwen_ref": (1, QWEN, {**QWEN_SETTINGS, **MBS2}, None),
    "qwen_ref_packed_m4": (1, QWEN, {**QWEN_SETTINGS, **PACKED, **MBS2}, None),
    "qwen_ulysses2": (2, QWEN, {**QWEN_SETTINGS, **MBS2, "parallel.ulysses_parallel_size": 2}, "qwen_ref"),
    "qwen_ring2_packed": (
        2, QWEN, {**QWEN_SETTINGS, **PACKED, **MBS2, "parallel.ring_attention_size": 2}, "qwen_ref_packed_m4"
    ),
    "qwen_ulysses2_ring2": (
        4, QWEN, {**QWEN_SETTINGS, **MBS2, "parallel.ulysses_parallel_size": 2, "parallel.ring_attention_size": 2},
        "qwen_ref",
    ),
    "moe_ep2_ulysses2": (
        2, MOE, {**MOE_SETTINGS, **MBS2, "parallel.expert_parallel_size": 2, "parallel.ulysses_parallel_size": 2},
        "moe_ref",
    ),
}
VISION_DP_RUNS = ("ulysses2_dp2", "ring2_dp2", "ulysses2_ring2", "ring2_packed", "qwen_ulysses2", "qwen_ring2_packed",
                  "qwen_ulysses2_ring2", "moe_ep2_ulysses2")


def _train(rank, world_size, tmp, runs):
    import mmfsdp.train.trainer as trainer_module

    results = {}
    required_multiple = trainer_module.required_multiple
    for name, config, overrides in runs:
        if name in SAMPLE_MULTIPLE:
            trainer_module.required_multiple = lambda ring, ulysses, multiple=SAMPLE_MULTIPLE[name]: multiple
        trainer = trainer_module.Trainer(load_config(config, overrides), "cpu")
        media: list[bool] = []
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: media.append(kwargs.get("pixel_values") is not None), with_kwargs=True
        )
        trainer.train()
        trainer_module.required_multiple = required_multiple
        vision_dp = trainer.model._vision_dp
        results[name] = {
            "layout": {
                "world": world_size,
                "dp": trainer.dims.dp_size,
                "ring": trainer.plan.ring,
                "ulysses": trainer.plan.ulysses,
            },
            "steps": [(r.loss, r.grad_norm, r.num_tokens) for r in trainer.history],
            "val": dict(trainer.val_losses),
            "media": media,
            "vision_dp": None if vision_dp is None else list(vision_dp.encoded),
        }
    return results


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    from transformers import AutoConfig, Mistral3ForConditionalGeneration

    tmp = tmp_path_factory.mktemp("text_only")
    make_mixed_dataset(tmp / "mixed", num_train=40, num_eval=6, seed=5)
    torch.manual_seed(3)
    Mistral3ForConditionalGeneration(AutoConfig.from_pretrained(ROOT / "examples" / "tiny" / "assets")).save_pretrained(
        tmp / "hf"
    )
    return tmp


@pytest.fixture(scope="module")
def results(tmp):
    """Every run, the 1-process ones first (they also write the tokenized caches the others read)."""
    out = {}
    for world_size in (1, 2, 4):
        runs = [
            (name, str(config), [item.format(tmp=tmp) for item in _overrides(tmp, name, **extra)])
            for name, (world, config, extra, _) in RUNS.items()
            if world == world_size
        ]
        per_rank = run_distributed(_train, world_size, str(tmp), runs, timeout=900)
        for name in per_rank[0]:
            out[name] = {
                **per_rank[0][name],
                "media_per_rank": [rank_results[name]["media"] for rank_results in per_rank],
                "vision_dp_per_rank": [rank_results[name]["vision_dp"] for rank_results in per_rank],
            }
    return out


def test_the_data_is_mixed(tmp):
    assert text_only_share(tmp / "mixed") >= 0.4
    assert text_only_share(tmp / "mixed", "eval") >= 0.4


def _close(value: float, reference: float) -> bool:
    return abs(value - reference) <= TOL * abs(reference)


@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run[3] is not None])
def test_text_only_rows_match_one_process(results, name):
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
    if expected["val"] and got["val"]:
        assert got["val"].keys() == expected["val"].keys()
        for step, value in got["val"].items():
            assert _close(value, expected["val"][step]), (
                f"{name}: val loss at {step} {value} vs {expected['val'][step]}"
            )


def test_ranks_differ_in_media(results):
    """The layouts above saw what they are meant to: one-sample micro-batches where one rank had an image and
    the other none, and steps where no rank had any (training micro-batches: the first STEPS of each rank)."""
    for name in ("fsdp2", "moe_ep2", "fsdp2_lora"):
        per_rank = [media[:STEPS] for media in results[name]["media_per_rank"]]
        steps = list(zip(*per_rank))
        assert len(steps) == STEPS
        assert any(len(set(step)) == 2 for step in steps), (
            f"{name}: no step where only some ranks had an image: {steps}"
        )
        assert any(not any(step) for step in steps), f"{name}: no step without any image: {steps}"
    assert results["fsdp2"]["val"] and results["ref_mbs2"]["val"], "validation ran"
    media = results["hsdp2x2"]["media_per_rank"]
    assert any(len({m[i] for m in media}) == 2 for i in range(STEPS)), "HSDP: ranks never differed"


def test_vision_dp_shares_the_media(results):
    """Under CP each rank encoded a share of every call's media (items encoded, items of the call), the shares add
    up to the call's media, and some calls had fewer media than ranks (a rank encoded the placeholder)."""
    fewer_than_ranks = set()
    for name in VISION_DP_RUNS:
        per_rank = results[name]["vision_dp_per_rank"]
        assert all(calls is not None for calls in per_rank), f"{name}: vision DP is on by default under CP"
        calls = list(zip(*per_rank))
        assert calls and all(len(calls) == len(rank_calls) for rank_calls in per_rank), name
        cp = results[name]["layout"]["ring"] * results[name]["layout"]["ulysses"]
        groups = [per_rank[start : start + cp] for start in range(0, len(per_rank), cp)]
        for group in groups:
            for call in zip(*group):
                total = call[0][1]
                assert all(n == total for _, n in call), f"{name}: the CP ranks saw different calls {call}"
                assert sum(m for m, _ in call) == total, f"{name}: shares {call} do not add up"
                if total < cp:
                    fewer_than_ranks.add(name)
    assert {"ulysses2_dp2", "qwen_ulysses2_ring2", "ulysses2_ring2"} <= fewer_than_ranks, fewer_than_ranks


def test_references_learn(results):
    for ref in ("ref_mbs2", "ref_mbs4", "ref_packed_mbs2", "ref_lora", "moe_ref", "qwen_ref"):
        steps = results[ref]["steps"]
        assert steps[-1][0] < steps[0][0], f"{ref} should learn"
