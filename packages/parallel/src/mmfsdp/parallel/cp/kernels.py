"""Local attention kernels for ring attention: forward returns the log-sum-exp, backward takes it.

Ring attention computes attention block by block and merges the blocks with
their log-sum-exp (lse), then runs each block's backward with the *merged*
output and lse (the flash-attention identity: a block's gradient only needs the
final softmax normaliser). A kernel is therefore a pair of functions:

    forward(q_BSHD, k_BTKD, v_BTKD, *, causal, scale, cu_q, cu_k) -> (out_BSHD, lse_BHS)
    backward(dout_BSHD, q_BSHD, k_BTKD, v_BTKD, out_BSHD, lse_BHS, *, causal, scale, cu_q, cu_k)
        -> (dq_BSHD, dk_BTKD, dv_BTKD)

`lse_BHS` is fp32. `cu_q`/`cu_k` are `None` for dense rows, or matching tuples of
sample boundaries (B must be 1) for a packed batch: sample i's queries attend
only to sample i's keys. `causal` is only asked for square blocks (S = T per
sample). K may be smaller than H (GQA, H % K == 0).

Kernels are chosen by device type (`get_ring_kernel`) and can be replaced with
`register_ring_kernel`:
- cpu: `aten._scaled_dot_product_flash_attention_for_cpu` (+ its backward);
  packed batches run one call per sample.
- cuda: torch's built-in FlashAttention-2 (`aten._flash_attention_forward` /
  `_flash_attention_backward`), varlen-native. Not exercised by the CPU tests.
- npu: `torch_npu.npu_fusion_attention` / `npu_fusion_attention_grad` in TND
  layout, imported only when used. Not exercised by the CPU tests.

Shape legend: B batch, S query tokens, T key tokens, H query heads, K key/value
heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["AttentionKernel", "get_ring_kernel", "prepare_kernel_bounds", "register_ring_kernel"]

CuSeqLens = tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class AttentionKernel:
    """A local attention kernel that exposes its log-sum-exp (see the module docstring)."""

    name: str
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


_KERNELS: dict[str, AttentionKernel] = {}


def register_ring_kernel(device_type: str, kernel: AttentionKernel) -> None:
    """Use `kernel` for ring attention on tensors of `device_type` (replaces the default)."""
    _KERNELS[device_type] = kernel


def get_ring_kernel(device_type: str) -> AttentionKernel:
    """The kernel registered for `device_type`, else the built-in one.

    The built-in one is made on each call (a small record of two functions), not stored: this runs inside
    compiled decoder layers, and a table filled by their first call fails dynamo's guard on it at the second,
    which recompiled every layer once more (`tests/test_e2e_compile.py`'s Ulysses and Ring runs)."""
    kernel = _KERNELS.get(device_type)
    if kernel is not None:
        return kernel
    if device_type not in _DEFAULTS:
        raise NotImplementedError(
            f"no ring-attention kernel for device type {device_type!r}; register one with register_ring_kernel"
        )
    return _DEFAULTS[device_type]()


def _segments(cu: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(start, end - start) for start, end in zip(cu[:-1], cu[1:])]


def _repeat_kv(x_BTKD: torch.Tensor, num_heads: int) -> torch.Tensor:
    groups = num_heads // x_BTKD.size(2)
    return x_BTKD if groups == 1 else x_BTKD.repeat_interleave(groups, dim=2)


def _sum_kv_groups(dx_BTHD: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    B, T, H, D = dx_BTHD.shape
    if H == num_kv_heads:
        return dx_BTHD
    return dx_BTHD.view(B, T, num_kv_heads, H // num_kv_heads, D).sum(3)


# --- cpu ---------------------------------------------------------------------


def _cpu_dense_forward(q, k, v, causal, scale):
    H = q.size(2)
    out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), _repeat_kv(k, H).transpose(1, 2), _repeat_kv(v, H).transpose(1, 2), 0.0, causal, scale=scale
    )
    return out_BHSD.transpose(1, 2), lse_BHS.float()


def _cpu_dense_backward(dout, q, k, v, out, lse, causal, scale):
    H, K = q.size(2), k.size(2)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        _repeat_kv(k, H).transpose(1, 2),
        _repeat_kv(v, H).transpose(1, 2),
        out.transpose(1, 2),
        lse,
        0.0,
        causal,
        scale=scale,
    )
    return dq.transpose(1, 2), _sum_kv_groups(dk.transpose(1, 2), K), _sum_kv_groups(dv.transpose(1, 2), K)


