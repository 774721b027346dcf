"""Expert-parallel dispatch against a dense single-process reference (fp32).

The reference runs every token through all E experts with the full weights and
keeps `Σ_k weight · expert` of the chosen ones. The distributed cases run once on
4 gloo ranks, as EP 4 (the world) and EP 2 (ranks {0, 1} and {2, 3}); each rank
returns its output and gradients, and the test process compares them, the local
expert-weight gradients concatenated in EP-rank order against the full ones.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mmfsdp.config import ConfigError
from mmfsdp.parallel.expert_parallel import (
    check_expert_parallel_size,
    expert_major_order,
    expert_parallel_forward,
    experts_forward,
    grouped_mm_supported,
    local_experts,
    shard_experts,
    tokens_per_expert,
)
from mmfsdp.parallel.testing import assert_within, run_distributed

TOLERANCE = 1e-5
NUM_EXPERTS, HIDDEN, INTERMEDIATE = 8, 16, 8
WORLD_SIZE = 4
EP_SIZES = (2, 4)
IMPLEMENTATIONS = ("loop", "grouped") if grouped_mm_supported(torch.device("cpu"), torch.float32) else ("loop",)

# name -> (top_k, tokens per rank, routing): "random" over all experts, "skip5" never chooses
# expert 5, "last_rank" chooses only experts held by the last rank of the EP group.
CASES = {
    "uneven_tokens": (2, (3, 8, 13, 18), "random"),
    "expert_without_tokens": (3, (9, 4, 11, 6), "skip5"),
    "all_to_last_rank": (2, (7, 5, 6, 4), "last_rank"),
    "rank_without_tokens": (2, (6, 0, 9, 5), "random"),
}


class _Experts(nn.Module):
    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up_proj.clone())
        self.down_proj = nn.Parameter(down_proj.clone())
        self.act_fn = F.silu


def _weights(seed: int, num_experts: int = NUM_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
    down = torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5
    return gate_up, down


def _inputs(seed: int, num_tokens: int, top_k: int, allowed: list[int]):
    """hidden [T, H], distinct top-k expert ids from `allowed`, softmax routing weights, output cotangent."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    scores = torch.rand(num_tokens, len(allowed), generator=generator)
    idx = torch.tensor(allowed)[scores.argsort(dim=-1)[:, :top_k]]
    weight = torch.randn(num_tokens, top_k, generator=generator).softmax(-1)
    cotangent = torch.randn(num_tokens, HIDDEN, generator=generator)
    return hidden, idx, weight, cotangent


def _allowed(routing: str, ep_size: int) -> list[int]:
    if routing == "skip5":
        return [e for e in range(NUM_EXPERTS) if e != 5]
    if routing == "last_rank":
        per_rank = NUM_EXPERTS // ep_size
        return list(range(NUM_EXPERTS - per_rank, NUM_EXPERTS))
    return list(range(NUM_EXPERTS))


def _case_inputs(name: str, ep_size: int, rank: int):
    """This global rank's inputs; the expert weights are shared by its EP group (`_case_weights`)."""
    top_k, tokens, routing = CASES[name]
    seed = 1000 * list(CASES).index(name) + 10 * ep_size + rank
    return _inputs(seed, tokens[rank], top_k, _allowed(routing, ep_size))


def _case_weights(name: str, ep_size: int, group_index: int):
    return _weights(100 * list(CASES).index(name) + 10 * ep_size + group_index)


def _dense_reference(hidden, idx, weight, gate_up, down):
    out = torch.zeros_like(hidden)
    for expert in range(gate_up.shape[0]):
        gate, up = F.linear(hidden, gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert])
        coefficient = (weight * (idx == expert)).sum(-1, keepdim=True)
        out = out + coefficient * expert_out
    return out


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0 if actual.shape == expected.shape else float("inf")
    scale = expected.norm().item()
    error = (actual - expected).norm().item()
    return error / scale if scale > 0 else error


def _run_ours(hidden, idx, weight, cotangent, module, implementation):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = experts_forward(module, hidden, idx, weight, implementation=implementation)
    (out * cotangent).sum().backward()
    return {
        "out": out.detach(),
        "hidden": hidden.grad,
        "weight": weight.grad,
        "gate_up_proj": module.gate_up_proj.grad,
        "down_proj": module.down_proj.grad,
    }


