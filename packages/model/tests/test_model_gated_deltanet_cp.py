"""The Gated DeltaNet layer under Ring, Ulysses and Hybrid context parallel equals the unsplit layer.

Every gloo rank builds the same tiny layer and full batch (fixed seed), computes the
reference with `gated_deltanet_forward` on the whole batch (packed rows with
`cu_seq_lens`, dense rows as samples; the same torch kernel as the split run), runs it on its
shard (`split_for_cp` with the rank's `CPLayout`), and compares its output shard and input-gradient shard with
the reference's, and the parameter gradients summed over the ranks with the reference's (relative Frobenius
error). One spawn per world size runs all cases. Sample lengths do not divide the chunk size (64); some rank
pieces are shorter than the conv kernel, so halos come from several chunks. Rank 0 also checks the unsplit
reference against HF's `Qwen3_5GatedDeltaNet` (torch fallback) on each sample alone, with
`test_model_gated_deltanet.py`'s bounds, so that the split is anchored to HF at these cases' lengths.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mmfsdp.parallel.testing import record_margin, run_distributed

# fp32: the same kernel on both sides, but Ring (and hybrid) CP re-chunks every sample (each rank piece of n/2R
# tokens starts a new 64-token chunk) and applies the entering state after the scan (`S_inᵀ Aᵀ q`), so its sums
# are not the unsplit layer's. Measured in the Ring and hybrid cases (docs/testing.md, "Tolerances and their
# margins"; AMD EPYC, torch 2.14), each fp32 side against the same computation in fp64: split up to 3.2e-6
# (ring2-long grad A_log), unsplit up to 4.9e-6 (ring4-packed, hybrid2x2-packed grad A_log), summed per case at most
# 6.5e-6; the sides differ by up to 5.1e-6 (ring2-long grad A_log): 1e-5. Ulysses keeps the chunking (heads split),
# so its sides round alike: 1.0e-6 apart, though each is up to 9.9e-6 from fp64 (ulysses4-packed grad input).
TOLERANCE = 1e-5
FP64_TOLERANCE = 1e-12

# name: (ring, ulysses, key heads, batch, lengths (one entry: dense rows)[, initial state per sample[, fp64]])
# The fp64 cases (the layer and its gated norm in fp64) compare at 1e-12: the split is exact, not merely within fp32
# rounding.
CASES_2 = {
    "ring2-packed": (2, 1, 2, 1, [4, 132, 8, 20]),
    "ring2-packed-initial-state": (2, 1, 2, 1, [4, 132, 8], True),
    "ulysses2-packed-fp64": (1, 2, 2, 1, [2, 130, 6], True, True),
    "ring2-long": (2, 1, 2, 1, [260]),
    "ring2-dense": (2, 1, 2, 2, [68]),
    "ulysses2-packed": (1, 2, 2, 1, [2, 130, 6, 20]),
    "ulysses2-dense": (1, 2, 4, 2, [70]),
}
CASES_4 = {
    "ring4-packed": (4, 1, 2, 1, [8, 136, 24]),
    "ring4-long": (4, 1, 2, 1, [8, 520]),
    "ring4-packed-fp64": (4, 1, 2, 1, [8, 136, 24], True, True),
    "ulysses4-packed": (1, 4, 4, 1, [4, 132, 8]),
    "hybrid2x2-packed": (2, 2, 2, 1, [8, 136, 24]),
    "hybrid2x2-dense": (2, 2, 2, 2, [72]),
    "hybrid2x2-packed-initial-state": (2, 2, 2, 1, [8, 136], True),
    "hybrid2x2-packed-fp64": (2, 2, 2, 1, [8, 136, 24], True, True),
}


def _groups(ring: int, ulysses: int):
    """This rank's ring and Ulysses groups (CP rank = ring_rank · U + ulysses_rank); every rank creates all."""
    rank = dist.get_rank()
    ring_group = ulysses_group = None
    for u in range(ulysses):
        group = dist.new_group([r * ulysses + u for r in range(ring)])
        if rank % ulysses == u:
            ring_group = group
    for r in range(ring):
        group = dist.new_group([r * ulysses + u for u in range(ulysses)])
        if rank // ulysses == r:
            ulysses_group = group
    return (ring_group if ring > 1 else None), (ulysses_group if ulysses > 1 else None)