def _cpu_forward(q, k, v, *, causal, scale, cu_q: CuSeqLens, cu_k: CuSeqLens):
    if cu_q is None:
        return _cpu_dense_forward(q, k, v, causal, scale)
    outs, lses = [], []
    for (qs, ql), (ks, kl) in zip(_segments(cu_q), _segments(cu_k)):
        out, lse = _cpu_dense_forward(q.narrow(1, qs, ql), k.narrow(1, ks, kl), v.narrow(1, ks, kl), causal, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 2)


def _cpu_backward(dout, q, k, v, out, lse, *, causal, scale, cu_q: CuSeqLens, cu_k: CuSeqLens):
    if cu_q is None:
        return _cpu_dense_backward(dout, q, k, v, out, lse, causal, scale)
    grads = []
    for (qs, ql), (ks, kl) in zip(_segments(cu_q), _segments(cu_k)):
        grads.append(
            _cpu_dense_backward(
                dout.narrow(1, qs, ql),
                q.narrow(1, qs, ql),
                k.narrow(1, ks, kl),
                v.narrow(1, ks, kl),
                out.narrow(1, qs, ql),
                lse.narrow(2, qs, ql),
                causal,
                scale,
            )
        )
    dq, dk, dv = zip(*grads)
    return torch.cat(dq, 1), torch.cat(dk, 1), torch.cat(dv, 1)


def _cpu_kernel() -> AttentionKernel:
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        raise NotImplementedError(
            f"torch {torch.__version__} has no aten._scaled_dot_product_flash_attention_for_cpu; "
            "register a CPU kernel that returns the log-sum-exp with register_ring_kernel"
        )
    return AttentionKernel("sdpa_flash_cpu", _cpu_forward, _cpu_backward)


# --- cuda (not exercised by the CPU tests) -------------------------------------


_DEVICE_BOUNDS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}
_DEVICE_BOUNDS_KEPT = 16


