"""Expert parallel (EP): top-k token dispatch over an EP group, local expert compute, weighted combine.

`expert_parallel_forward` sorts the (token, slot) pairs by expert, exchanges counts and then rows with two
all-to-alls (autograd functions whose backward is the same exchange with the splits swapped), runs the
local experts (grouped GEMM where a one-time probe allows it, else a loop) and sends the results back to be
summed with their routing weights on the token's own rank. `shard_experts` / `apply_expert_parallel` keep
each rank's `E / ep` slice of HF's fused expert parameters as a DTensor `Shard(0)` over the `ep` mesh and
route the module's forward through `experts_forward`, which scales the local experts' gradient by `1 / ep`
so FSDP2's mean over `efsdp` gives the right sum; in a compiled layer `experts_forward` runs eagerly (its shapes
come from the routing). The steps, the mesh and the gradient argument: docs/parallelism.md, "Expert parallel:
dispatch", "Expert parallel: in the trainer" and "torch.compile with the parallelisms".

Legend: T tokens on this rank, K experts per token (top-k), S = T·K (token, slot) pairs, H hidden size,
I expert intermediate size, E experts in the model, L = E / ep experts held by one rank, P ranks in the EP
group, N rows this rank's experts receive. `gate_up_proj [E, 2I, H]` (gate rows first), `down_proj [E, H, I]`.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Callable, Iterable, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mmfsdp.config import ConfigError
from mmfsdp.parallel.dtensor_detach import dtensor_detach_without_propagation
from mmfsdp.parallel.patterns import match_module_names

__all__ = [
    "EXPERT_LAYOUTS",
    "EXPERT_PARAM_NAMES",
    "check_expert_parallel_size",
    "shard_experts",
    "apply_expert_parallel",
    "check_experts_module",
    "experts_forward",
    "expert_parallel_forward",
    "local_experts",
    "grouped_mm_supported",
    "expert_major_order",
    "tokens_per_expert",
]

EXPERT_PARAM_NAMES = ("gate_up_proj", "down_proj")
"""The fused expert parameters (dim 0 = expert) of HF's MoE expert modules."""

EXPERT_LAYOUTS = ("hf_fused",)
"""Expert weight layouts expert parallel can split, the names a family declares as `capabilities.expert_layout`:
`hf_fused` is HF's fused experts module (`EXPERT_PARAM_NAMES`, `gate_up_proj [E, 2I, H]` with the gate rows
first, `down_proj [E, H, I]`, and `act_fn`)."""

Implementation = Literal["auto", "grouped", "loop"]

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def check_expert_parallel_size(num_experts: int, ep_size: int, key: str = "parallel.expert_parallel_size") -> int:
    """Return the experts per EP rank; raise `ConfigError` at `key` unless `ep_size` divides `num_experts`."""
    if ep_size < 1:
        raise ConfigError(key, f"must be >= 1, got {ep_size}")
    if num_experts % ep_size:
        raise ConfigError(key, f"{ep_size} does not divide the model's {num_experts} experts")
    return num_experts // ep_size


