import pytest
import torch.distributed as dist

from mmfsdp.config import ConfigError
from mmfsdp.parallel import MeshPlan, ParallelConfig, build_parallel_dims
from mmfsdp.parallel.testing import run_distributed


@pytest.mark.parametrize(
    ("world_size", "settings", "shape"),
    [
        (1, {}, (1, 1, 1, 1)),
        (2, {}, (1, 2, 1, 1)),
        (2, {"data_parallel_replicate_size": 2}, (2, 1, 1, 1)),
        (2, {"ulysses_parallel_size": 2}, (1, 1, 1, 2)),
        (2, {"ring_attention_size": 2, "fully_shard_parallel_size": 2}, (1, 1, 2, 1)),
        (4, {}, (1, 4, 1, 1)),
        (4, {"fully_shard_parallel_size": 4, "ulysses_parallel_size": 2}, (1, 2, 1, 2)),
        (4, {"data_parallel_replicate_size": 2}, (2, 2, 1, 1)),
        (4, {"data_parallel_replicate_size": 2, "ring_attention_size": 2}, (2, 1, 2, 1)),
        (4, {"ring_attention_size": 2, "ulysses_parallel_size": 2}, (1, 1, 2, 2)),
        (8, {"data_parallel_replicate_size": 2, "fully_shard_parallel_size": 4, "ulysses_parallel_size": 2}, (2, 2, 1, 2)),
    ],
)
def test_parallel_mesh_plan_shapes(world_size, settings, shape):
    plan = MeshPlan.from_config(ParallelConfig(**settings), world_size)
    assert plan.shape == shape
    assert plan.world_size == world_size
    assert plan.cp == plan.ring * plan.ulysses
    assert plan.fully_shard == plan.dp_shard * plan.cp
    assert plan.dp == plan.dp_replicate * plan.dp_shard


@pytest.mark.parametrize(
    ("world_size", "settings", "key", "message"),
    [
        (8, {"ulysses_parallel_size": 3}, "parallel.ulysses_parallel_size",
         "3 does not divide fully_shard_parallel_size 8 (world size 8); use one of 1, 2, 4, 8"),
        (4, {"data_parallel_replicate_size": 3}, "parallel.data_parallel_replicate_size",
         "3 does not divide the world size 4; use one of 1, 2, 4"),
        (8, {"fully_shard_parallel_size": 8, "data_parallel_replicate_size": 2}, "parallel.fully_shard_parallel_size",
         "8 × data_parallel_replicate_size 2 = 16 ranks, but the world size is 8; set it to 4 or 'auto'"),
        (2, {"fully_shard_parallel_size": 4}, "parallel.fully_shard_parallel_size",
         "4 × data_parallel_replicate_size 1 = 4 ranks, but the world size is 2; set it to 2 or 'auto'"),
        (4, {"ulysses_parallel_size": 2, "ring_attention_size": 4}, "parallel.ring_attention_size",
         "ring_attention_size 4 × ulysses_parallel_size 2 = 8 does not divide fully_shard_parallel_size 4 (world size 4)"),
        (8, {"data_parallel_replicate_size": 2, "ulysses_parallel_size": 8}, "parallel.ulysses_parallel_size",
         "8 does not divide fully_shard_parallel_size 4 (world size 8)"),
    ],
)
def test_parallel_mesh_plan_errors(world_size, settings, key, message):
    with pytest.raises(ConfigError) as err:
        MeshPlan.from_config(ParallelConfig(**settings), world_size)
    assert err.value.key == key
    assert message in err.value.message


def _layout(rank, world_size, plans):
    out = []
    try:
        build_parallel_dims(MeshPlan(dp_replicate=1, dp_shard=2 * world_size, ring=1, ulysses=1), "cpu")
    except RuntimeError as err:
        out.append(str(err))
    for plan in plans:
        dims = build_parallel_dims(plan, "cpu")
        ranks = lambda group: dist.get_process_group_ranks(group)  # noqa: E731
        out.append(
            dict(
                dp_rank=dims.dp_rank, dp_size=dims.dp_size, cp_rank=dims.cp_rank, cp_size=dims.cp_size,
                cp=ranks(dims.cp_group), ulysses=ranks(dims.ulysses_group), ring=ranks(dims.ring_group),
                dp=ranks(dims.dp_group), dp_cp=ranks(dims.dp_cp_mesh.get_group()),
                dp_shard_cp=dims.dp_shard_cp_mesh.mesh.flatten().tolist(),
                fsdp_mesh=(dims.fsdp_mesh.mesh_dim_names, dims.fsdp_mesh.mesh.tolist()),
            )
        )
    return out