def prepare_kernel_bounds(bounds: Sequence[tuple[int, ...] | None], device: torch.device) -> None:
    """Put these sample boundaries on the device for the varlen kernels (CUDA's take int32 tensors), from pinned
    memory without waiting: done once per micro-batch before the layers, whose calls then find them (the last
    `_DEVICE_BOUNDS_KEPT` kept)."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    for cu in bounds:
        if cu is not None and (cu, device) not in _DEVICE_BOUNDS:
            while len(_DEVICE_BOUNDS) >= _DEVICE_BOUNDS_KEPT:
                del _DEVICE_BOUNDS[next(iter(_DEVICE_BOUNDS))]
            host = torch.tensor(cu, dtype=torch.int32).pin_memory()
            _DEVICE_BOUNDS[(cu, device)] = host.to(device, non_blocking=True)


def _cuda_cu(cu: tuple[int, ...], device) -> tuple[torch.Tensor, int]:
    lengths = [end - start for start, end in zip(cu[:-1], cu[1:])]
    prepare_kernel_bounds((cu,), device)  # found when the batch plan made them
    return _DEVICE_BOUNDS[(cu, torch.device(device))], max(lengths)


def _cuda_lse_to_BHS(lse: torch.Tensor, cu_q: CuSeqLens) -> torch.Tensor:
    if cu_q is None or (lse.dim() == 3 and lse.size(0) == 1):
        return lse.float()
    if lse.dim() == 2:  # unpadded varlen lse: (H, total)
        return lse.unsqueeze(0).float()
    # padded varlen lse: (num_samples, H, max_len)
    return torch.cat([lse[i, :, :length] for i, (_, length) in enumerate(_segments(cu_q))], 1).unsqueeze(0).float()


def _cuda_forward(q, k, v, *, causal, scale, cu_q: CuSeqLens, cu_k: CuSeqLens):
    if cu_q is None:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.size(1), k.size(1), 0.0, causal, False, scale=scale
        )
        return out, lse.float()
    cu_q_t, max_q = _cuda_cu(cu_q, q.device)
    cu_k_t, max_k = _cuda_cu(cu_k, q.device)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q[0], k[0], v[0], cu_q_t, cu_k_t, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out.unsqueeze(0), _cuda_lse_to_BHS(lse, cu_q)


def _cuda_backward(dout, q, k, v, out, lse, *, causal, scale, cu_q: CuSeqLens, cu_k: CuSeqLens):
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # dropout is 0, so the RNG state is never read
    unused = torch.empty(0, device=q.device)
    if cu_q is None:
        return torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), None, None, q.size(1), k.size(1),
            0.0, causal, rng, unused, scale=scale,
        )
    cu_q_t, max_q = _cuda_cu(cu_q, q.device)
    cu_k_t, max_k = _cuda_cu(cu_k, q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout[0].contiguous(), q[0], k[0], v[0], out[0].contiguous(), lse[0].contiguous(), cu_q_t, cu_k_t, max_q, max_k,
        0.0, causal, rng, unused, scale=scale,
    )
    return dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0)


def _cuda_kernel() -> AttentionKernel:
    return AttentionKernel("flash_attention_2", _cuda_forward, _cuda_backward)


# --- npu (not exercised by the CPU tests) --------------------------------------

_NPU_CAUSAL_SPARSE_MODE = 3  # causal with a compressed 2048×2048 upper-triangular mask


def _npu_args(q, k, causal, cu_q: CuSeqLens, cu_k: CuSeqLens) -> dict:
    B, S, H, _ = q.shape
    T = k.size(1)
    cu_q = cu_q or tuple(range(0, B * S + 1, S))
    cu_k = cu_k or tuple(range(0, B * T + 1, T))
    args = dict(actual_seq_qlen=list(cu_q[1:]), actual_seq_kvlen=list(cu_k[1:]))
    if causal:
        args.update(
            atten_mask=torch.ones(2048, 2048, dtype=torch.bool, device=q.device).triu(1),
            sparse_mode=_NPU_CAUSAL_SPARSE_MODE,
        )
    return args


def _tnd(x_BSHD: torch.Tensor) -> torch.Tensor:
    return x_BSHD.reshape(-1, x_BSHD.size(2), x_BSHD.size(3))


def _npu_forward(q, k, v, *, causal, scale, cu_q: CuSeqLens, cu_k: CuSeqLens):
    import torch_npu

    B, S, H, D = q.shape
    out, softmax_max, softmax_sum, *_ = torch_npu.npu_fusion_attention(
        _tnd(q), _tnd(k), _tnd(v), H, "TND", scale=scale, **_npu_args(q, k, causal, cu_q, cu_k)
    )
    lse_TH = softmax_max[..., 0].float() + softmax_sum[..., 0].float().log()
    return out.view(B, S, H, D), lse_TH.view(B, S, H).transpose(1, 2)


def _npu_backward(dout, q, k, v, out, lse, *, causal, scale, cu_q: CuSeqLens, cu_k: CuSeqLens):
    import torch_npu

    B, S, H, D = q.shape
    lse_TH8 = lse.transpose(1, 2).reshape(B * S, H, 1).expand(-1, -1, 8).contiguous()
    dq, dk, dv, *_ = torch_npu.npu_fusion_attention_grad(
        _tnd(q), _tnd(k), _tnd(v), _tnd(dout.contiguous()), H, "TND",
        softmax_max=lse_TH8, softmax_sum=torch.ones_like(lse_TH8), attention_in=_tnd(out.contiguous()),
        scale_value=scale, **_npu_args(q, k, causal, cu_q, cu_k),
    )
    return dq.view_as(q), dk.view_as(k), dv.view_as(v)


def _npu_kernel() -> AttentionKernel:
    return AttentionKernel("npu_fusion_attention", _npu_forward, _npu_backward)


_DEFAULTS: dict[str, Callable[[], AttentionKernel]] = {"cpu": _cpu_kernel, "cuda": _cuda_kernel, "npu": _npu_kernel}
