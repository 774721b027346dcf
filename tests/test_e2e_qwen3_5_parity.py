"""Qwen3.5 packed and context parallel through the real trainer: the tiny `qwen3_5` (Gated DeltaNet, Gated
DeltaNet, gated attention) and the same model with MoE layers (`qwen3_5_moe`, 8 experts, top-2, router aux loss),
fp32 on gloo, 5 steps, on `tests/mixed_data.py`'s variable-length rows (text-only rows and rows with 1-2 images of
different sizes).

Every case gives its 1-process reference's per-step loss, gradient norm and tokens (relative difference <= 1e-5):

- FSDP2 on 2 processes, padded micro-batches;
- padding-free micro-batches (the samples end to end, `cu_seq_lens`) on 1 process = padded;
- Ulysses 2, Ring 2 (padded and padding-free) and Ulysses 2 × Ring 2 on 4 processes; vision data parallel is on
  in every CP case (`parallel.vision_dp`'s default): the CP ranks share out the images;
- Ring 2 with packing (rows of several samples): the 1-process reference pads each packed sample to the multiple
  Ring 2 needs (`PadSamplesAsRing2`), so both pack the same rows;
- `qwen3_5_moe`: expert parallel 2 and EP 2 × Ulysses 2 with the router aux loss on (its per-step value too);
- LoRA on the Gated DeltaNet projections, the attention and the vision attention, FSDP2 on 2 processes.

CP ranks share one data stream, so a CP case's micro-batch is its reference's. The cases are a table run by
`tests/parity.py` (each world size spawned once).
"""

import json
from pathlib import Path

import pytest

from apprun import QWEN3_5, QWEN3_5_ASSETS
from parity import Case, PadSamplesAsRing2, Probe, assert_matches, close, learns, run_cases, session_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
COEF = 0.5
ASSETS = {"data.dataset_param.preprocess_parameters.model_name_or_path": str(QWEN3_5_ASSETS)}
DENSE = {**ASSETS, "model.model_name_or_path": str(QWEN3_5_ASSETS), "training.micro_batch_size": 4}
PADDED = {"data.dataloader_param.padding_free": "false"}
MOE = {
    **ASSETS,
    "model.model_id": "qwen3_5_moe",
    "model.model_name_or_path": "{shared}/qwen3_5_moe-tiny",
    "features.loss_cfg.router_aux_loss_coef": COEF,
    "training.micro_batch_size": 4,
}
PACKED = {
    "data.dataset_param.basic_parameters.packing": "true",
    "data.dataset_param.preprocess_parameters.cutoff_len": 256,
    "training.micro_batch_size": 1,
}
LORA = {
    "training.lora.enable": "true",
    "training.lora.init_lora_weights": "false",  # B random too: the adapters change the loss from step 1
    "training.lora.target_modules": "[preset:gated_deltanet,preset:attention,preset:vision_attention]",
}
U2, R2 = {"parallel.ulysses_parallel_size": 2}, {"parallel.ring_attention_size": 2}


class AuxLoss(Probe):
    """The router aux loss of every step."""

    name = "aux_loss"

    def result(self, trainer) -> list:
        return [r.stats.get("aux_loss") for r in trainer.history]


def _case(name, world, overrides, reference=None, layout=None, probes=()):
    return Case(name, world, QWEN3_5, overrides, reference, probes=probes, layout=layout)


CASES = [
    _case("single", 1, {**DENSE, **PADDED}),
    _case("single_padding_free", 1, DENSE, "single"),
    _case("single_packed", 1, {**DENSE, **PACKED}, probes=(PadSamplesAsRing2,)),
    _case("moe_single", 1, {**MOE, **PADDED}, probes=(AuxLoss,)),
    _case("lora_single", 1, {**DENSE, **LORA}),
    _case("fsdp2", 2, {**DENSE, **PADDED, "training.micro_batch_size": 2}, "single", {"dp": 2}),
    _case("ulysses2", 2, {**DENSE, **U2}, "single", {"dp": 1, "ulysses": 2}),
    _case("ring2", 2, {**DENSE, **PADDED, **R2}, "single", {"dp": 1, "ring": 2}),
    _case("ring2_padding_free", 2, {**DENSE, **R2}, "single", {"dp": 1, "ring": 2}),
    _case("ring2_packed", 2, {**DENSE, **PACKED, **R2}, "single_packed", {"dp": 1, "ring": 2}),
    _case("moe_ep2", 2, {**MOE, "training.micro_batch_size": 2, "parallel.expert_parallel_size": 2}, "moe_single",
          {"dp": 2, "ep": 2}, (AuxLoss,)),
    _case("lora_fsdp2", 2, {**DENSE, **LORA, "training.micro_batch_size": 2}, "lora_single", {"dp": 2}),
    _case("ulysses2_ring2", 4, {**DENSE, **U2, **R2}, "single", {"dp": 1, "ulysses": 2, "ring": 2}),
    _case("moe_ep2_ulysses2", 4, {**MOE, **U2, "parallel.expert_parallel_size": 2, "training.micro_batch_size": 2},
          "moe_single",
          {"dp": 2, "ep": 2, "ulysses": 2}, (AuxLoss,)),
]


def write_moe_config(directory: Path) -> None:
    """The tiny example's `config.json` with MoE layers (8 experts of 64, top-2, a shared expert of 96)."""
    from transformers import Qwen3_5MoeConfig

    config = json.loads((QWEN3_5_ASSETS / "config.json").read_text())
    text = {key: value for key, value in config.pop("text_config").items() if key != "intermediate_size"}
    text.update(model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                shared_expert_intermediate_size=96)
    config.pop("model_type")
    config["vision_config"].pop("model_type")
    Qwen3_5MoeConfig(**config, text_config=text).save_pretrained(directory)


def test_qwen3_5_packed_and_context_parallel_match_one_process(tmp_path_factory):
    shared = session_dir(tmp_path_factory)
    if not (shared / "qwen3_5_moe-tiny" / "config.json").is_file():
        write_moe_config(shared / "qwen3_5_moe-tiny")
    results = run_cases(CASES, tmp_path_factory.mktemp("qwen3_5"), shared)
    for case in CASES:
        if case.reference is not None:
            assert_matches(results, case)
    for case in CASES:
        if AuxLoss in case.probes and case.reference is not None:
            got, expected = results[case.name]["aux_loss"][0], results[case.reference]["aux_loss"][0]
            assert all(value is not None for value in expected), expected
            assert all(close(a, b, 1e-5, f"{case.name} aux loss") for a, b in zip(got, expected, strict=True)), (case.name, got, expected)
    assert learns(results["single"]) and learns(results["moe_single"]), "the runs should learn"