def test_parallel_mesh_two_ranks():
    plans = [MeshPlan(dp_replicate=1, dp_shard=2, ring=1, ulysses=1), MeshPlan(dp_replicate=1, dp_shard=1, ring=1, ulysses=2)]
    results = run_distributed(_layout, 2, plans)
    for rank, (error, fsdp, ulysses) in enumerate(results):
        assert "the mesh plan is for 4 ranks but the process group has 2" in error
        assert (fsdp["dp_rank"], fsdp["dp_size"], fsdp["cp_rank"], fsdp["cp_size"]) == (rank, 2, 0, 1)
        assert fsdp["dp"] == fsdp["dp_cp"] == fsdp["dp_shard_cp"] == [0, 1] and fsdp["cp"] == [rank]
        assert fsdp["fsdp_mesh"] == (("dp_shard_cp",), [0, 1])
        assert (ulysses["dp_rank"], ulysses["dp_size"], ulysses["cp_rank"], ulysses["cp_size"]) == (0, 1, rank, 2)
        assert ulysses["cp"] == ulysses["ulysses"] == ulysses["dp_cp"] == [0, 1]
        assert ulysses["ring"] == ulysses["dp"] == [rank]


def test_parallel_mesh_four_ranks():
    plans = [
        MeshPlan(dp_replicate=2, dp_shard=2, ring=1, ulysses=1),
        MeshPlan(dp_replicate=1, dp_shard=2, ring=1, ulysses=2),
        MeshPlan(dp_replicate=1, dp_shard=1, ring=2, ulysses=2),
        MeshPlan(dp_replicate=2, dp_shard=1, ring=2, ulysses=1),
    ]
    results = run_distributed(_layout, 4, plans)
    for rank, (error, hsdp, shard_ulysses, ring_ulysses, replicate_ring) in enumerate(results):
        assert "the mesh plan is for 8 ranks" in error
        assert (hsdp["dp_rank"], hsdp["dp_size"], hsdp["cp_size"]) == (rank, 4, 1)
        assert hsdp["dp_shard_cp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert hsdp["fsdp_mesh"] == (("dp_replicate", "dp_shard_cp"), [[0, 1], [2, 3]])
        assert hsdp["dp"] == hsdp["dp_cp"] == [0, 1, 2, 3]

        # ranks 2k and 2k+1 form one Ulysses group and read the same samples
        assert (shard_ulysses["dp_rank"], shard_ulysses["cp_rank"]) == (rank // 2, rank % 2)
        assert shard_ulysses["cp"] == shard_ulysses["ulysses"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert shard_ulysses["dp"] == [rank % 2, rank % 2 + 2]
        assert shard_ulysses["dp_shard_cp"] == shard_ulysses["dp_cp"] == [0, 1, 2, 3]
        assert shard_ulysses["fsdp_mesh"] == (("dp_shard_cp",), [0, 1, 2, 3])

        assert (ring_ulysses["dp_rank"], ring_ulysses["dp_size"], ring_ulysses["cp_rank"], ring_ulysses["cp_size"]) == (0, 1, rank, 4)
        assert ring_ulysses["ulysses"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert ring_ulysses["ring"] == [rank % 2, rank % 2 + 2]

        assert (replicate_ring["dp_rank"], replicate_ring["dp_size"], replicate_ring["cp_rank"]) == (rank // 2, 2, rank % 2)
        assert replicate_ring["fsdp_mesh"] == (("dp_replicate", "dp_shard_cp"), [[0, 1], [2, 3]])
        assert replicate_ring["ring"] == replicate_ring["cp"] == [rank // 2 * 2, rank // 2 * 2 + 1]
