"""Parity on a variable-length dataset through the real trainer: the tiny Mistral3 run, 5 steps, fp32 on gloo.

Samples of `make_varlen_dataset` differ in length, image count and image size, so
padding and packing change a batch here where the equal-length shapes data hides it.
Every layout must give the per-step loss and gradient norm of the 1-process run
with the same global batch (relative difference <= 1e-5) and train on the same
tokens (equal `num_tokens`):

- packed rows (no 1-process patching: rows are planned on unpadded lengths, so
  CP's per-sample padding leaves them alone): ring 2, ring 2 + chunk loss,
  Ulysses 2 (each 2 processes, one CP group), and dp 2 × ring 2 (4 processes);
  each also checks that planning on padded lengths (the old loader) would have
  given other rows here, so these cases catch that bug coming back;
- `per_token` and `per_sample` on 2 processes (FSDP dp 2), also with gradient
  accumulation 2: the logged loss and the gradient do not depend on the layout.

Each world size is spawned once (module fixtures) and runs all of its trainers in turn.
The data-parallel cases use a dataset with at least one image per sample (see
`make_varlen_dataset`); the CP-only cases keep samples without images.
"""

from pathlib import Path

import pytest

from mmfsdp.data.synthetic import make_varlen_dataset
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
STEPS = 5
CUTOFF = 136  # the longest sample has 87 tokens; at this row budget padding before planning would change the rows


def _overrides(tmp: Path, dataset: str, name: str, **extra) -> list[str]:
    items = {
        "data.dataset_param.dataset_type": "huggingface",
        "data.dataset_param.basic_parameters.dataset": str(tmp / dataset / "train.jsonl"),
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / dataset),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache"),
        "data.dataset_param.preprocess_parameters.cutoff_len": CUTOFF,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def _packed(micro_batch_size: int, **extra) -> dict:
    return {"data.dataset_param.basic_parameters.packing": "true", "training.micro_batch_size": micro_batch_size, **extra}


def _train(rank, world_size, runs):
    from mmfsdp.train.trainer import Trainer

    results = {}
    for name, overrides in runs:
        trainer = Trainer(load_config(TINY, overrides), "cpu")
        trainer.train()
        plan = trainer.plan
        results[name] = {
            "layout": {"world": world_size, "dp": trainer.dims.dp_size, "ring": plan.ring, "ulysses": plan.ulysses},
            "steps": [(r.loss, r.grad_norm, r.num_tokens) for r in trainer.history],
            "samples_per_row": [len(row) for key in trainer.loader._epoch_plan(0)[:STEPS] for row in key],
            "padded_plan_differs": _padded_plan_differs(trainer.loader, plan.ring, plan.ulysses),
        }
    return results


