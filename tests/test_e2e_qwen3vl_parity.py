"""Qwen3-VL parity through the real trainer: the qwen3vl-tiny run, 4 steps, fp32 on gloo.

Every layout must give the per-step loss and gradient norm of the 1-process run
with the same global batch (relative difference <= 1e-5) and train on the same
tokens (equal `num_tokens`):

- FSDP2 on 2 processes (data parallel 2, half the micro-batch), also with chunk loss;
- Ulysses 2 and Ring 2 on 2 processes (one CP group: the same micro-batch as 1 process);
- packing: packed rows on 2 processes (data parallel 2) against packed rows on 1
  process with twice the micro-batch;
- Ulysses 2 × Ring 2 on 4 processes;
- LoRA (rank 8 on the decoder's and the vision tower's attention projections) under FSDP2 on 2 processes
  against the 1-process LoRA run.

The 1-process run's first step is also checked against plain HF: a
`Qwen3VLForConditionalGeneration` with that run's initial weights, given the
first batch with `labels=`, has the same loss and gradient norm — so the
trainer's loss weighting, M-RoPE positions, DeepStack and image path are HF's.

The cases are a table run by `tests/parity.py` (each world size spawned once).
"""

import pytest

from apprun import QWEN
from parity import (
    QWEN_SETTINGS, Case, HFFirstStep, SamplesPerRow, assert_first_step_matches_hf, assert_matches, learns, run_cases,
    session_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STEPS = 4
BASE = {
    **QWEN_SETTINGS,
    # a shapes sample has about 30 tokens: a packed row holds 3
    "data.dataset_param.preprocess_parameters.cutoff_len": 96,
    "training.micro_batch_size": 4,
    "training.train_iters": STEPS,
}
MBS2 = {"training.micro_batch_size": 2}
PACKED = {"data.dataset_param.basic_parameters.packing": "true"}
CHUNK_LOSS = {"features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16}
LORA = {
    "training.lora.enable": "true",
    "training.lora.rank": 8,
    "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj,qkv]",  # decoder and vision attention
    "training.lr": 1.0e-2,
}
DP2 = {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}


def _case(name: str, world: int, overrides: dict, ref: str | None = None, layout: dict | None = None, **kw) -> Case:
    return Case(name, world, QWEN, {**BASE, **overrides}, ref, dataset="shapes", layout=layout, **kw)


CASES = {
    case.name: case
    for case in [
        # the reference pads its micro-batches (the batch plain HF takes); every other run is padding-free (the default)
        _case("ref", 1, {"data.dataloader_param.padding_free": "false"}, probes=(HFFirstStep,)),
        _case("ref_packed_mbs2", 1, {**PACKED, **MBS2}, probes=(SamplesPerRow,)),
        _case("ref_lora", 1, LORA),
        _case("fsdp2", 2, MBS2, "ref", DP2),
        _case("fsdp2_chunk", 2, {**MBS2, **CHUNK_LOSS}, "ref", DP2),
        _case("ulysses2", 2, {"parallel.ulysses_parallel_size": 2}, "ref", {**DP2, "dp": 1, "ulysses": 2}),
        _case("ring2", 2, {"parallel.ring_attention_size": 2}, "ref", {**DP2, "dp": 1, "ring": 2}),
        _case("fsdp2_packed", 2, {**PACKED, "training.micro_batch_size": 1}, "ref_packed_mbs2", DP2),
        _case("fsdp2_lora", 2, {**MBS2, **LORA}, "ref_lora", DP2),
        _case("ulysses2_ring2", 4, {"parallel.ulysses_parallel_size": 2, "parallel.ring_attention_size": 2}, "ref",
              {"world": 4, "dp": 1, "ring": 2, "ulysses": 2}),
    ]
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(list(CASES.values()), tmp_path_factory.mktemp("qwen3vl"), session_dir(tmp_path_factory))


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.reference is not None])
def test_qwen3vl_layout_matches_one_process(results, name):
    assert_matches(results, CASES[name])


def test_qwen3vl_first_step_matches_plain_hf(results):
    assert_first_step_matches_hf(results["ref"])


def test_qwen3vl_references_pack_and_learn(results):
    """The packed reference really packs several samples per row, and the references learn."""
    assert max(results["ref_packed_mbs2"]["samples_per_row"][0]) > 1
    for ref in ("ref", "ref_packed_mbs2", "ref_lora"):
        assert learns(results[ref]), f"{ref} should learn"
