"""Host round trips of a packed training micro-batch do not grow with depth: the decoder layers make none.

For Qwen3-VL, Qwen3.5 and Qwen3.5 MoE (`mmfsdp.model.host_sync_probe.probe_training_step`: one packed row of a
text sample and two with images of different sizes, forward + backward as the trainer runs it), without context
parallel and with Ulysses 2 and Ring 2 (2 gloo ranks): the `HostSyncCounter`'s count is the same for the model
with twice the decoder layers, and the layers' own forward makes none. The counts are printed (`-s`), per family
and layout; what remains is per micro-batch (the M-RoPE positions, HF's vision tower).
"""

from __future__ import annotations

import pytest

from mmfsdp.parallel.testing import run_distributed

FAMILIES = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")


def _counts(model_id: str, parallel_dims=None) -> dict[str, object]:
    from mmfsdp.model.host_sync_probe import probe_training_step

    result = {}
    for double in (False, True):
        counter = probe_training_step(model_id, double_layers=double, parallel_dims=parallel_dims)
        result["doubled" if double else "base"] = (counter.total, sum(counter.in_layers.values()), counter.report())
    return result


def _check(label: str, model_id: str, counts: dict) -> None:
    (base, base_layers, report), (doubled, doubled_layers, doubled_report) = counts["base"], counts["doubled"]
    print(f"{model_id} {label}: {report}; doubled layers: {doubled_report}")
    assert base_layers == 0 and doubled_layers == 0, (model_id, label, report, doubled_report)
    assert base == doubled, (model_id, label, report, doubled_report)


@pytest.mark.parametrize("model_id", FAMILIES)
def test_host_round_trips_do_not_grow_with_depth(model_id):
    _check("no CP", model_id, _counts(model_id))


def _cp_rank(rank: int, world_size: int, ring: int, ulysses: int) -> dict:
    import mmfsdp.model.all_families  # noqa: F401  (registers the families in the rank)
    from mmfsdp.parallel import MeshPlan, ParallelConfig, build_parallel_dims

    plan = MeshPlan.from_config(ParallelConfig(ulysses_parallel_size=ulysses, ring_attention_size=ring), world_size)
    dims = build_parallel_dims(plan, "cpu")
    return {model_id: _counts(model_id, dims) for model_id in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("ring, ulysses", [(1, 2), (2, 1)], ids=["ulysses2", "ring2"])
def test_host_round_trips_do_not_grow_with_depth_under_cp(ring, ulysses):
    per_rank = run_distributed(_cp_rank, 2, ring, ulysses)
    for rank, counts in enumerate(per_rank):
        for model_id in FAMILIES:
            _check(f"{'ring' if ring > 1 else 'ulysses'}2 rank {rank}", model_id, counts[model_id])
