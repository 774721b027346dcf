"""Qwen3-VL parity through the real trainer: the qwen3vl-tiny run, 5 steps, fp32 on gloo.

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

Each world size is spawned once (module fixture) and runs all of its trainers in turn.
"""

from pathlib import Path

import pytest

from mmfsdp.data import prepare_dataset
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
STEPS = 5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
CUTOFF = 96  # a shapes sample has about 30 tokens: a packed row holds 3


def _overrides(tmp: Path, name: str, **extra) -> list[str]:
    items = {
        "model.model_name_or_path": str(ASSETS),
        "data.dataset_param.preprocess_parameters.model_name_or_path": str(ASSETS),
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "data"),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache"),
        "data.dataset_param.synthetic.num_train": 32,
        "data.dataset_param.synthetic.num_eval": 4,
        "data.dataset_param.preprocess_parameters.cutoff_len": CUTOFF,
        "training.micro_batch_size": 4,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def _packed(micro_batch_size: int, **extra) -> dict:
    packing = {"data.dataset_param.basic_parameters.packing": "true", "training.micro_batch_size": micro_batch_size}
    return {**packing, **extra}


CHUNK_LOSS = {"features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16}
LORA = {
    "training.lora.enable": "true",
    "training.lora.rank": 8,
    "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj,qkv]",  # decoder and vision attention
    "training.lr": 1.0e-2,
}

# name: (world size, overrides); the 1-process runs are the references
RUNS = {
    # the reference pads its micro-batches (the batch plain HF takes); every other run is padding-free (the default)
    "ref": (1, {"data.dataloader_param.padding_free": "false"}),
    "ref_packed_mbs2": (1, _packed(2)),
    "ref_lora": (1, LORA),
    "fsdp2": (2, {"training.micro_batch_size": 2}),
    "fsdp2_chunk": (2, {"training.micro_batch_size": 2, **CHUNK_LOSS}),
    "ulysses2": (2, {"parallel.ulysses_parallel_size": 2}),
    "ring2": (2, {"parallel.ring_attention_size": 2}),
    "fsdp2_packed": (2, _packed(1)),
    "fsdp2_lora": (2, {"training.micro_batch_size": 2, **LORA}),
    "ulysses2_ring2": (4, {"parallel.ulysses_parallel_size": 2, "parallel.ring_attention_size": 2}),
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

    with torch.random.fork_rng():
        config = Qwen3VLConfig.from_pretrained(ASSETS)
        model = Qwen3VLForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    model.load_state_dict(weights, strict=True)
    model.train()
    loss = model(**model_inputs(batch), labels=batch["labels"]).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss), float(norm)


def _train(rank, world_size, runs):
    from mmfsdp.train.trainer import Trainer

    results = {}
    for name, overrides in runs:
        trainer = Trainer(load_config(CONFIG, overrides), "cpu")
        first = _first_batch_and_weights(trainer) if name == "ref" else None
        trainer.train()
        plan = trainer.plan
        results[name] = {
            "layout": {"world": world_size, "dp": trainer.dims.dp_size, "ring": plan.ring, "ulysses": plan.ulysses},
            "steps": [(r.loss, r.grad_norm, r.num_tokens) for r in trainer.history],
            "samples_per_row": [len(row) for key in trainer.loader._epoch_plan(0)[:STEPS] for row in key],
        }
        if first is not None:
            results[name]["hf_step1"] = _hf_step(*first)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every run, the 1-process ones first (they also write the tokenized caches the others read)."""
    tmp = tmp_path_factory.mktemp("qwen3vl")
    prepare_dataset(load_config(CONFIG, _overrides(tmp, "prepare")).data)
    out = {}
    for world_size in (1, 2, 4):
        runs = [(name, _overrides(tmp, name, **extra)) for name, (world, extra) in RUNS.items() if world == world_size]
        out.update(run_distributed(_train, world_size, runs, timeout=900)[0])
    return out


def _close(value: float, reference: float) -> bool:
    return abs(value - reference) <= 1e-5 * abs(reference)


@pytest.mark.parametrize(
    "name, ref, layout",
    [
        ("fsdp2", "ref", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
        ("fsdp2_chunk", "ref", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
        ("ulysses2", "ref", {"world": 2, "dp": 1, "ring": 1, "ulysses": 2}),
        ("ring2", "ref", {"world": 2, "dp": 1, "ring": 2, "ulysses": 1}),
        ("fsdp2_packed", "ref_packed_mbs2", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
        ("fsdp2_lora", "ref_lora", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
        ("ulysses2_ring2", "ref", {"world": 4, "dp": 1, "ring": 2, "ulysses": 2}),
    ],
)
def test_qwen3vl_layout_matches_one_process(results, name, ref, layout):
    got, expected = results[name], results[ref]
    assert got["layout"] == layout, f"{name} ran as {got['layout']}"
    assert expected["layout"]["world"] == 1
    assert len(got["steps"]) == len(expected["steps"]) == STEPS
    for step, (mine, theirs) in enumerate(zip(got["steps"], expected["steps"]), 1):
        (loss, norm, tokens), (ref_loss, ref_norm, ref_tokens) = mine, theirs
        assert tokens == ref_tokens, f"{name}, step {step}: {tokens} tokens vs {ref_tokens} in {ref}"
        assert _close(loss, ref_loss), f"{name}, step {step}: loss {loss} vs {ref_loss} ({ref})"
        assert _close(norm, ref_norm), f"{name}, step {step}: grad norm {norm} vs {ref_norm} ({ref})"


def test_qwen3vl_first_step_matches_plain_hf(results):
    loss, norm, _ = results["ref"]["steps"][0]
    hf_loss, hf_norm = results["ref"]["hf_step1"]
    assert _close(loss, hf_loss), f"step 1: trainer loss {loss} vs HF {hf_loss}"
    assert _close(norm, hf_norm), f"step 1: trainer grad norm {norm} vs HF {hf_norm}"


def test_qwen3vl_references_pack_and_learn(results):
    """The packed reference really packs several samples per row, and the references learn."""
    assert max(results["ref_packed_mbs2"]["samples_per_row"]) > 1
    for ref in ("ref", "ref_packed_mbs2", "ref_lora"):
        steps = results[ref]["steps"]
        assert steps[-1][0] < steps[0][0], f"{ref} should learn"
