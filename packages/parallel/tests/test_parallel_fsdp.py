"""FSDP2 parity: sharded training on gloo ranks equals the plain single-process computation.

Each distributed run trains the same tiny model for two AdamW steps on its slice
of a fixed batch and returns the loss, full gradients and updated parameters;
the parent process computes the same steps without FSDP and compares.
"""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from mmfsdp.config import ConfigError
from mmfsdp.parallel import (
    FSDPGroup,
    FSDPPlanConfig,
    MeshPlan,
    apply_activation_checkpointing,
    apply_fsdp,
    apply_fsdp_groups,
    build_parallel_dims,
    group_small_modules,
    clip_grad_norm,
    is_checkpointed,
)
from mmfsdp.parallel.testing import assert_within, run_distributed

DIM, IN_DIM, OUT_DIM, BATCH, STEPS = 8, 6, 3, 8, 2
DEFAULT_MODULES = ["blocks.{*}", "head"]


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x, *, scale: float = 1.0):
        return x + scale * self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(IN_DIM, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(3))
        self.head = nn.Linear(DIM, OUT_DIM)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h)


def _model(frozen: tuple[str, ...] = ()) -> Toy:
    torch.manual_seed(0)
    model = Toy()
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    return model


def _batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, IN_DIM, generator=generator), torch.randn(BATCH, OUT_DIM, generator=generator)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model, x, y, clip: float | None, reduce_loss) -> dict:
    """Two AdamW steps; returns losses, first-step gradients (after clipping), norms and final params."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            out["norms"].append(clip_grad_norm(model.parameters(), clip).item())
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        out["losses"].append(reduce_loss(loss.detach()))
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def _reference(frozen=(), clip=None):
    model = _model(frozen)
    x, y = _batch()
    return _train(model, x, y, clip, lambda loss: loss.item())


def _torch_clip_reference(max_norm: float):
    """The single-process result with torch's own clip_grad_norm_."""
    model = _model()
    x, y = _batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _to_bytes(results) -> bytes:
    """Tensors sent back through the result queue would share memory with a process that exits; send bytes."""
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data))


def _mean_over_ranks(loss: torch.Tensor) -> float:
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return loss.item()


SCENARIOS_2 = {
    "plain": dict(plan=dict(apply_modules=["blocks.{*}"], min_group_params=0)),
    # blocks 0-1 in one group, block 2 in another, `head` in the root's group (a block has 296 parameters)
    "grouped_prefetch_recompute": dict(
        plan=dict(min_group_params=500, num_to_forward_prefetch=1, num_to_backward_prefetch=1),
        recompute=("blocks.{0-2}",), clip=0.05,
    ),
    "defaults_frozen_prefetch": dict(
        plan=dict(num_to_forward_prefetch=1, num_to_backward_prefetch=2, reshard_after_forward=False, min_group_params=0),
        frozen=("blocks.1",),
    ),
    "ignored_frozen_embed": dict(plan=dict(apply_modules=["blocks.{0-2}"], ignored_modules=["embed"], min_group_params=0),
                                 frozen=("embed",)),
    "recompute": dict(plan=dict(min_group_params=0), recompute=("blocks.{0-1}",)),
    "clip": dict(plan=dict(), clip=0.05),  # the defaults: this ~1k-parameter model is one root group
    "clip_norm_only": dict(plan=dict(), clip=0.0),
    "cpu_offload": dict(plan=dict(cpu_offload=True, reduce_dtype=None, min_group_params=0)),
}


def _fsdp_scenarios(rank, world_size, scenarios):
    dims = build_parallel_dims(MeshPlan(dp_replicate=1, dp_shard=world_size, ring=1, ulysses=1), "cpu")
    x, y = _batch()
    rows = slice(dims.dp_rank * BATCH // dims.dp_size, (dims.dp_rank + 1) * BATCH // dims.dp_size)
    results = {}
    for name, spec in scenarios.items():
        model = _model(spec.get("frozen", ()))
        if spec.get("recompute"):
            apply_activation_checkpointing(model, list(spec["recompute"]))
        names_before = list(model.state_dict())
        apply_fsdp(model, FSDPPlanConfig(**spec["plan"]), dims.fsdp_mesh, DEFAULT_MODULES)
        result_groups = [sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n)]
        result = _train(model, x[rows], y[rows], spec.get("clip"), _mean_over_ranks)
        result["names_unchanged"] = list(model.state_dict()) == names_before
        result["fsdp_modules"] = result_groups[0]
        result["checkpointed"] = [n for n, m in model.named_modules() if is_checkpointed(m)]
        results[name] = result
    results["bf16_dtypes"] = _bf16_dtypes(dims, x[rows], y[rows])
    return _to_bytes(results)


