"""Attention backends, selected by `model.attn_implementation` and the device.

Legend for shape suffixes: B batch, S query length, L key/value length,
H query heads, K key/value heads, D head dim, T tokens of a flattened
(packed) batch.

| `attn_implementation` | cpu | cuda | npu |
| --- | --- | --- | --- |
| `sdpa` | `mmfsdp_sdpa` | `mmfsdp_sdpa` | `mmfsdp_sdpa` |
| `eager` | `mmfsdp_eager` | `mmfsdp_eager` | `mmfsdp_eager` |
| `flash_attention_2` | - | HF `flash_attention_2` (needs `flash-attn`) | `mmfsdp_npu_fusion` (`torch_npu.npu_fusion_attention`) |

Each backend is an attention function registered in transformers'
`AttentionInterface` (and, for the dense ones, a mask function in
`AttentionMaskInterface`) under the name in the table, so the HF modules call
it in place of their own; the model does the maths, we only choose the kernel.

Packed inputs: the HF-style varlen keywords `cu_seq_lens_q/k` (cumulative
sequence starts over the flattened `B·S` tokens, leading 0 included) and
`max_length_q/k` flow from the model's forward to every attention call.
- `sdpa` runs each packed sequence on its own (sequences of one length in one
  call), causal for the decoder and full for the vision tower, so no `T × T`
  mask exists; `eager` (the reference) and cross-attention-shaped inputs use a
  block-diagonal mask (`varlen_block_mask`); tokens after the last boundary
  form one more block either way;
- flash-attn takes them as they are;
- the NPU kernel takes cumulative *end* positions in the `TND` layout
  (`npu_layout` converts, checks and picks the dense `BSND` layout when there
  is one sequence or all lengths are equal).
Without them the backend uses the mask transformers built (padding, causal).
The NPU backend reads no padding mask: pad on the right (or pack).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from mmfsdp.config import ConfigError
from mmfsdp.model.batch_plan import BATCH_PLAN_KEY, segments_of
from mmfsdp.model.config import ATTENTION_BACKEND_NAMES

__all__ = [
    "AttentionBackend",
    "attention_backend_names",
    "resolve_attention_backend",
    "varlen_block_mask",
    "NpuLayout",
    "npu_layout",
    "VARLEN_KEYS",
]

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_NPU_CAUSAL_MASK_SIZE = 2048  # the compressed mask size npu_fusion_attention's sparse modes 2-4 expect


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """One (attn_implementation, device type) choice and the HF attention name that implements it."""

    name: str
    device_type: str
    hf_name: str
    requires: str | None = None
    """Python module that must be importable, if any."""

    def available(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


# -- dense backends ---------------------------------------------------------------------------


def _segment_ids(cu_seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Index of the sequence each of `num_tokens` flattened tokens belongs to; tokens past the end form one more."""
    ends = cu_seq_lens[1:].to(torch.int64).contiguous()
    positions = torch.arange(num_tokens, device=cu_seq_lens.device)
    return torch.searchsorted(ends, positions, right=True)


def varlen_block_mask(
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    batch_size: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
) -> torch.Tensor:
    """Boolean `[B, 1, S, L]` mask (True = attend) allowing attention only within a packed sequence.

    The cumulative lengths index the flattened `B·S` query and `B·L` key tokens;
    rows never attend to other rows. With `causal`, query `i` also sees only keys `j <= i`.
    """
    seg_q_BS = _segment_ids(cu_seq_lens_q, batch_size * q_len).view(batch_size, q_len)
    seg_k_BL = _segment_ids(cu_seq_lens_k, batch_size * kv_len).view(batch_size, kv_len)
    mask_BSL = seg_q_BS[:, :, None] == seg_k_BL[:, None, :]
    if causal:
        mask_BSL &= torch.ones(q_len, kv_len, dtype=torch.bool, device=mask_BSL.device).tril()
    return mask_BSL[:, None]