def _case(
    rank: int,
    ring: int,
    ulysses: int,
    key_heads: int,
    batch: int,
    lengths: list[int],
    with_state: bool = False,
    fp64: bool = False,
) -> dict[str, float]:
    """Errors of one case against the unsplit layer (with `with_state`, the initial state's gradient too); on
    rank 0 of the fp32 cases without a state (HF's layer takes none without a cache), also the unsplit layer's
    against HF per sample."""
    from mmfsdp.model.context_parallel import CPContext
    from mmfsdp.model.gated_deltanet import gated_deltanet_forward
    from mmfsdp.parallel.cp import CPLayout, split_for_cp

    from test_model_gated_deltanet import GRAD_TOLERANCE, grads, hf_per_sample, rel, tiny_gdn
    from test_model_gated_deltanet import TOLERANCE as HF_OUTPUT_TOLERANCE

    ring_group, ulysses_group = _groups(ring, ulysses)
    module = tiny_gdn(seed=0, key_heads=key_heads, conv_bias=True)
    dtype = torch.float64 if fp64 else torch.float32
    if fp64:
        module.double()
        module.norm.forward = _gated_norm_fp64(module.norm)
    torch.manual_seed(5)
    packed = len(lengths) > 1
    seq = sum(lengths)
    full = torch.randn(batch, seq, 32, dtype=dtype, requires_grad=True)
    cotangent = torch.randn(batch, seq, 32, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    state = None
    if with_state:
        samples = len(lengths) if packed else batch
        shape = (samples, module.num_v_heads, module.head_k_dim, module.head_v_dim)
        state = torch.randn(shape, dtype=dtype, requires_grad=True)
    want = gated_deltanet_forward(module, full, cu, initial_state=state, kernel="torch")
    want_grads = grads(module, full, (want * cotangent).sum(), state)
    anchor = {}
    if rank == 0 and not fp64 and not with_state:
        hf = hf_per_sample(module, full, lengths) if packed else torch.cat([module(row[None]) for row in full])
        hf_grads = grads(module, full, (hf * cotangent).sum())
        anchor["unsplit vs HF output"] = (rel(want, hf), HF_OUTPUT_TOLERANCE)
        for name, value in hf_grads.items():
            anchor[f"unsplit vs HF grad {name}"] = (rel(want_grads[name], value), GRAD_TOLERANCE)

    layout = CPLayout.create(
        seq, cu, ring_size=ring, ring_rank=rank // ulysses, ulysses_size=ulysses, ulysses_rank=rank % ulysses
    )
    local = split_for_cp(full.detach(), layout).requires_grad_(True)
    out = gated_deltanet_forward(
        module, local, cp=CPContext(layout, ring_group, ulysses_group), initial_state=state, kernel="torch"
    )
    got_grads = grads(module, local, (out * split_for_cp(cotangent, layout)).sum(), state)
    errors = {"output": rel(out, split_for_cp(want.detach(), layout))}
    errors["grad input"] = rel(got_grads["input"], split_for_cp(want_grads["input"], layout))
    for name, value in got_grads.items():
        if name != "input":
            dist.all_reduce(value)
            errors[f"grad {name}"] = rel(value, want_grads[name])
    return {what: (err, FP64_TOLERANCE if fp64 else TOLERANCE) for what, err in errors.items()} | anchor


def _gated_norm_fp64(norm):
    """HF's gated RMS norm without its fp32 round trip (for the fp64 cases)."""

    def forward(x, gate):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * x * torch.nn.functional.silu(gate)

    return forward


def _run_cases(rank: int, world_size: int, cases: dict) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    return {name: _case(rank, *spec) for name, spec in cases.items()}


def _check(results: list[dict[str, dict[str, tuple[float, float]]]]) -> None:
    flat = [
        (err, tol, rank, case, what)
        for rank, per_case in enumerate(results)
        for case, errors in per_case.items()
        for what, (err, tol) in errors.items()
    ]
    for err, tol, rank, case, what in flat:
        record_margin(err, tol, f"rank {rank} {case} {what}")
    bad = [f"rank {rank} {case} {what}: {err:.2e} > {tol:.0e}" for err, tol, rank, case, what in flat if not err <= tol]
    for tol in sorted({item[1] for item in flat}):
        err, _, rank, case, what = max(item for item in flat if item[1] == tol)
        print(f"worst relative error at tolerance {tol:.0e}: {err:.1e} (rank {rank} {case} {what})")
    outputs = [item[0] for item in flat if item[4] == "output" and item[1] == TOLERANCE]
    print(f"worst fp32 output error: {max(outputs):.1e}")
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_gated_deltanet_cp2():
    _check(run_distributed(_run_cases, 2, CASES_2))


@pytest.mark.slow
def test_gated_deltanet_cp4():
    _check(run_distributed(_run_cases, 4, CASES_4))
