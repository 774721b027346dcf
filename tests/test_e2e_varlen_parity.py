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

The cases are a table run by `tests/parity.py` (each world size spawned once).
The data-parallel cases use a dataset with at least one image per sample (see
`make_varlen_dataset`); the CP-only cases keep samples without images.
"""

import pytest

from apprun import TINY
from parity import Case, Probe, SamplesPerRow, assert_matches, learns, run_cases, session_dir

STEPS = 5  # with 4, padding before planning gives the same first rows for ring 2: the CP cases would guard nothing


class PaddedPlanDiffers(Probe):
    """Whether planning on lengths padded to CP's multiple (the old loader) gives other first rows than the
    loader's unpadded plan: the CP cases below only guard that fix when it does."""

    name = "padded_plan_differs"

    def result(self, trainer) -> bool:
        import numpy as np

        from mmfsdp.data.loader import plan_epoch
        from mmfsdp.parallel.cp.layout import required_multiple

        loader, multiple = trainer.loader, required_multiple(trainer.plan.ring, trainer.plan.ulysses)
        lengths = np.asarray(loader.dataset.lengths)
        old = plan_epoch(
            -(-lengths // multiple) * multiple, epoch=0, seed=loader.seed, shuffle=loader.shuffle,
            packing=loader.packing, capacity=loader.capacity, micro_batch_size=loader.micro_batch_size,
            dp_rank=loader.dp_rank, dp_size=loader.dp_size, drop_last=loader.drop_last,
        )
        return old[:STEPS] != loader._epoch_plan(0)[:STEPS]


def _packed(micro_batch_size: int, **extra) -> dict:
    return {
        "data.dataset_param.basic_parameters.packing": "true", "training.micro_batch_size": micro_batch_size, **extra,
    }


def _case(name: str, world: int, dataset: str, overrides: dict, ref: str | None = None, layout: dict | None = None,
          probes: tuple = ()) -> Case:
    return Case(name, world, TINY, {**overrides, "training.train_iters": STEPS}, ref, dataset=dataset, layout=layout,
                probes=probes or ((SamplesPerRow, PaddedPlanDiffers) if ref else ()))


RING2, ULYSSES2 = {"parallel.ring_attention_size": 2}, {"parallel.ulysses_parallel_size": 2}
CHUNK = {"features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16}
CP2 = {"world": 2, "dp": 1, "ring": 2, "ulysses": 1}
DP2 = {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}
CASES = {
    case.name: case
    for case in [
        # each reference is shared by the cases that compare with it
        _case("ref_packed", 1, "varlen", _packed(1), probes=(SamplesPerRow,)),
        _case("ref_packed_mbs2", 1, "varlen_img", _packed(2), probes=(SamplesPerRow,)),
        *(
            _case(f"ref_{loss}", 1, "varlen_img", {"features.loss_cfg.loss_type": loss, "training.micro_batch_size": 4})
            for loss in ("per_token", "per_sample")
        ),
        _case("ring2", 2, "varlen", _packed(1, **RING2), "ref_packed", CP2),
        _case("ring2_chunk", 2, "varlen", _packed(1, **RING2, **CHUNK), "ref_packed", CP2),
        _case("ulysses2", 2, "varlen", _packed(1, **ULYSSES2), "ref_packed", {**CP2, "ring": 1, "ulysses": 2}),
        _case("dp2_ring2", 4, "varlen_img", _packed(1, **RING2), "ref_packed_mbs2", {**CP2, "world": 4, "dp": 2}),
        *(
            _case(f"{loss}_dp2{suffix}", 2, "varlen_img", {
                "features.loss_cfg.loss_type": loss, "training.micro_batch_size": mbs,
                "training.gradient_accumulation_steps": accum,
            }, f"ref_{loss}", DP2)
            for loss in ("per_token", "per_sample")
            for suffix, mbs, accum in (("", 2, 1), ("_accum2", 1, 2))
        ),
    ]
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(list(CASES.values()), tmp_path_factory.mktemp("varlen"), session_dir(tmp_path_factory))


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.reference is not None])
def test_varlen_layout_matches_one_process(results, name):
    assert_matches(results, CASES[name])


@pytest.mark.slow  # reads the same runs as the comparisons
def test_varlen_references_are_varied_and_learn(results):
    """The references really pack several samples per row and learn, so the comparisons above mean something."""
    packed, unpacked = results["ref_packed"]["steps"], results["ref_per_token"]["steps"]
    assert len({tokens for _, _, tokens in packed}) > 1 and len({tokens for _, _, tokens in unpacked}) > 1
    assert max(results["ref_packed"]["samples_per_row"][0]) > 1
    assert max(results["ref_packed_mbs2"]["samples_per_row"][0]) > 1
    for name in ("ring2", "ring2_chunk", "ulysses2", "dp2_ring2"):
        assert results[name]["padded_plan_differs"][0], f"{name}: padding before planning would give the same rows here"
    for ref in ("ref_packed", "ref_packed_mbs2", "ref_per_token", "ref_per_sample"):
        assert learns(results[ref]), f"{ref} should learn"