def _pop_varlen(kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    kwargs.pop(BATCH_PLAN_KEY, None)
    cu_q = kwargs.pop("cu_seq_lens_q", None)
    cu_k = kwargs.pop("cu_seq_lens_k", None)
    kwargs.pop("max_length_q", None)
    kwargs.pop("max_length_k", None)
    return cu_q, (cu_q if cu_k is None else cu_k)


def _is_causal(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    explicit = kwargs.pop("is_causal", None)
    return bool(getattr(module, "is_causal", True) if explicit is None else explicit)


def _repeat_kv(x_BKLD: torch.Tensor, groups: int) -> torch.Tensor:
    return x_BKLD if groups == 1 else x_BKLD.repeat_interleave(groups, dim=1)


def _split_segments(x_BHSD: torch.Tensor, segments: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each packed sequence of `x` as an `[H, L, D]` view, in order: the rows unbound, each row split at its
    sequence boundaries (their backward is one `stack` and one `cat` per row, not a full-size zero tensor per
    sequence as indexing or slicing would give)."""
    seq_len = x_BHSD.shape[2]
    rows = x_BHSD.unbind(0)
    sizes: list[list[int]] = [[] for _ in rows]
    for start, end in segments:
        sizes[start // seq_len].append(end - start)
    return [piece for row, row_sizes in zip(rows, sizes) for piece in row.split(row_sizes, dim=1)]


def _sdpa_per_sequence(module, query_BHSD, key_BKSD, value_BKSD, segments, causal: bool, **kwargs):
    """SDPA on each packed sequence alone, sequences of one length batched together; `[B, S, H, D]` out.

    The same maths as the block-diagonal mask without its `T × T` mask (and, where SDPA falls back to the
    math kernel, score matrix): memory grows with the longest sequence, not with the whole packed batch. The
    sequences are views of the inputs (no gather), and the outputs are put back in order by one `cat`."""
    batch_size, num_heads, seq_len, _ = query_BHSD.shape
    q_pieces, k_pieces, v_pieces = (_split_segments(x, segments) for x in (query_BHSD, key_BKSD, value_BKSD))
    by_length: dict[int, list[int]] = {}
    for i, (start, end) in enumerate(segments):
        by_length.setdefault(end - start, []).append(i)
    outputs: list[torch.Tensor | None] = [None] * len(segments)
    for members in by_length.values():
        def batch(pieces):
            return pieces[members[0]][None] if len(members) == 1 else torch.stack([pieces[i] for i in members])

        out_NLHD, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, batch(q_pieces), batch(k_pieces), batch(v_pieces), None, is_causal=causal, **kwargs,
        )
        for i, out_LHD in zip(members, out_NLHD.unbind(0)):
            outputs[i] = out_LHD
    out_THD = torch.cat(outputs)
    return out_THD.view(batch_size, seq_len, num_heads, -1), None


@torch.compiler.disable
def _sdpa_varlen(module, query, key, value, cu_q, cu_k, **kwargs):
    """Packed sdpa, eager under `torch.compile` (`features.compile`) for the calls the packed-sdpa op does not take
    (`_compiled_packed_sdpa`): it loops over the sequence lengths (host numbers: the micro-batch plan's
    `attention_segments`), which a traced graph would specialise on; left out, a compiled block runs one graph
    before and one after it whatever the lengths."""
    causal = _is_causal(module, kwargs)
    batch_size, _, q_len, _ = query.shape
    same = q_len == key.shape[2] and (cu_k is cu_q or torch.equal(cu_q, cu_k))
    segments = segments_of(cu_q, batch_size, q_len) if same else None  # a plan's: registered, no read
    if segments is not None:
        return _sdpa_per_sequence(module, query, key, value, segments, causal, **kwargs)
    attention_mask = varlen_block_mask(cu_q, cu_k, batch_size, q_len, key.shape[2], causal=causal)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


class _Heads:
    """What transformers' sdpa function reads of the attention module, inside the packed-sdpa op."""

    __slots__ = ("num_key_value_groups", "is_causal")

    def __init__(self, groups: int, causal: bool):
        self.num_key_value_groups, self.is_causal = groups, causal


def _packed_sdpa_eager(query, key, value, cu_seq_lens, causal: bool, scaling: float | None, groups: int):
    """Packed self-attention of `[B, H, S, D]` inputs by `cu_seq_lens` (the sdpa backend's maths), `[B, S, H, D]`
    out; the segments come from the micro-batch's plan (registered with its `cu_seq_lens`) or one host read."""
    module = _Heads(groups, causal)
    batch_size, _, q_len, _ = query.shape
    segments = segments_of(cu_seq_lens, batch_size, q_len)
    if segments is not None:
        return _sdpa_per_sequence(module, query, key, value, segments, causal, scaling=scaling)[0]
    mask = varlen_block_mask(cu_seq_lens, cu_seq_lens, batch_size, q_len, q_len, causal=causal)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=scaling)[0]


@torch.library.custom_op("mmfsdp::packed_sdpa", mutates_args=())
def _packed_sdpa_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_lens: torch.Tensor,
                    causal: bool, scaling: float | None, groups: int) -> torch.Tensor:
    return _packed_sdpa_eager(query, key, value, cu_seq_lens, causal, scaling, groups)


@_packed_sdpa_op.register_fake
def _(query, key, value, cu_seq_lens, causal, scaling, groups):
    batch_size, num_heads, q_len, _ = query.shape
    return query.new_empty(batch_size, q_len, num_heads, value.shape[-1])


@torch.library.custom_op("mmfsdp::packed_sdpa_backward", mutates_args=())
def _packed_sdpa_backward_op(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             cu_seq_lens: torch.Tensor, causal: bool, scaling: float | None,
                             groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # torch.func's vjp, not torch.autograd: a custom op's body runs below the autograd dispatch key
    _, vjp = torch.func.vjp(lambda q, k, v: _packed_sdpa_eager(q, k, v, cu_seq_lens, causal, scaling, groups),
                            query, key, value)
    return tuple(g.contiguous() for g in vjp(grad))


@_packed_sdpa_backward_op.register_fake
def _(grad, query, key, value, cu_seq_lens, causal, scaling, groups):
    return tuple(x.new_empty(x.shape) for x in (query, key, value))


def _packed_sdpa_setup(ctx, inputs, output) -> None:
    query, key, value, cu_seq_lens, causal, scaling, groups = inputs
    ctx.save_for_backward(query, key, value, cu_seq_lens)
    ctx.args = (causal, scaling, groups)


def _packed_sdpa_grad(ctx, grad):
    query, key, value, cu_seq_lens = ctx.saved_tensors
    grads = torch.ops.mmfsdp.packed_sdpa_backward(grad, query, key, value, cu_seq_lens, *ctx.args)
    return (*grads, None, None, None, None)


_packed_sdpa_op.register_autograd(_packed_sdpa_grad, setup_context=_packed_sdpa_setup)


def _compiled_packed_sdpa(module, query, key, value, cu_q, cu_k, kwargs):
    """Under `torch.compile`: packed self-attention as one opaque op (`mmfsdp::packed_sdpa`) inside the block's
    graph, so the block compiles as one graph for every set of lengths (its lengths are read inside the op, from
    the plan); None where the call needs more than the op takes (the eager `_sdpa_varlen` then runs, a graph break).
    Its backward recomputes the attention of the saved inputs (one more attention forward per compiled layer)."""
    dropout = kwargs.get("dropout", 0.0)
    if (cu_k is not cu_q or query.shape[2] != key.shape[2] or not isinstance(dropout, (int, float)) or dropout
            or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "sliding_window"))):
        return None
    causal = _is_causal(module, kwargs)
    scaling = kwargs.get("scaling")
    out = torch.ops.mmfsdp.packed_sdpa(query, key, value, cu_q, causal, None if scaling is None else float(scaling),
                                       int(getattr(module, "num_key_value_groups", 1)))
    return out, None


def sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention; packed self-attention runs per sequence, other packed inputs get a
    block-diagonal mask."""
    cu_q, cu_k = _pop_varlen(kwargs)
    if cu_q is not None:
        if torch.compiler.is_compiling():
            out = _compiled_packed_sdpa(module, query, key, value, cu_q, cu_k, kwargs)
            if out is not None:
                return out
        return _sdpa_varlen(module, query, key, value, cu_q, cu_k, **kwargs)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def eager_attention(module, query_BHSD, key_BKLD, value_BKLD, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Softmax(QKᵀ·scale + mask)·V in plain torch ops (softmax in fp32), as transformers' eager attention."""
    cu_q, cu_k = _pop_varlen(kwargs)
    causal = _is_causal(module, kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key_BHLD = _repeat_kv(key_BKLD, groups)
    value_BHLD = _repeat_kv(value_BKLD, groups)
    batch_size, _, q_len, head_dim = query_BHSD.shape
    kv_len = key_BHLD.shape[2]
    scale = head_dim**-0.5 if scaling is None else scaling
    scores_BHSL = torch.matmul(query_BHSD, key_BHLD.transpose(2, 3)) * scale
    if cu_q is not None:
        attention_mask = varlen_block_mask(cu_q, cu_k, batch_size, q_len, kv_len, causal=causal)
    elif attention_mask is None and causal and q_len > 1:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query_BHSD.device).tril()
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores_BHSL = scores_BHSL.masked_fill(~attention_mask, torch.finfo(scores_BHSL.dtype).min)
        else:
            scores_BHSL = scores_BHSL + attention_mask[..., :kv_len]
    probs_BHSL = F.softmax(scores_BHSL, dim=-1, dtype=torch.float32).to(query_BHSD.dtype)
    probs_BHSL = F.dropout(probs_BHSL, p=dropout, training=module.training)
    out_BHSD = torch.matmul(probs_BHSL, value_BHLD)
    return out_BHSD.transpose(1, 2).contiguous(), probs_BHSL