def _group_of(ep: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise ValueError(f"the expert-parallel mesh must be 1-D, got {ep.ndim} dimensions {ep.mesh_dim_names}")
        return ep.get_group()
    return ep


def _group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def shard_experts(
    module: nn.Module,
    ep: DeviceMesh | dist.ProcessGroup | None,
    param_names: Iterable[str] = EXPERT_PARAM_NAMES,
) -> nn.Module:
    """Keep this EP rank's slice (dim 0) of `module`'s fused expert parameters; return `module`.

    Works on meta and real parameters (real ones are copied, so the full tensor is
    freed). With a `DeviceMesh` the slice is wrapped as a DTensor `Shard(0)` over
    it (global shape kept); with a process group it stays a plain tensor.
    Records `num_experts` (all experts of the model), `ep_rank`, `ep_size` and
    `ep_group` on the module, which `experts_forward` reads. `ep=None` records
    an EP size of 1 and keeps every expert.
    """
    if getattr(module, "ep_size", 1) > 1:
        raise ValueError(f"{type(module).__name__} is already sharded over EP {module.ep_size}")
    mesh = ep if isinstance(ep, DeviceMesh) else None
    group = _group_of(ep)
    ep_size = _group_size(group)
    ep_rank = 0 if group is None else dist.get_rank(group)
    params = {name: getattr(module, name) for name in param_names}
    if not params:
        raise ValueError("shard_experts needs at least one parameter name")
    num_experts = getattr(module, "num_experts", None)
    for name, param in params.items():
        if not isinstance(param, nn.Parameter) or param.dim() < 1:
            raise ValueError(f"{type(module).__name__}.{name} is not an expert parameter tensor")
        if type(param.data) is not torch.Tensor:
            raise ValueError(
                f"{type(module).__name__}.{name} is already sharded ({type(param.data).__name__}); "
                "call shard_experts before fully_shard"
            )
        num_experts = param.shape[0] if num_experts is None else num_experts
        if param.shape[0] != num_experts:
            raise ValueError(
                f"{type(module).__name__}.{name} has {param.shape[0]} experts on dim 0, expected {num_experts}"
            )
    num_local = check_expert_parallel_size(num_experts, ep_size)
    if ep_size > 1:
        start = ep_rank * num_local
        for name, param in params.items():
            local = param.detach()[start : start + num_local].clone()
            if mesh is not None:
                local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
            with dtensor_detach_without_propagation():  # nn.Parameter detaches its DTensor
                setattr(module, name, nn.Parameter(local, requires_grad=param.requires_grad))
    module.num_experts = num_experts
    module.ep_rank = ep_rank
    module.ep_size = ep_size
    module.ep_group = group
    return module


def tokens_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many (token, slot) pairs chose each expert. A scatter-add into `E` counters, not `bincount`,
    whose output size depends on the data (the largest id), which on an accelerator waits for the device. An id
    outside `[0, E)` fails the scatter (on an accelerator, as a device-side assert)."""
    index = topk_idx.reshape(-1).to(torch.int64)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    try:
        return counts_E.scatter_add_(0, index, torch.ones_like(index))
    except (RuntimeError, IndexError):
        raise ValueError(f"topk_idx holds expert id {int(index.max())}, but the model has {num_experts} experts") from None


def expert_major_order(counts_PL: torch.Tensor) -> torch.Tensor:
    """Row index that reorders rows laid out source-major (`[P, L]` blocks) into expert-major order.

    `counts_PL[p, l]` rows came from source `p` for local expert `l`; rows arrive as
    all of source 0 (expert 0, 1, …), then source 1, … `rows[index]` puts them as
    expert 0 (source 0, 1, …), expert 1, … keeping each block's internal order.
    """
    counts_PL = counts_PL.to(torch.int64)
    starts_PL = (counts_PL.flatten().cumsum(0) - counts_PL.flatten()).view_as(counts_PL)
    lengths = counts_PL.t().flatten()
    starts = starts_PL.t().flatten()
    offsets = lengths.cumsum(0) - lengths
    total = int(lengths.sum())
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(total)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group):
        ctx.splits = (input_splits, output_splits)
        ctx.group = group
        return _all_to_all(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, output_splits, input_splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
    return out


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype, compiled: bool = False) -> bool:
    """Whether grouped GEMM runs (forward and backward) and is right on `device` for `dtype`; probed once.
    `compiled`: whether it also does inside `torch.compile`, whose fake tensors run the op's meta kernel, which
    can refuse what the eager kernel runs (on torch 2.14 it takes bf16, and fp16 where cuBLASLt groups, only:
    fp32 runs eagerly on the CPU but does not trace).

    The probe runs on a helper thread: grad mode and saved-tensor hooks are per thread, so a first call
    under `no_grad` (an evaluation) cannot cache "unsupported", and a first call inside an activation-
    checkpointed layer does not add the probe's tensors to those the layer saves (its recomputation,
    which finds the answer cached, would save fewer)."""
    if _GROUPED_MM is None or device.type == "meta":
        return False
    if compiled and not _grouped_mm_traces(dtype):
        return False
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_probe_grouped_mm, device, dtype).result()


def _grouped_mm_traces(dtype: torch.dtype) -> bool:
    """Whether the meta kernel of grouped GEMM (what torch.compile traces with) takes `dtype`, forward and
    backward."""
    try:
        x = torch.empty(8, 16, device="meta", dtype=dtype, requires_grad=True)
        weight = torch.empty(3, 16, 16, device="meta", dtype=dtype, requires_grad=True)
        offsets = torch.empty(3, device="meta", dtype=torch.int32)
        out = _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)
        out.backward(torch.empty_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


@torch.compiler.assume_constant_result
def _grouped_mm_usable(device: torch.device, dtype: torch.dtype, compiled: bool) -> bool:
    """`grouped_mm_supported`, which torch.compile calls once while tracing and keeps as a constant (it does not
    trace the probe)."""
    return grouped_mm_supported(device, dtype, compiled)


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8, 16, generator=generator).to(device, dtype).requires_grad_()
        weight = torch.randn(3, 16, 16, generator=generator).to(device, dtype).requires_grad_()
        offsets = torch.tensor([3, 3, 8], dtype=torch.int32, device=device)
        out = _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)
        out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    with torch.no_grad():
        expected = torch.cat([F.linear(x[:3], weight[0]), F.linear(x[3:], weight[2])])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    right = torch.allclose(out.detach(), expected, rtol=tolerance, atol=tolerance)
    return bool(right and (weight.grad[1] == 0).all())


def _grouped_mm_fits(*tensors: torch.Tensor, compiling: bool = False) -> bool:
    """The grouped GEMM kernels want 16-byte aligned rows and data (a tensor being traced has no address: under
    `torch.compile` only the strides and the row size are checked)."""
    return all(
        t.stride(-1) == 1
        and (t.shape[-1] * t.element_size()) % 16 == 0
        and (compiling or t.data_ptr() % 16 == 0)
        for t in tensors
    )


def _gated(gate_up: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act_fn(gate) * up


def _local_experts_grouped(x_NH, counts_L, gate_up_proj, down_proj, act_fn):
    if not torch.is_tensor(counts_L):
        counts_L = torch.tensor(counts_L, device=x_NH.device)
    offsets = counts_L.cumsum(0).to(torch.int32)
    hidden_NI = _gated(_GROUPED_MM(x_NH, gate_up_proj.transpose(-2, -1), offs=offsets), act_fn)
    return _GROUPED_MM(hidden_NI, down_proj.transpose(-2, -1), offs=offsets)


def _local_experts_loop(x_NH, counts_L, gate_up_proj, down_proj, act_fn):
    outs = [
        F.linear(_gated(F.linear(x, gate_up), act_fn), down)
        for x, gate_up, down in zip(x_NH.split(counts_L), gate_up_proj.unbind(0), down_proj.unbind(0))
    ]
    return torch.cat(outs)


def local_experts(
    x_NH: torch.Tensor,
    counts_L: list[int] | torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    implementation: Implementation = "auto",
) -> torch.Tensor:
    """[N, H] in the weights' dtype: rows sorted by local expert (`counts_L[l]` rows for expert `l`) through their expert.

    `counts_L` on the device (a tensor) stays there on the grouped GEMM path (its offsets are a cumulative sum on the
    device): no host round trip; the loop reads it to the host (its splits are host sizes)."""
    if torch.is_tensor(counts_L):
        if counts_L.numel() != gate_up_proj.shape[0]:
            raise ValueError(f"{counts_L.numel()} counts for {gate_up_proj.shape[0]} experts")
    elif len(counts_L) != gate_up_proj.shape[0] or sum(counts_L) != x_NH.shape[0]:
        raise ValueError(
            f"{len(counts_L)} counts summing to {sum(counts_L)} for {gate_up_proj.shape[0]} experts "
            f"and {x_NH.shape[0]} rows"
        )
    x_NH = x_NH.to(gate_up_proj.dtype)
    compiling = torch.compiler.is_compiling()
    if implementation == "auto":
        grouped = _grouped_mm_usable(x_NH.device, x_NH.dtype, compiling) and _grouped_mm_fits(
            x_NH, gate_up_proj, down_proj, compiling=compiling
        )
        implementation = "grouped" if grouped else "loop"
    elif implementation == "grouped" and not _grouped_mm_usable(x_NH.device, x_NH.dtype, compiling):
        under = " under torch.compile" if compiling else ""
        raise RuntimeError(f"grouped GEMM is not available for {x_NH.dtype} on {x_NH.device}{under}")
    if implementation == "grouped":
        return _local_experts_grouped(x_NH, counts_L, gate_up_proj, down_proj, act_fn)
    if implementation == "loop":
        counts_L = counts_L.tolist() if torch.is_tensor(counts_L) else counts_L
        if sum(counts_L) != x_NH.shape[0]:
            raise ValueError(f"counts summing to {sum(counts_L)} for {x_NH.shape[0]} rows")
        return _local_experts_loop(x_NH, counts_L, gate_up_proj, down_proj, act_fn)
    raise ValueError(f"implementation must be 'auto', 'grouped' or 'loop', got {implementation!r}")


def expert_parallel_forward(
    hidden_TH: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weight_TK: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    implementation: Implementation = "auto",
    counts_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H]: `out[t] = Σ_k topk_weight[t, k] · expert_{topk_idx[t, k]}(hidden[t])` with experts spread over `group`.

    `topk_idx` holds global expert ids; `gate_up_proj` / `down_proj` hold this
    rank's `num_experts / ep` experts (`shard_experts`). Every rank of `group` must
    call this together (also with no tokens). See the module docstring for the flow. `counts_E`: the tokens per
    expert of `topk_idx` (`tokens_per_expert`) when the caller has them already.
    """
    num_tokens, top_k = topk_idx_TK.shape
    ep_size = _group_size(group)
    num_local = check_expert_parallel_size(num_experts, ep_size)
    if gate_up_proj.shape[0] != num_local or down_proj.shape[0] != num_local:
        raise ValueError(
            f"expected {num_local} local experts ({num_experts} over EP {ep_size}), got gate_up_proj "
            f"{tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)}"
        )
    if counts_E is None:
        counts_E = tokens_per_expert(topk_idx_TK, num_experts)
    _, order_S = torch.sort(topk_idx_TK.reshape(-1), stable=True)
    token_S = order_S // top_k
    x_SH = hidden_TH.index_select(0, token_S)  # backward: index_add (advanced indexing's index_put is slower)
    if ep_size == 1:
        y_SH = local_experts(x_SH, counts_E, gate_up_proj, down_proj, act_fn, implementation)
    else:
        counts_PL = torch.empty_like(counts_E)
        dist.all_to_all_single(counts_PL, counts_E, group=group)
        sent_PL, counts_PL = torch.stack([counts_E, counts_PL]).view(2, ep_size, num_local).cpu()  # one sync
        send_splits = sent_PL.sum(1).tolist()
        recv_splits = counts_PL.sum(1).tolist()
        x_NH = _AllToAll.apply(x_SH, recv_splits, send_splits, group)
        to_expert_N = expert_major_order(counts_PL).to(x_NH.device)
        y_NH = local_experts(
            x_NH[to_expert_N], counts_PL.sum(0).tolist(), gate_up_proj, down_proj, act_fn, implementation
        )
        y_NH = y_NH[torch.argsort(to_expert_N)]
        y_SH = _AllToAll.apply(y_NH, send_splits, recv_splits, group)
    # Back to (token, slot) order, then out[t] = Σ_k w[t, k] · y[t, k] as one batched [1, K] × [K, H] product:
    # cheaper, forward and backward, than a full-size weight product followed by a scatter-add.
    slot_S = torch.empty_like(order_S)
    slot_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    dtype = torch.promote_types(y_SH.dtype, topk_weight_TK.dtype)
    y_TKH = y_SH.to(dtype).index_select(0, slot_S).view(num_tokens, top_k, y_SH.shape[-1])
    out_TH = torch.bmm(topk_weight_TK.to(dtype).unsqueeze(1), y_TKH).squeeze(1)
    return out_TH.to(hidden_TH.dtype)


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float):
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a (gathered) expert parameter: the local tensor of an EP-sharded DTensor."""
    return param.to_local() if isinstance(param, DTensor) else param


def check_experts_module(name: str, module: nn.Module, key: str) -> None:
    """A `ConfigError` under `key` unless `module` looks like HF's fused experts (what expert parallel shards)."""
    missing = [attr for attr in (*EXPERT_PARAM_NAMES, "act_fn") if not hasattr(module, attr)]
    if missing:
        raise ConfigError(
            key,
            f"{name} ({type(module).__name__}) is not a fused experts module: it has no {', '.join(missing)}; "
            "point the patterns at the modules holding gate_up_proj [E, 2I, H] and down_proj [E, H, I]",
        )


