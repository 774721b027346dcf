"""Meta-device init through the trainer: built on meta, sharded, materialised and loaded from an HF
directory (`load_format: hf`) or from a converted DCP `release`, the run's per-step losses equal those
of the same weights loaded eagerly with `from_pretrained` (2 processes, fp32, exactly: tolerance 0)."""

import torch
from transformers import AutoConfig, Mistral3ForConditionalGeneration

from apprun import TINY
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