def _distributed_cases(rank: int, world_size: int):
    groups = {4: (dist.group.WORLD, 0, rank)}
    for index, members in enumerate(([0, 1], [2, 3])):
        group = dist.new_group(members)
        if rank in members:
            groups[2] = (group, index, members.index(rank))
    results = {}
    for name in CASES:
        for ep_size in EP_SIZES:
            group, group_index, ep_rank = groups[ep_size]
            inputs = _case_inputs(name, ep_size, rank)
            for implementation in IMPLEMENTATIONS:
                module = shard_experts(_Experts(*_case_weights(name, ep_size, group_index)), group)
                assert (module.ep_rank, module.ep_size, module.num_experts) == (ep_rank, ep_size, NUM_EXPERTS)
                results[(name, ep_size, implementation)] = _run_ours(*inputs, module, implementation)

    meta = torch.device("meta")
    on_meta = shard_experts(_Experts(*(t.to(meta) for t in _weights(0))), dist.group.WORLD)
    results["meta_shapes"] = [
        list(on_meta.gate_up_proj.shape),
        list(on_meta.down_proj.shape),
        on_meta.down_proj.is_meta,
    ]
    try:
        shard_experts(_Experts(*_weights(0, num_experts=6)), dist.group.WORLD)
        results["indivisible"] = None
    except ConfigError as error:
        results["indivisible"] = error.key
    return results


@pytest.fixture(scope="module")
def distributed_results():
    return run_distributed(_distributed_cases, WORLD_SIZE, timeout=240)