def apply_expert_parallel(
    model: nn.Module,
    patterns: Iterable[str],
    ep_mesh: DeviceMesh | None,
    *,
    key: str = "parallel.ep_plan.apply_modules",
) -> list[str]:
    """Shard the experts modules matched by `patterns` over `ep_mesh` (`shard_experts`) and route their forward
    through `experts_forward`; return the module names. `ep_mesh=None` is EP 1: nothing is sharded, the forward
    is still ours. Call it on the unsharded model (meta or CPU), before activation checkpointing and FSDP2; the
    installed forward scales the experts' gradients by 1 / ep for FSDP2's mean (module docstring).

    A matched module must look like HF's fused experts (`gate_up_proj`, `down_proj`, `act_fn`, called as
    `(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])`); anything else is a `ConfigError` under `key`.
    """
    names = match_module_names(model, list(patterns), key=key)
    for name in names:
        module = model.get_submodule(name)
        check_experts_module(name, module, key)
        sharded = ep_mesh is not None and ep_mesh.size() > 1
        shard_experts(module, ep_mesh if sharded else None)
        module.forward = functools.partial(experts_forward, module, grad_scale=1.0 / ep_mesh.size() if sharded else 1.0)
    return names


@torch.compiler.disable
def experts_forward(
    module: nn.Module,
    hidden_TH: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weight_TK: torch.Tensor,
    *,
    implementation: Implementation = "auto",
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """`expert_parallel_forward` for an HF-style experts module (`gate_up_proj`, `down_proj`, `act_fn`).

    The module's EP group and expert count come from `shard_experts`; an
    unsharded module runs with EP 1. `grad_scale` multiplies the gradient of the
    local expert weights (`apply_expert_parallel`: 1 / ep under FSDP2, see the
    module docstring).

    Under `torch.compile` (a compiled decoder layer) it runs eagerly, a graph break: the rows each expert gets,
    the all-to-all splits and so every shape past the router come from the routing, and a traced dispatch would
    specialise on those counts and recompile as they change, step after step.
    """
    num_experts = getattr(module, "num_experts", module.gate_up_proj.shape[0])
    counts_E = tokens_per_expert(topk_idx_TK.detach(), num_experts)
    gate_up_proj, down_proj = _local(module.gate_up_proj), _local(module.down_proj)
    if grad_scale != 1.0:
        gate_up_proj, down_proj = _ScaleGrad.apply(gate_up_proj, grad_scale), _ScaleGrad.apply(down_proj, grad_scale)
    return expert_parallel_forward(
        hidden_TH,
        topk_idx_TK,
        topk_weight_TK,
        gate_up_proj,
        down_proj,
        module.act_fn,
        num_experts=num_experts,
        group=getattr(module, "ep_group", None),
        implementation=implementation,
        counts_E=counts_E,
    )