# -- Ascend NPU -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NpuLayout:
    """How to hand packed sequences to `npu_fusion_attention`."""

    input_layout: Literal["TND", "BSND"]
    actual_seq_qlen: tuple[int, ...] | None
    """TND: cumulative end position of every query sequence (no leading 0)."""
    actual_seq_kvlen: tuple[int, ...] | None
    """TND: cumulative end position of every key/value sequence."""
    num_sequences: int
    """BSND: the batch of the dense layout (sequences are all one length)."""


def _sequence_lengths(cu_seq_lens: torch.Tensor | Sequence[int], num_tokens: int, name: str) -> list[int]:
    starts = [int(v) for v in (cu_seq_lens.tolist() if torch.is_tensor(cu_seq_lens) else cu_seq_lens)]
    if len(starts) < 2 or starts[0] != 0:
        raise ValueError(f"{name} must start with 0 and hold at least one boundary (HF layout), got {starts}")
    if any(b < a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"{name} must not decrease, got {starts}")
    if starts[-1] > num_tokens:
        raise ValueError(f"{name} ends at {starts[-1]} but there are only {num_tokens} tokens")
    if starts[-1] < num_tokens:
        starts.append(num_tokens)  # the tail (padding) is one more sequence
    return [b - a for a, b in zip(starts, starts[1:])]


def npu_layout(
    cu_seq_lens_q: torch.Tensor | Sequence[int],
    cu_seq_lens_k: torch.Tensor | Sequence[int],
    num_q_tokens: int,
    num_k_tokens: int,
) -> NpuLayout:
    """Convert HF `cu_seq_lens` (leading 0) to `npu_fusion_attention`'s layout and cumulative end positions.

    Query and key sequences must come in pairs (the same number of each, and no
    query sequence without keys); pairs with no query token are dropped. One
    sequence, or sequences all of one length, use the dense `BSND` layout with
    one batch row per sequence; otherwise `TND` with cumulative ends.
    """
    q_lens = _sequence_lengths(cu_seq_lens_q, num_q_tokens, "cu_seq_lens_q")
    k_lens = _sequence_lengths(cu_seq_lens_k, num_k_tokens, "cu_seq_lens_k")
    if len(q_lens) != len(k_lens):
        raise ValueError(f"query and key sequences do not pair up: {len(q_lens)} query lengths {q_lens} vs {len(k_lens)} key lengths {k_lens}")
    pairs = [(q, k) for q, k in zip(q_lens, k_lens) if q > 0]
    if any(k == 0 for _, k in pairs):
        raise ValueError(f"a query sequence has no keys: query lengths {q_lens}, key lengths {k_lens}")
    q_lens = [q for q, _ in pairs]
    k_lens = [k for _, k in pairs]
    if len(pairs) == 1 or (len(set(q_lens)) == 1 and len(set(k_lens)) == 1):
        return NpuLayout("BSND", None, None, len(pairs))
    q_ends, k_ends, q_total, k_total = [], [], 0, 0
    for q, k in pairs:
        q_total += q
        k_total += k
        q_ends.append(q_total)
        k_ends.append(k_total)
    return NpuLayout("TND", tuple(q_ends), tuple(k_ends), len(pairs))


def _npu_fusion_attention() -> Callable[..., Any]:
    import torch_npu  # only on Ascend machines

    return torch_npu.npu_fusion_attention


_npu_causal_masks: dict[torch.device, torch.Tensor] = {}


def _npu_causal_mask(device: torch.device) -> torch.Tensor:
    if device not in _npu_causal_masks:
        size = _NPU_CAUSAL_MASK_SIZE
        _npu_causal_masks[device] = torch.ones(size, size, dtype=torch.bool, device=device).triu(diagonal=1)
    return _npu_causal_masks[device]


