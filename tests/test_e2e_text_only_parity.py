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

The cases are a table (`tests/parity.py` runs them: each world size spawned once, the references shared with the
session's other parity files).
"""

from pathlib import Path
from typing import Callable

import pytest

from apprun import MOE, MOE_ASSETS, QWEN, TINY
from mixed_data import text_only_share
from parity import (
    QWEN_SETTINGS, STEPS, Case, PadSamplesAsRing2, Probe, assert_matches, dataset_dir, learns, run_cases, session_dir,
    write_tiny_hf,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


class Media(Probe):
    """Per forward of the model: whether it held images."""

    name = "media"

    def attach(self, trainer) -> None:
        self.seen: list[bool] = []
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: self.seen.append(kwargs.get("pixel_values") is not None), with_kwargs=True
        )

    def result(self, trainer) -> list[bool]:
        return self.seen


class VisionDP(Probe):
    """Per vision call under vision data parallel: (items this rank encoded, items of the call); None when off."""

    name = "vision_dp"

    def result(self, trainer):
        vision_dp = trainer.model._vision_dp
        return None if vision_dp is None else list(vision_dp.encoded)


MBS1 = {"training.micro_batch_size": 1}
MBS2 = {"training.micro_batch_size": 2}
PACKED = {"data.dataset_param.basic_parameters.packing": "true"}
VAL = {
    "data.dataset_param.basic_parameters.eval_dataset": "{dir}/eval.jsonl",
    "training.val_interval": STEPS,
    "training.eval_batch_size": 1,
}
LORA = {
    "training.lora.enable": "true",
    "training.lora.rank": 4,
    "training.lora.target_modules": "[q_proj,v_proj,o_proj]",  # Pixtral's and Mistral's attention
    "training.lr": 1.0e-2,
}
META = {"model.model_name_or_path": "{shared}/hf_tiny_seed3", "model.random_init": "false"}
MOE_SETTINGS = {
    "model.model_name_or_path": str(MOE_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(MOE_ASSETS),
    "parallel.expert_parallel_size": 1,
}
SEEN = (Media, VisionDP)


def _case(config: Path, settings: dict) -> Callable[..., Case]:
    """Cases of one model: the layouts record what each rank saw (`SEEN`), the references nothing."""

    def case(name: str, world: int, overrides: dict, ref: str | None = None, probes: tuple = ()) -> Case:
        return Case(name, world, config, {**settings, **overrides}, ref, probes=probes or (SEEN if ref else ()))

    return case


def _cases() -> list[Case]:
    tiny, qwen, moe = _case(TINY, {}), _case(QWEN, QWEN_SETTINGS), _case(MOE, MOE_SETTINGS)
    ulysses2, ring2 = {"parallel.ulysses_parallel_size": 2}, {"parallel.ring_attention_size": 2}
    return [
        # 1-process references
        tiny("ref_mbs2", 1, {**MBS2, **VAL}),
        tiny("ref_mbs4", 1, {"training.micro_batch_size": 4}),  # test_e2e_balance.py's "ref" too
        tiny("ref_packed_mbs2", 1, {**PACKED, **MBS2}),
        tiny("ref_lora", 1, {**MBS2, **LORA}),
        tiny("ref_hf", 1, {**MBS2, **META}),
        moe("moe_ref", 1, MBS2),
        tiny("ref_packed_m4", 1, {**PACKED, **MBS2}, probes=(PadSamplesAsRing2,)),
        qwen("qwen_ref", 1, MBS2),
        qwen("qwen_ref_packed_m4", 1, {**PACKED, **MBS2}, probes=(PadSamplesAsRing2,)),
        # layouts
        tiny("fsdp2", 2, {**MBS1, **VAL}, "ref_mbs2"),
        tiny("fsdp2_recompute_chunk", 2, {
            **MBS1, "parallel.recompute": "true", "features.enable_chunk_loss": "true",
            "features.chunkloss_plan.chunk_size": 16,
        }, "ref_mbs2"),
        tiny("fsdp2_accum2", 2, {**MBS1, "training.gradient_accumulation_steps": 2}, "ref_mbs4"),
        tiny("fsdp2_packed", 2, {**MBS1, **PACKED}, "ref_packed_mbs2"),
        tiny("fsdp2_lora", 2, {**MBS1, **LORA}, "ref_lora"),
        tiny("fsdp2_meta", 2, {
            **MBS1, **META, "training.init_model_with_meta_device": "true", "training.load": "{shared}/hf_tiny_seed3",
            "training.load_format": "hf",
        }, "ref_hf"),
        moe("moe_ep2", 2, {**MBS1, "parallel.expert_parallel_size": 2}, "moe_ref"),
        tiny("hsdp2x2", 4, {**MBS1, "parallel.data_parallel_replicate_size": 2}, "ref_mbs4"),
        tiny("ulysses2_dp2", 4, {**MBS1, **ulysses2}, "ref_mbs2"),
        tiny("ring2_dp2", 4, {**MBS1, **ring2}, "ref_mbs2"),
        # vision data parallel (on by default under CP): the CP ranks share out the micro-batch's images
        tiny("ulysses2_ring2", 4, {**MBS2, **ulysses2, **ring2}, "ref_mbs2"),
        tiny("ring2_packed", 2, {**PACKED, **MBS2, **ring2}, "ref_packed_m4"),
        qwen("qwen_ulysses2", 2, {**MBS2, **ulysses2}, "qwen_ref"),
        qwen("qwen_ring2_packed", 2, {**PACKED, **MBS2, **ring2}, "qwen_ref_packed_m4"),
        qwen("qwen_ulysses2_ring2", 4, {**MBS2, **ulysses2, **ring2}, "qwen_ref"),
        moe("moe_ep2_ulysses2", 2, {**MBS2, "parallel.expert_parallel_size": 2, **ulysses2}, "moe_ref"),
    ]


CASES = {case.name: case for case in _cases()}
VISION_DP_RUNS = ("ulysses2_dp2", "ring2_dp2", "ulysses2_ring2", "ring2_packed", "qwen_ulysses2", "qwen_ring2_packed",
                  "qwen_ulysses2_ring2", "moe_ep2_ulysses2")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return session_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def results(tmp_path_factory, shared):
    write_tiny_hf(shared / "hf_tiny_seed3")
    return run_cases(list(CASES.values()), tmp_path_factory.mktemp("text_only"), shared)


def test_the_data_is_mixed(shared):
    assert text_only_share(dataset_dir(shared, "mixed")) >= 0.4
    assert text_only_share(dataset_dir(shared, "mixed"), "eval") >= 0.4


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.reference is not None])
def test_text_only_rows_match_one_process(results, name):
    assert_matches(results, CASES[name])


def test_ranks_differ_in_media(results):
    """The layouts above saw what they are meant to: one-sample micro-batches where one rank had an image and
    the other none, and steps where no rank had any (training micro-batches: the first STEPS of each rank)."""
    for name in ("fsdp2", "moe_ep2", "fsdp2_lora"):
        per_rank = [media[:STEPS] for media in results[name]["media"]]
        steps = list(zip(*per_rank))
        assert len(steps) == STEPS
        assert any(len(set(step)) == 2 for step in steps), (
            f"{name}: no step where only some ranks had an image: {steps}"
        )
        assert any(not any(step) for step in steps), f"{name}: no step without any image: {steps}"
    assert results["fsdp2"]["val"] and results["ref_mbs2"]["val"], "validation ran"
    media = results["hsdp2x2"]["media"]
    assert any(len({m[i] for m in media}) == 2 for i in range(STEPS)), "HSDP: ranks never differed"


def test_vision_dp_shares_the_media(results):
    """Under CP each rank encoded a share of every call's media (items encoded, items of the call), the shares add
    up to the call's media, and some calls had fewer media than ranks (a rank encoded the placeholder)."""
    fewer_than_ranks = set()
    for name in VISION_DP_RUNS:
        per_rank = results[name]["vision_dp"]
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
        assert learns(results[ref]), f"{ref} should learn"
