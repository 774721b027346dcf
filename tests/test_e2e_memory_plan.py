"""The memory plan of both Magistral-Small-2509 recipes against the hand calculation in docs/memory.md.

The real `config.json` (published dims, written by `tests/magistral_config.py`) is
built on the meta device only. Every figure below is derived here from the
architecture, not from the planner: parameter counts layer by layer, then the
per-rank formulas of docs/memory.md (fp32 master weights `m` = 4, bf16 compute
`c` = 2, AdamW's two fp32 states, activations with recompute and chunk loss).
"""

import importlib.util
from pathlib import Path

import pytest

from mmfsdp.train.config import load_config
from mmfsdp.train.memory import memory_plan, memory_plan_lines

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "magistral-2509"
GiB = 2**30

_spec = importlib.util.spec_from_file_location("magistral_config", ROOT / "tests" / "magistral_config.py")
magistral_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(magistral_config)

# text: hidden 5120, 40 layers, 32 query heads and 8 KV heads of 128, MLP 32768, vocabulary 131072
H, LAYERS, HEADS, KV, HEAD_DIM, MLP, VOCAB = 5120, 40, 32, 8, 128, 32768, 131072
DECODER_LAYER = H * HEADS * HEAD_DIM * 2 + H * KV * HEAD_DIM * 2 + 3 * H * MLP + 2 * H
TEXT = 2 * VOCAB * H + LAYERS * DECODER_LAYER + H  # embeddings, lm_head, layers, final norm
# vision: Pixtral 1024 hidden, 24 layers, MLP 4096, 14x14 patches; projector with a 2x2 patch merger
VISION_H, VISION_LAYERS, VISION_MLP = 1024, 24, 4096
VISION = 3 * 14 * 14 * VISION_H + VISION_H + VISION_LAYERS * (4 * VISION_H**2 + 3 * VISION_H * VISION_MLP + 2 * VISION_H)
PROJECTOR = VISION_H + 4 * VISION_H * VISION_H + VISION_H * H + H * H
P, T = TEXT + VISION + PROJECTOR, TEXT  # vision tower and projector are frozen in both recipes
TOKENS, CHUNK, FAMILY_FACTOR = 4096, 1024, 40.6  # micro-batch 1 x cutoff 4096; docs/memory.md's f for Mistral
ACTIVATIONS = LAYERS * TOKENS * H * 2 + TOKENS * H * FAMILY_FACTOR * 2 + CHUNK * VOCAB * 8
COMPUTE_COPIES = 2 * (VOCAB * H) * 2  # the largest FSDP unit (embed_tokens = lm_head), gathered twice, bf16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return magistral_config.write_magistral_config(tmp_path_factory.mktemp("magistral") / "Magistral-Small-2509")


def _config(recipe: str, model_dir: Path):
    return load_config(RECIPES / recipe, [
        f"model.model_name_or_path={model_dir}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model_dir}",
        "model.attn_implementation=sdpa",
    ])


def test_the_hand_calculation_is_the_documented_one():
    assert P == 24_011_361_280 and T == 23_572_403_200
    assert DECODER_LAYER == 555_755_520 and VISION + PROJECTOR == 438_958_080


@pytest.mark.parametrize("recipe, ranks, swap", [("config_8card.yaml", 8, False), ("config_4card.yaml", 4, True)])
def test_magistral_recipes_plan_matches_the_hand_calculation(model_dir, recipe, ranks, swap):
    cfg = _config(recipe, model_dir)
    assert cfg.training.optimizer == ("adamw_swap" if swap else "adamw")
    plan = memory_plan(cfg, ranks, 80 * GiB)
    assert (plan.num_params, plan.num_trainable) == (P, T)
    assert plan.parameters == P * 4 // ranks
    assert plan.gradients == T * 4 // ranks
    assert plan.optimizer_states == (0 if swap else 2 * 4 * T // ranks)
    assert plan.host == (2 * 4 * T // ranks if swap else 0)
    assert plan.compute_copies == COMPUTE_COPIES
    assert abs(plan.activations - ACTIVATIONS) <= 1e-9 * ACTIVATIONS
    assert plan.fits
    expected_lines = {
        8: ["parameters          11.2 GiB", "gradients           11.0 GiB", "optimizer states    22.0 GiB",
            "before activations  44.1 GiB", "compute copies       2.5 GiB", "activations          4.1 GiB", "total               50.8 GiB"],
        4: ["parameters          22.4 GiB", "gradients           22.0 GiB", "optimizer states     0.0 GiB",
            "before activations  44.3 GiB", "activations          4.1 GiB", "total               51.0 GiB  (+ 43.9 GiB in host memory)"],
    }[ranks]
    printed = "\n".join(memory_plan_lines(cfg, ranks, 80 * GiB))
    for line in expected_lines:  # the bold figures of docs/memory.md's table
        assert line in printed, printed


def test_four_ranks_with_adamw_do_not_fit_and_say_what_would(model_dir):
    cfg = _config("config_4card.yaml", model_dir)
    cfg.training.optimizer = "adamw"
    plan = memory_plan(cfg, 4, 80 * GiB)
    assert plan.optimizer_states == 2 * 4 * T // 4 and plan.host == 0
    assert not plan.fits and any("adamw_swap" in s for s in plan.suggestions), plan.suggestions


def test_magistral_lora_recipe_holds_gradients_and_adamw_state_for_the_adapters_only(model_dir):
    cfg = _config("config_lora.yaml", model_dir)
    lora = cfg.training.lora
    assert lora.enable and lora.rank == 16 and cfg.model.dtype == "bf16"
    # rank x (in + out) per adapted Linear: q, k, v, o and gate, up, down of every decoder layer
    per_layer = 2 * (H + HEADS * HEAD_DIM) + 2 * (H + KV * HEAD_DIM) + 3 * (H + MLP)
    adapters = LAYERS * lora.rank * per_layer
    plan = memory_plan(cfg, 4, 80 * GiB)
    assert (plan.num_params, plan.num_trainable) == (P + adapters, adapters)
    assert plan.parameters == (P * 2 + adapters * 4) // 4  # bf16 base, fp32 adapters
    assert plan.gradients == adapters * 4 // 4
    assert plan.optimizer_states == 2 * 4 * adapters // 4
    assert plan.fits and plan.parameters + plan.gradients + plan.optimizer_states < 12 * GiB


@pytest.mark.parametrize("budget, tokens", [(8192, 2 * TOKENS), (2048, TOKENS)])
def test_a_token_budget_sizes_the_activations(model_dir, budget, tokens):
    """`training.micro_batch_tokens`: a micro-batch holds up to the budget (micro_batch_size no longer bounds it),
    and a sample over the budget runs alone, so `max(budget, cutoff_len)` tokens (cutoff 4096 here)."""
    cfg = load_config(RECIPES / "config_8card.yaml", [
        f"model.model_name_or_path={model_dir}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model_dir}",
        "model.attn_implementation=sdpa",
        "training.gradient_accumulation_steps=4",
        f"training.micro_batch_tokens={budget}",
    ])
    assert cfg.training.micro_batch_size == 1
    activations = LAYERS * tokens * H * 2 + tokens * H * FAMILY_FACTOR * 2 + CHUNK * VOCAB * 8
    plan = memory_plan(cfg, 8, 80 * GiB)
    assert abs(plan.activations - activations) <= 1e-9 * activations
    printed = "\n".join(memory_plan_lines(cfg, 8, 80 * GiB))
    assert f"{tokens} tokens per micro-batch under micro_batch_tokens" in printed, printed