def _bf16_dtypes(dims, x, y):
    """With param_dtype bf16 the blocks compute in bf16 while the sharded parameters and gradients stay fp32."""
    model = _model()
    seen = []
    model.blocks[0].fc1.register_forward_pre_hook(lambda module, args: seen.append((module.weight.dtype, args[0].dtype)))
    apply_fsdp(model, FSDPPlanConfig(param_dtype="bf16"), dims.fsdp_mesh, DEFAULT_MODULES)
    nn.functional.mse_loss(model(x).float(), y).backward()
    return dict(
        compute=seen,
        params={p.dtype for p in model.parameters()},
        grads={p.grad.dtype for p in model.parameters()},
    )


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str):
    scale = expected.norm().item()
    diff = (actual - expected).norm().item()
    assert_within(diff / max(scale, 1e-12), 1e-5, what)


def _assert_same_training(result: dict, reference: dict):
    for step, (loss, ref) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert_within(abs(loss - ref) / abs(ref), 1e-5, f"loss at step {step}: {loss} vs {ref}")
    assert result["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        _assert_close(result["grads"][name], grad, f"grad {name}")
    assert result["params"].keys() == reference["params"].keys()
    for name, param in reference["params"].items():
        _assert_close(result["params"][name], param, f"param {name}")
    for step, (norm, ref) in enumerate(zip(result["norms"], reference["norms"], strict=True)):
        assert_within(abs(norm - ref) / ref, 1e-5, f"grad norm at step {step}: {norm} vs {ref}")


@pytest.fixture(scope="module")
def two_rank_results():
    return [_from_bytes(data) for data in run_distributed(_fsdp_scenarios, 2, SCENARIOS_2)]


@pytest.mark.parametrize("scenario", list(SCENARIOS_2))
def test_parallel_fsdp_two_ranks_match_single_process(two_rank_results, scenario):
    spec = SCENARIOS_2[scenario]
    reference = _reference(spec.get("frozen", ()), spec.get("clip"))  # recompute must not change the numbers
    for result in two_rank_results:
        _assert_same_training(result[scenario], reference)
        assert result[scenario]["names_unchanged"]


def test_parallel_fsdp_param_dtype_bf16_computes_in_bf16_and_keeps_fp32_shards(two_rank_results):
    dtypes = two_rank_results[0]["bf16_dtypes"]
    assert dtypes["compute"] == [(torch.bfloat16, torch.bfloat16)]
    assert dtypes["params"] == dtypes["grads"] == {torch.float32}


def test_parallel_fsdp_frozen_params_get_no_grad_and_stay(two_rank_results):
    initial = {n: p.detach() for n, p in _model().named_parameters()}
    result = two_rank_results[0]["defaults_frozen_prefetch"]
    assert not any(name.startswith("blocks.1.") for name in result["grads"])
    for name in ("blocks.1.fc1.weight", "blocks.1.norm.bias"):
        assert torch.equal(result["params"][name], initial[name])
    assert not torch.equal(result["params"]["blocks.0.fc1.weight"], initial["blocks.0.fc1.weight"])


def test_parallel_fsdp_recompute_survives_sharding(two_rank_results):
    assert two_rank_results[0]["recompute"]["checkpointed"] == ["blocks.0", "blocks.1"]


def test_parallel_clip_grad_norm_matches_torch_clip_grad_norm(two_rank_results):
    norms, params = _torch_clip_reference(0.05)
    assert norms[0] > 0.05, "the test must actually clip"
    for result in two_rank_results:
        ours = result["clip"]
        for norm, ref in zip(ours["norms"], norms, strict=True):
            assert_within(abs(norm - ref) / ref, 1e-5, "clipped grad norm")
        for name, param in params.items():
            _assert_close(ours["params"][name], param, f"clipped param {name}")


def test_parallel_clip_norm_only_leaves_grads(two_rank_results):
    norm_only = two_rank_results[0]["clip_norm_only"]
    plain = _reference()
    for name, grad in plain["grads"].items():
        _assert_close(norm_only["grads"][name], grad, f"grad {name}")
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in plain["grads"].values()])).item()
    assert_within(abs(norm_only["norms"][0] - expected) / expected, 1e-5, "grad norm")