def npu_fusion_attention(module, query_BHSD, key_BKLD, value_BKLD, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Ascend fused attention; packed inputs go in the TND layout (or BSND when all lengths are equal)."""
    plan = kwargs.get(BATCH_PLAN_KEY)
    cu_q, cu_k = _pop_varlen(kwargs)
    if plan is not None and cu_q is plan.cu_seq_lens and cu_k is cu_q:
        cu_q = cu_k = plan.bounds  # the host bounds: no read per layer
    causal = _is_causal(module, kwargs)
    op = _npu_fusion_attention()
    batch_size, num_heads, q_len, head_dim = query_BHSD.shape
    num_kv_heads, kv_len = key_BKLD.shape[1], key_BKLD.shape[2]
    q_BSHD = query_BHSD.transpose(1, 2)
    k_BLKD = key_BKLD.transpose(1, 2)
    v_BLKD = value_BKLD.transpose(1, 2)
    common = dict(
        scale=head_dim**-0.5 if scaling is None else scaling,
        keep_prob=1.0 - (dropout if module.training else 0.0),
        atten_mask=_npu_causal_mask(query_BHSD.device) if causal else None,
        sparse_mode=3 if causal else 0,  # 3: causal aligned to the bottom right, from the compressed mask
    )
    if cu_q is None:
        out = op(q_BSHD.contiguous(), k_BLKD.contiguous(), v_BLKD.contiguous(), num_heads, "BSND", **common)[0]
        return out.reshape(batch_size, q_len, num_heads, -1), None
    layout = npu_layout(cu_q, cu_k, batch_size * q_len, batch_size * kv_len)
    if layout.input_layout == "TND":
        out = op(
            q_BSHD.reshape(batch_size * q_len, num_heads, head_dim),
            k_BLKD.reshape(batch_size * kv_len, num_kv_heads, head_dim),
            v_BLKD.reshape(batch_size * kv_len, num_kv_heads, -1),
            num_heads,
            "TND",
            actual_seq_qlen=list(layout.actual_seq_qlen),
            actual_seq_kvlen=list(layout.actual_seq_kvlen),
            **common,
        )[0]
    else:
        n = layout.num_sequences
        out = op(
            q_BSHD.reshape(n, batch_size * q_len // n, num_heads, head_dim),
            k_BLKD.reshape(n, batch_size * kv_len // n, num_kv_heads, head_dim),
            v_BLKD.reshape(n, batch_size * kv_len // n, num_kv_heads, -1),
            num_heads,
            "BSND",
            **common,
        )[0]
    return out.reshape(batch_size, q_len, num_heads, -1), None


# -- registry ---------------------------------------------------------------------------------

AttentionInterface.register("mmfsdp_sdpa", sdpa_attention)
AttentionMaskInterface.register("mmfsdp_sdpa", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
AttentionInterface.register("mmfsdp_eager", eager_attention)
AttentionMaskInterface.register("mmfsdp_eager", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
AttentionInterface.register("mmfsdp_npu_fusion", npu_fusion_attention)

_BACKENDS: dict[str, dict[str, AttentionBackend]] = {
    "sdpa": {d: AttentionBackend("sdpa", d, "mmfsdp_sdpa") for d in ("cpu", "cuda", "npu")},
    "eager": {d: AttentionBackend("eager", d, "mmfsdp_eager") for d in ("cpu", "cuda", "npu")},
    "flash_attention_2": {
        "cuda": AttentionBackend("flash_attention_2", "cuda", "flash_attention_2", requires="flash_attn"),
        "npu": AttentionBackend("flash_attention_2", "npu", "mmfsdp_npu_fusion", requires="torch_npu"),
    },
}


assert tuple(_BACKENDS) == ATTENTION_BACKEND_NAMES, "config.ATTENTION_BACKEND_NAMES must list these backends"


def attention_backend_names() -> list[str]:
    return list(_BACKENDS)


def resolve_attention_backend(name: str, device_type: str) -> AttentionBackend:
    """The backend for `name` on `device_type`; a missing pairing or package is a `ConfigError`."""
    key = "model.attn_implementation"
    if name not in _BACKENDS:
        raise ConfigError(key, f"{name!r} is not a registered attention backend; registered: {', '.join(_BACKENDS)}")
    by_device = _BACKENDS[name]
    if device_type not in by_device:
        raise ConfigError(key, f"{name!r} has no {device_type} implementation (it runs on {', '.join(by_device)}); use sdpa")
    backend = by_device[device_type]
    if not backend.available():
        raise ConfigError(key, f"{name!r} on {device_type} needs the {backend.requires!r} package, which is not installed; install it or use sdpa")
    return backend

