import pytest

from mmfsdp.config import ConfigError, build
from mmfsdp.parallel import FSDPPlanConfig, ParallelConfig, RecomputePlanConfig


def test_parallel_config_defaults():
    cfg = build(ParallelConfig, None, "parallel")
    assert cfg.fully_shard_parallel_size == "auto"
    assert (cfg.data_parallel_replicate_size, cfg.ulysses_parallel_size, cfg.ring_attention_size) == (1, 1, 1)
    assert cfg.fsdp_plan == FSDPPlanConfig()
    assert cfg.fsdp_plan.apply_modules is None and cfg.fsdp_plan.ignored_modules == []
    assert (cfg.fsdp_plan.param_dtype, cfg.fsdp_plan.reduce_dtype) == (None, "fp32")
    assert cfg.recompute is False and cfg.recompute_plan == RecomputePlanConfig()


def test_parallel_config_reads_the_documented_yaml_shape():
    cfg = build(
        ParallelConfig,
        {
            "tensor_parallel_size": 1,
            "fully_shard_parallel_size": 4,
            "data_parallel_replicate_size": 2,
            "ulysses_parallel_size": 2,
            "fsdp_plan": {
                "apply_modules": ["model.language_model.layers.{*}", "lm_head"],
                "param_dtype": "bf16",
                "reduce_dtype": "fp32",
                "num_to_forward_prefetch": 1,
            },
            "recompute": True,
            "recompute_plan": {"apply_modules": ["model.language_model.layers.{0-9}"]},
        },
        "parallel",
    )
    assert cfg.fully_shard_parallel_size == 4 and cfg.data_parallel_replicate_size == 2
    assert cfg.fsdp_plan.apply_modules == ["model.language_model.layers.{*}", "lm_head"]
    assert cfg.fsdp_plan.param_dtype == "bf16" and cfg.fsdp_plan.num_to_forward_prefetch == 1
    assert cfg.recompute_plan.apply_modules == ["model.language_model.layers.{0-9}"]


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        ({"tensor_parallel_size": 2}, "parallel.tensor_parallel_size", "not supported"),
        ({"ulysses_parallel_size": 0}, "parallel.ulysses_parallel_size", ">= 1"),
        ({"ring_attention_size": -1}, "parallel.ring_attention_size", ">= 1"),
        ({"data_parallel_replicate_size": 0}, "parallel.data_parallel_replicate_size", ">= 1"),
        ({"fully_shard_parallel_size": 0}, "parallel.fully_shard_parallel_size", "'auto' or an integer"),
        ({"fully_shard_parallel_size": "all"}, "parallel.fully_shard_parallel_size", "expected"),
        ({"fsdp_plan": {"param_dtype": "bf32"}}, "parallel.fsdp_plan.param_dtype", "'bf16'"),
        ({"fsdp_plan": {"num_to_backward_prefetch": -1}}, "parallel.fsdp_plan.num_to_backward_prefetch", ">= 0"),
        ({"fsdp_plan": {"apply_module": ["x"]}}, "parallel.fsdp_plan.apply_module", "did you mean"),
    ],
)
def test_parallel_config_errors_carry_the_key(data, key, words):
    with pytest.raises(ConfigError) as err:
        build(ParallelConfig, data, "parallel")
    assert err.value.key == key
    assert words in err.value.message


def test_parallel_config_tp_message_points_to_fsdp_and_cp():
    with pytest.raises(ConfigError, match="fully_shard_parallel_size.*ulysses_parallel_size"):
        ParallelConfig(tensor_parallel_size=4)


def test_expert_parallel_size_and_plan():
    from mmfsdp.config import ConfigError, build
    from mmfsdp.parallel import ParallelConfig

    cfg = build(ParallelConfig, {"expert_parallel_size": 2, "ep_plan": {"apply_modules": ["a.{*}.experts"]}}, "parallel")
    assert cfg.expert_parallel_size == 2 and cfg.ep_plan.apply_modules == ["a.{*}.experts"]
    assert build(ParallelConfig, {}, "parallel").ep_plan.apply_modules is None
    with pytest.raises(ConfigError, match=r"^parallel\.expert_parallel_size: must be >= 1, got 0"):
        build(ParallelConfig, {"expert_parallel_size": 0}, "parallel")


@pytest.mark.parametrize(
    "sizes, world, ep, efsdp",
    [({}, 8, 2, 4), ({"ulysses_parallel_size": 2}, 4, 4, 1), ({"data_parallel_replicate_size": 2}, 8, 2, 2)],
)
def test_mesh_plan_carves_expert_parallel_out_of_the_shard_group(sizes, world, ep, efsdp):
    from mmfsdp.parallel import MeshPlan, ParallelConfig

    plan = MeshPlan.from_config(ParallelConfig(expert_parallel_size=ep, **sizes), world)
    assert (plan.ep, plan.efsdp, plan.world_size) == (ep, efsdp, world)
    assert plan.ep * plan.efsdp == plan.fully_shard


def test_mesh_plan_expert_parallel_must_divide_the_shard_group():
    from mmfsdp.config import ConfigError
    from mmfsdp.parallel import MeshPlan, ParallelConfig

    with pytest.raises(ConfigError, match=r"^parallel\.expert_parallel_size: 4 does not divide the FSDP shard group of 2 ranks"):
        MeshPlan.from_config(ParallelConfig(expert_parallel_size=4, data_parallel_replicate_size=2), 4)


def test_one_dtype_table_for_every_dtype_name_the_config_accepts():
    from typing import get_args

    import torch

    from mmfsdp.parallel import DTYPES, dtype_name
    from mmfsdp.parallel.config import DType

    assert tuple(DTYPES) == get_args(DType)
    assert DTYPES["bf16"] is torch.bfloat16 and DTYPES["fp32"].itemsize == 4
    assert [dtype_name(dtype) for dtype in DTYPES.values()] == list(DTYPES)
    assert dtype_name(torch.float64) == "float64"