def _hsdp_and_cp_layouts(rank, world_size):
    """HSDP (2 replicas × 2 shards) with the head on a different 1-D mesh (by hand, and as two `FSDPGroup`s),
    and FSDP over dp_shard × ulysses."""
    x, y = _batch()
    results = {}
    for name, plan in {
        "hsdp_mixed_meshes": MeshPlan(dp_replicate=2, dp_shard=2, ring=1, ulysses=1),
        "hsdp_mesh_groups": MeshPlan(dp_replicate=2, dp_shard=2, ring=1, ulysses=1),
        "shard_with_cp": MeshPlan(dp_replicate=1, dp_shard=2, ring=1, ulysses=2),
    }.items():
        dims = build_parallel_dims(plan, "cpu")
        rows = slice(dims.dp_rank * BATCH // dims.dp_size, (dims.dp_rank + 1) * BATCH // dims.dp_size)
        model = _model()
        if name == "hsdp_mesh_groups":
            groups = [FSDPGroup(("blocks.{*}",), dims.fsdp_mesh), FSDPGroup(("head",), dims.dp_cp_mesh)]
            apply_fsdp_groups(model, FSDPPlanConfig(), groups, dims.fsdp_mesh)
            results[name] = _train(model, x[rows], y[rows], 0.05, _mean_over_ranks)
            results[name]["meshes"] = sorted({p.device_mesh.ndim for p in model.parameters()})
            continue
        if name == "hsdp_mixed_meshes":
            fully_shard(model.head, mesh=dims.dp_cp_mesh)
        apply_fsdp(model, FSDPPlanConfig(apply_modules=["blocks.{*}"]), dims.fsdp_mesh, DEFAULT_MODULES)
        results[name] = _train(model, x[rows], y[rows], 0.05, _mean_over_ranks)
        results[name]["meshes"] = sorted({p.device_mesh.ndim for p in model.parameters()})
    return _to_bytes(results)


@pytest.mark.slow  # multi-process training runs: the full suite
def test_parallel_fsdp_hsdp_and_cp_layouts_on_four_ranks():
    reference = _reference(clip=0.05)
    for result in map(_from_bytes, run_distributed(_hsdp_and_cp_layouts, 4)):
        assert result["hsdp_mixed_meshes"]["meshes"] == result["hsdp_mesh_groups"]["meshes"] == [1, 2]
        _assert_same_training(result["hsdp_mixed_meshes"], reference)
        _assert_same_training(result["hsdp_mesh_groups"], reference)
        _assert_same_training(result["shard_with_cp"], reference)


def test_parallel_fsdp_pattern_errors_name_the_plan_key():
    model = _model()
    with pytest.raises(ConfigError, match=r"parallel\.fsdp_plan\.apply_modules\[1\]: 'blocks\.\{\*\}\.ffn'"):
        apply_fsdp(model, FSDPPlanConfig(apply_modules=["head", "blocks.{*}.ffn"]), None, DEFAULT_MODULES)
    with pytest.raises(ConfigError, match=r"parallel\.fsdp_plan\.ignored_modules\[0\]"):
        apply_fsdp(model, FSDPPlanConfig(ignored_modules=["embedding"]), None, DEFAULT_MODULES)


def test_parallel_fsdp_small_modules_share_groups(two_rank_results):
    """`min_group_params` 500: blocks 0 and 1 (296 parameters each) form one group, block 2 another, and the
    27-parameter head joins the root; 0 keeps a group per matched module; at the default (4 M) the whole
    ~1k-parameter model is the root's group."""
    grouped = two_rank_results[0]["grouped_prefetch_recompute"]["fsdp_modules"]
    assert grouped == ["blocks.0", "blocks.1", "blocks.2"]  # each module of a group is an FSDPModule
    assert two_rank_results[0]["plain"]["fsdp_modules"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert "head" not in grouped
    # defaults (4 M): the whole list of blocks is smaller than one group, so the root holds everything
    assert two_rank_results[0]["clip"]["fsdp_modules"] == []


def test_parallel_group_small_modules_rules():
    root, other = object(), object()
    sizes = {"embed": 10, "layers.0": 40, "layers.1": 40, "layers.2": 40, "layers.3": 40, "vis.0": 5, "vis.1": 5,
             "head": 200, "experts.0": 1}
    matched = [(name, root) for name in ("embed", "vis.0", "vis.1", "layers.0", "layers.1", "layers.2", "layers.3",
                                         "head")] + [("experts.0", other)]
    groups = group_small_modules(matched, sizes, 100, root)
    # the whole `vis` list (10 parameters) joins the root; `layers` needs two groups, so it keeps both
    assert [names for names, _ in groups] == [
        ["layers.0", "layers.1", "layers.2"], ["layers.3"], ["head"], ["experts.0"],
    ]
    # a list on another mesh keeps its group however small
    assert [names for names, _ in group_small_modules([("vis.0", other), ("vis.1", other)], sizes, 100, root)] == [
        ["vis.0", "vis.1"],
    ]
    # the whole model smaller than min_params: everything in the root's group
    assert group_small_modules([(name, root) for name, _ in matched[:-1]], sizes, 10_000, root) == []
    assert groups[-1][1] is other  # a small module on another mesh keeps its own group
    assert [names for names, _ in group_small_modules(matched, sizes, 0, root)] == [[name] for name, _ in matched]
    # lists on different meshes never share a group
    mixed = [("layers.0", root), ("layers.1", other)]
    assert [names for names, _ in group_small_modules(mixed, {"layers.0": 1, "layers.1": 1}, 100, root)] == [
        ["layers.0"], ["layers.1"],
    ]
