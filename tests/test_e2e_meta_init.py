"""Meta-device init through the trainer: built on meta, sharded, materialised and loaded from an HF
directory (`load_format: hf`) or from a converted DCP `release`, the run's per-step losses equal those
of the same weights loaded eagerly with `from_pretrained` (2 processes, fp32, exactly: tolerance 0).

The same for Qwen3.5 (`QWEN3_5_CASES`): the tiny `qwen3_5` example (Gated DeltaNet, Gated DeltaNet, gated
attention, vision tower) and its MoE variant (`qwen3_5_moe`: 8 experts, top-2, a gated shared expert; the HF files
in the hub's per-expert layout that `save_pretrained` writes), on the mixed image / text-only rows."""

import pytest
import torch
from transformers import AutoConfig, Mistral3ForConditionalGeneration

from apprun import QWEN3_5, QWEN3_5_ASSETS, TINY
from mmfsdp.ckpt import hf_to_dcp
from parity import Case, assert_matches, run_cases, session_dir

BASE = {"model.model_name_or_path": "{tmp}/hf", "model.random_init": "false", "training.micro_batch_size": 2,
        "training.train_iters": 3}
META = {"training.init_model_with_meta_device": "true"}
CASES = [
    Case("eager", 2, TINY, BASE, dataset="shapes"),
    Case("meta_hf", 2, TINY, {**BASE, **META, "training.load": "{tmp}/hf", "training.load_format": "hf"}, "eager",
         tol=0.0, dataset="shapes"),
    Case("meta_dcp", 2, TINY, {**BASE, **META, "training.load": "{tmp}/dcp"}, "eager", tol=0.0, dataset="shapes"),
]


@pytest.mark.slow  # multi-process training runs: the full suite
def test_meta_init_from_hf_and_from_dcp_match_eager_loading(tmp_path, tmp_path_factory):
    torch.manual_seed(7)
    config = AutoConfig.from_pretrained(TINY.parent / "assets")
    Mistral3ForConditionalGeneration(config).save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")

    results = run_cases(CASES, tmp_path, session_dir(tmp_path_factory), 600)
    assert len(results["eager"]["steps"]) == 3
    for case in CASES[1:]:
        assert_matches(results, case, reference_world=2)


QWEN3_5_BASE = {
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(QWEN3_5_ASSETS),
    "model.model_name_or_path": "{tmp}/hf",
    "model.random_init": "false",
    "training.micro_batch_size": 2,
    "training.train_iters": 3,
}
QWEN3_5_CASES = [
    Case(f"{model_id}_{name}", 2, QWEN3_5, {**QWEN3_5_BASE, "model.model_id": model_id, **extra},
         None if name == "eager" else f"{model_id}_eager", tol=0.0)
    for model_id in ("qwen3_5", "qwen3_5_moe")
    for name, extra in [
        ("eager", {}),
        ("meta_hf", {**META, "training.load": "{tmp}/hf", "training.load_format": "hf"}),
        ("meta_dcp", {**META, "training.load": "{tmp}/dcp"}),
    ]
]
"""Per Qwen3.5 family (each in its own directory: `{tmp}` is the family's), eager, meta from HF, meta from DCP."""


@pytest.mark.slow
@pytest.mark.parametrize("model_id", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_meta_init_from_hf_and_from_dcp_match_eager_loading(model_id, tmp_path, tmp_path_factory):
    from mmfsdp.model import get_model_entry

    entry = get_model_entry(model_id)
    config = AutoConfig.from_pretrained(QWEN3_5_ASSETS)
    if model_id == "qwen3_5_moe":
        from test_e2e_qwen3_5_parity import write_moe_config

        write_moe_config(tmp_path / "moe_config")
        config = AutoConfig.from_pretrained(tmp_path / "moe_config")
    torch.manual_seed(7)
    entry.model_class.__bases__[-1](config).save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    hf_to_dcp(tmp_path / "hf", tmp_path / "dcp")

    cases = [case for case in QWEN3_5_CASES if case.overrides["model.model_id"] == model_id]
    results = run_cases(cases, tmp_path, session_dir(tmp_path_factory), 600)
    assert len(results[f"{model_id}_eager"]["steps"]) == 3
    for case in cases[1:]:
        assert_matches(results, case, reference_world=2)