def _reference_for_group(name: str, ep_size: int, group_index: int):
    """Per-member (out, hidden grad, weight grad) and the full expert-weight grads."""
    gate_up, down = (t.clone().requires_grad_() for t in _case_weights(name, ep_size, group_index))
    members, total = [], 0
    for rank in range(group_index * ep_size, (group_index + 1) * ep_size):
        hidden, idx, weight, cotangent = _case_inputs(name, ep_size, rank)
        hidden.requires_grad_()
        weight.requires_grad_()
        out = _dense_reference(hidden, idx, weight, gate_up, down)
        total = total + (out * cotangent).sum()
        members.append((out, hidden, weight))
    total.backward()
    per_member = [
        {"out": out.detach(), "hidden": hidden.grad, "weight": weight.grad} for out, hidden, weight in members
    ]
    return per_member, {"gate_up_proj": gate_up.grad, "down_proj": down.grad}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("ep_size", EP_SIZES)
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_dense_reference(distributed_results, name, ep_size, implementation):
    for group_index in range(WORLD_SIZE // ep_size):
        ranks = range(group_index * ep_size, (group_index + 1) * ep_size)
        per_member, full_grads = _reference_for_group(name, ep_size, group_index)
        ours = [distributed_results[rank][(name, ep_size, implementation)] for rank in ranks]
        for ep_rank, (mine, expected) in enumerate(zip(ours, per_member)):
            for what, value in expected.items():
                assert_within(_relative(mine[what], value), TOLERANCE, f"EP rank {ep_rank} of group {group_index}: {what}")
        for what, full in full_grads.items():
            gathered = torch.cat([mine[what] for mine in ours])
            assert_within(_relative(gathered, full), TOLERANCE, f"group {group_index}: gathered {what} gradient")


def test_expert_parallel_routing_cases_reach_the_edge_cases():
    counts = tokens_per_expert(_case_inputs("expert_without_tokens", 4, 0)[1], NUM_EXPERTS)
    assert counts[5] == 0
    idx = torch.cat([_case_inputs("all_to_last_rank", 4, rank)[1] for rank in range(4)])
    assert idx.min() >= NUM_EXPERTS - NUM_EXPERTS // 4


def test_shard_experts_on_meta_and_indivisible_expert_count(distributed_results):
    for rank_results in distributed_results:
        assert rank_results["meta_shapes"] == [[2, 2 * INTERMEDIATE, HIDDEN], [2, HIDDEN, INTERMEDIATE], True]
        assert rank_results["indivisible"] == "parallel.expert_parallel_size"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("num_tokens", [0, 1, 17])
def test_ep1_without_process_group_matches_dense_reference(implementation, num_tokens):
    gate_up, down = _weights(7)
    hidden, idx, weight, cotangent = _inputs(3, num_tokens, 2, [e for e in range(NUM_EXPERTS) if e != 2])
    module = shard_experts(_Experts(gate_up, down), None)
    assert (module.ep_size, module.ep_rank, module.ep_group) == (1, 0, None)
    ours = _run_ours(hidden, idx, weight, cotangent, module, implementation)

    gate_up, down = gate_up.requires_grad_(), down.requires_grad_()
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    expected = _dense_reference(hidden, idx, weight, gate_up, down)
    (expected * cotangent).sum().backward()
    for what, value in [
        ("out", expected.detach()),
        ("hidden", hidden.grad),
        ("weight", weight.grad),
        ("gate_up_proj", gate_up.grad),
        ("down_proj", down.grad),
    ]:
        assert_within(_relative(ours[what], value), TOLERANCE, what)
    assert ours["gate_up_proj"][2].abs().max() == 0  # the expert nobody chose


@pytest.mark.skipif(len(IMPLEMENTATIONS) < 2, reason="grouped GEMM is not available on this CPU build of torch")
def test_grouped_and_loop_local_experts_agree():
    gate_up, down = _weights(11)
    generator = torch.Generator().manual_seed(5)
    counts = [0, 7, 1, 0, 12, 3, 0, 9]
    x = torch.randn(sum(counts), HIDDEN, generator=generator)
    cotangent = torch.randn(sum(counts), HIDDEN, generator=generator)
    values = {}
    for implementation in IMPLEMENTATIONS:
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        out = local_experts(leaves[0], counts, leaves[1], leaves[2], F.silu, implementation)
        (out * cotangent).sum().backward()
        values[implementation] = [out.detach()] + [leaf.grad for leaf in leaves]
    for loop, grouped in zip(values["loop"], values["grouped"]):
        assert_within(_relative(grouped, loop), 1e-6, "grouped vs loop")
    grouped_mm_supported.cache_clear()
    with torch.no_grad():  # a first probe during evaluation still finds the kernel
        assert grouped_mm_supported(torch.device("cpu"), torch.float32)


def test_expert_major_order():
    # rows arrive as source 0 (expert 0: row 0; expert 1: rows 1, 2), source 1 (expert 0: rows 3, 4; expert 1: row 5)
    assert expert_major_order(torch.tensor([[1, 2], [2, 1]])).tolist() == [0, 3, 4, 1, 2, 5]
    assert expert_major_order(torch.zeros(3, 2, dtype=torch.int64)).tolist() == []
    counts = torch.randint(0, 4, (3, 5), generator=torch.Generator().manual_seed(0))
    blocks = torch.arange(int(counts.sum())).split(counts.flatten().tolist())
    expected = torch.cat([blocks[p * 5 + e] for e in range(5) for p in range(3)])
    assert torch.equal(expert_major_order(counts), expected)


def test_expert_parallel_size_errors():
    assert check_expert_parallel_size(128, 8) == 16
    with pytest.raises(ConfigError, match=r"parallel.expert_parallel_size: 3 does not divide the model's 8 experts"):
        check_expert_parallel_size(8, 3)
    with pytest.raises(ValueError, match="expert id 9"):
        tokens_per_expert(torch.tensor([[0, 9]]), NUM_EXPERTS)
    gate_up, down = _weights(0)
    with pytest.raises(ValueError, match="expected 8 local experts"):
        expert_parallel_forward(
            torch.zeros(1, HIDDEN),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.ones(1, 1),
            gate_up[:4],
            down[:4],
            F.silu,
            num_experts=NUM_EXPERTS,
        )


def test_matches_hf_qwen3_vl_moe_experts():
    moe = pytest.importorskip("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")
    config = moe.Qwen3VLMoeTextConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS, num_experts_per_tok=2
    )
    block = moe.Qwen3VLMoeTextSparseMoeBlock(config)
    torch.manual_seed(0)
    for param in block.parameters():
        nn.init.normal_(param, std=0.2)
    hidden = torch.randn(13, HIDDEN)
    _, weight, idx = block.gate(hidden)
    expected = block.experts(hidden, idx, weight)
    for implementation in IMPLEMENTATIONS:
        out = experts_forward(block.experts, hidden, idx, weight, implementation=implementation)
        assert_within(_relative(out, expected), 1e-6, f"{implementation} vs the HF experts")


def test_first_grouped_gemm_probe_inside_a_checkpointed_layer():
    """The one-time grouped-GEMM probe must not add saved tensors to a checkpointed forward (its
    recomputation finds the answer cached), nor be fooled by the caller's grad mode."""
    from mmfsdp.parallel.expert_parallel import grouped_mm_supported

    module = _Experts(*_weights(1))
    hidden, idx, weight, _ = _inputs(2, 10, 2, list(range(NUM_EXPERTS)))
    hidden.requires_grad_()
    grouped_mm_supported.cache_clear()
    with torch.no_grad():
        answer = grouped_mm_supported(hidden.device, hidden.dtype)
    grouped_mm_supported.cache_clear()
    out = checkpoint(experts_forward, module, hidden, idx, weight, use_reentrant=False)
    out.sum().backward()
    assert grouped_mm_supported(hidden.device, hidden.dtype) == answer
    assert hidden.grad is not None and module.gate_up_proj.grad is not None