def _padded_plan_differs(loader, ring: int, ulysses: int) -> bool:
    """Whether planning on lengths padded to CP's multiple (the old loader) gives other first rows than the
    loader's unpadded plan: the CP cases below only guard that fix when it does."""
    import numpy as np

    from mmfsdp.data.loader import plan_epoch
    from mmfsdp.parallel.cp.layout import required_multiple

    multiple = required_multiple(ring, ulysses)
    lengths = np.asarray(loader.dataset.lengths)
    padded = -(-lengths // multiple) * multiple
    old = plan_epoch(
        padded, epoch=0, seed=loader.seed, shuffle=loader.shuffle, packing=loader.packing, capacity=loader.capacity,
        micro_batch_size=loader.micro_batch_size, dp_rank=loader.dp_rank, dp_size=loader.dp_size, drop_last=loader.drop_last,
    )
    return old[:STEPS] != loader._epoch_plan(0)[:STEPS]


# name: (world size, dataset, overrides); each reference is shared by the cases that compare with it
RUNS = {
    "ref_packed": (1, "varlen", _packed(1)),
    "ref_packed_mbs2": (1, "varlen_img", _packed(2)),
    "ref_per_token": (1, "varlen_img", {"features.loss_cfg.loss_type": "per_token", "training.micro_batch_size": 4}),
    "ref_per_sample": (1, "varlen_img", {"features.loss_cfg.loss_type": "per_sample", "training.micro_batch_size": 4}),
    "ring2": (2, "varlen", _packed(1, **{"parallel.ring_attention_size": 2})),
    "ring2_chunk": (
        2, "varlen",
        _packed(1, **{"parallel.ring_attention_size": 2, "features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16}),
    ),
    "ulysses2": (2, "varlen", _packed(1, **{"parallel.ulysses_parallel_size": 2})),
    **{
        f"{loss}_dp2{suffix}": (
            2, "varlen_img",
            {"features.loss_cfg.loss_type": loss, "training.micro_batch_size": mbs, "training.gradient_accumulation_steps": accum},
        )
        for loss in ("per_token", "per_sample")
        for suffix, mbs, accum in (("", 2, 1), ("_accum2", 1, 2))
    },
    "dp2_ring2": (4, "varlen_img", _packed(1, **{"parallel.ring_attention_size": 2})),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("varlen")
    make_varlen_dataset(tmp / "varlen", num_train=40, num_eval=0, seed=7)
    make_varlen_dataset(tmp / "varlen_img", num_train=40, num_eval=0, seed=7, min_images=1)
    return tmp


def _spawn(data_dir, world_size):
    runs = [(name, _overrides(data_dir, dataset, name, **extra)) for name, (world, dataset, extra) in RUNS.items() if world == world_size]
    return run_distributed(_train, world_size, runs, timeout=900)[0]


@pytest.fixture(scope="module")
def results(data_dir):
    """Every run, the 1-process ones first (they also write the tokenized caches the others read)."""
    out = {}
    for world_size in (1, 2, 4):
        out.update(_spawn(data_dir, world_size))
    return out


def _assert_same(results, name, ref, layout):
    got, expected = results[name], results[ref]
    assert got["layout"] == layout, f"{name} ran as {got['layout']}"
    assert expected["layout"]["world"] == 1
    assert len(got["steps"]) == len(expected["steps"]) == STEPS
    for step, ((loss, norm, tokens), (ref_loss, ref_norm, ref_tokens)) in enumerate(zip(got["steps"], expected["steps"]), 1):
        assert tokens == ref_tokens, f"{name}, step {step}: {tokens} tokens vs {ref_tokens} in {ref}"
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"{name}, step {step}: loss {loss} vs {ref_loss} ({ref})"
        assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), f"{name}, step {step}: grad norm {norm} vs {ref_norm} ({ref})"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, ref, layout",
    [
        ("ring2", "ref_packed", {"world": 2, "dp": 1, "ring": 2, "ulysses": 1}),
        ("ring2_chunk", "ref_packed", {"world": 2, "dp": 1, "ring": 2, "ulysses": 1}),
        ("ulysses2", "ref_packed", {"world": 2, "dp": 1, "ring": 1, "ulysses": 2}),
        ("dp2_ring2", "ref_packed_mbs2", {"world": 4, "dp": 2, "ring": 2, "ulysses": 1}),
        ("per_token_dp2", "ref_per_token", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
        ("per_token_dp2_accum2", "ref_per_token", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
        ("per_sample_dp2", "ref_per_sample", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
        ("per_sample_dp2_accum2", "ref_per_sample", {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}),
    ],
)
def test_varlen_layout_matches_one_process(results, name, ref, layout):
    _assert_same(results, name, ref, layout)


def test_varlen_references_are_varied_and_learn(results):
    """The references really pack several samples per row and learn, so the comparisons above mean something."""
    packed, unpacked = results["ref_packed"]["steps"], results["ref_per_token"]["steps"]
    assert len({tokens for _, _, tokens in packed}) > 1 and len({tokens for _, _, tokens in unpacked}) > 1
    assert max(results["ref_packed"]["samples_per_row"]) > 1 and max(results["ref_packed_mbs2"]["samples_per_row"]) > 1
    for name in ("ring2", "ring2_chunk", "ulysses2", "dp2_ring2"):
        assert results[name]["padded_plan_differs"], f"{name}: padding before planning would give the same rows here"
    for ref in ("ref_packed", "ref_packed_mbs2", "ref_per_token", "ref_per_sample"):
        steps = results[ref]["steps"]
        assert steps[-1][0] < steps[0][0], f"{ref} should learn"
