"""Context parallel (Ulysses / Ring / Hybrid) in the training forward (`mmfsdp.model.training_forward`).

`model.enable_context_parallel(parallel_dims)` (after FSDP) wires the
algorithms of `mmfsdp.parallel.cp` into the decoder. One training forward
(`model(..., shift_labels=, loss_weights=, [cu_seq_lens=])`) then runs, on
every rank of a CP group, which all receive the same full batch:

1. `plan_batch` builds one `CPLayout` for the batch: `(0, S)` per row for an
   unpacked batch (any batch size), or the packed samples of `cu_seq_lens` —
   a packed batch is treated as one row of `B·S` tokens (packed samples never
   cross rows, so this is exact). The model's `shift_labels` and
   `loss_weights`, computed on the full sequence, are split with it; so are
   positions the family computes on the full sequence (M-RoPE).
2. The HF forward runs unchanged up to the decoder: token embeddings, the
   vision tower and projector over all of the sample's images, and the merge
   of image features into the embeddings — replicated on every CP rank, except
   that with vision data parallel each rank encodes a share of the images and
   the features are all-gathered before the merge (`mmfsdp.model.vision_dp`).
3. The training forward's pre-hook on the decoder (the family's
   `decoder_name`, e.g. `model.language_model`) sees the decoder's full keyword
   arguments and calls `split_decoder_inputs`: the family's
   `split_decoder_kwargs(kwargs, batch)` cuts them to this rank's tokens
   (the default, `split_sequence_kwargs`, completes `position_ids` with `arange`
   when none were given and splits every `[B, S, ...]` tensor along S; a family
   with other layouts — Qwen3-VL's `[3, B, S]` positions and per-visual-token
   deepstack features — declares its own). The decoder layers get a
   `CPContext` (layout and groups) as a keyword argument, and a 4-D placeholder
   mask: HF returns an already-4-D mask as it is, so no `[S_local, S_local]`
   mask is built; the CP attention takes the causal and per-sample structure
   from the layout. Rotary embeddings are computed from the *split* position
   ids, so every token keeps its global position.
4. Every decoder attention calls the attention function registered as
   `mmfsdp_cp_<backend>`, which, given a `CPContext`, runs
   `context_parallel_attention` on the shard; without one (evaluation,
   generation, any non-CP forward of the same model) it is the original
   backend, with the original mask function.
5. `lm_head` (plain or chunk loss) computes the loss of the local shard:
   `Σ_t w_t · CE_t` over this rank's tokens.

Loss and gradients: the returned loss is the local shard's sum, not summed over
the CP group. The trainer backpropagates `loss × world_size` on every rank and
sums the reported loss over all ranks; FSDP2 averages gradients over
`dp_shard_cp` (× replicas), i.e. over all ranks, so every parameter receives
`Σ_r ∂l_r/∂θ`, the gradient of the globally normalised loss. The gradients a
rank's tokens cause elsewhere (its K/V feeding other ranks' queries, its image
features feeding other ranks' tokens) flow back through the Ulysses all-to-all,
the ring backward and the vision forward (replicated, or the vision-DP gather's
backward). `cp_loss_reduce` would
only add the CP sum to the *reported* loss, which the trainer's all-rank sum
already contains, so it is not applied here.

Under activation checkpointing the recomputed decoder layer receives the same
`CPContext` keyword and repeats its communication in the same order; the
vision tower never enters Ulysses or Ring (its attention backend is untouched).
Padding must be on the right (the collator's): CP attention is causal over
each row or packed sample, so right padding only changes padding positions,
which carry no loss.

Shape legend: B batch, S tokens (local: S/cp), H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from mmfsdp.model.attention import VARLEN_KEYS
from mmfsdp.model.batch_plan import BATCH_PLAN_KEY
from mmfsdp.parallel.cp import CPLayout, context_parallel_attention, split_for_cp, to_device_async
from mmfsdp.parallel.cp.gather import all_gather_with_grad

__all__ = [
    "CP_CONTEXT_KEY",
    "CPContext",
    "CPBatch",
    "ContextParallel",
    "check_right_padding",
    "cp_attention_name",
    "split_sequence_kwargs",
]

CP_CONTEXT_KEY = "mmfsdp_cp_context"
"""The keyword that carries the `CPContext` from the decoder's entry to every attention call."""
_PREFIX = "mmfsdp_cp_"


class CPContext:
    """Layout and groups of one CP forward; a plain object so FSDP2's input casting leaves it alone."""

    __slots__ = ("layout", "ring_group", "ulysses_group")

    def __init__(self, layout: CPLayout, ring_group: dist.ProcessGroup | None, ulysses_group: dist.ProcessGroup | None):
        self.layout = layout
        self.ring_group = ring_group
        self.ulysses_group = ulysses_group


@dataclass(frozen=True, slots=True)
class CPBatch:
    """How one batch is split: its layout, whether its rows are flattened into one (packed), and this rank's token
    indices on the batch's device (made once per batch; None: `split` copies the layout's there each time)."""

    layout: CPLayout
    flatten: bool
    index: torch.Tensor | None = None

    def split(self, tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a tensor whose dims `seq_dim - 1, seq_dim` are `B, S` (`[B, S, ...]` by
        default, `[3, B, S]` with `seq_dim=2`); the two become `1, B·S/cp` when flattened."""
        if self.flatten:
            shape = tensor.shape
            tensor = tensor.reshape(*shape[: seq_dim - 1], 1, shape[seq_dim - 1] * shape[seq_dim], *shape[seq_dim + 1 :])
        index = self.index if self.index is not None and self.index.device == tensor.device else None
        return split_for_cp(tensor, self.layout, dim=seq_dim, index=index)

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup, seq_dim: int = 1) -> torch.Tensor:
        """The inverse of `split` over the CP group, with autograd: every rank's `local` (this batch's split of a
        `[..., B, S, ...]` tensor) all-gathered, in the full sequence's order (`[..., 1, B·S, ...]` when
        flattened). Backward sums the gradients of the whole tensor over the group and gives each rank its own
        tokens' (`all_gather_with_grad`): a consumer that computes the same value from it on every CP rank scales
        it by `1 / cp_size`."""
        parts = all_gather_with_grad(local, group)
        layout = self.layout
        order = torch.cat([layout.for_cp_rank(r).token_indices() for r in range(layout.cp_size)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), dtype=order.dtype)
        stacked = torch.cat(parts.unbind(0), dim=seq_dim)
        return stacked.index_select(seq_dim, to_device_async(inverse, stacked.device))


def _cp_attention(original: str):
    def attention(module, query_BHSD, key_BKSD, value_BKSD, attention_mask, *args, **kwargs):
        context = kwargs.pop(CP_CONTEXT_KEY, None)
        if context is None:
            return ALL_ATTENTION_FUNCTIONS[original](module, query_BHSD, key_BKSD, value_BKSD, attention_mask, *args, **kwargs)
        plan = kwargs.pop(BATCH_PLAN_KEY, None)
        if kwargs.get("dropout") or kwargs.get("sliding_window") is not None:
            raise NotImplementedError("context parallel attention supports neither attention dropout nor a sliding window")
        halves = None if plan is None else plan.ring_halves
        attend = _ring_attention_eager if context.layout.ring_size > 1 else _context_parallel_attention
        return attend(query_BHSD, key_BKSD, value_BKSD, context, kwargs.get("scaling"), halves), None

    return attention


def _context_parallel_attention(query_BHSD, key_BKSD, value_BKSD, context: CPContext, scale, halves):
    """`context_parallel_attention` of HF's attention layout."""
    return context_parallel_attention(
        query_BHSD.transpose(1, 2), key_BKSD.transpose(1, 2), value_BKSD.transpose(1, 2), context.layout,
        ring_group=context.ring_group, ulysses_group=context.ulysses_group, causal=True, scale=scale, halves=halves,
    )


_ring_attention_eager = torch.compiler.disable(_context_parallel_attention)
"""With a ring (Ring or Hybrid), the attention runs eagerly under `torch.compile` (`features.compile`): one graph
break per layer. Traced, the ring's steps (point-to-point exchanges, per-step index selects, the merge) broke a layer
into ~6 graphs (the tiny Mistral3 at Ring 2: 15 graphs, 4 now). Ulysses alone stays traced (its all-to-alls are
traced collectives: 3 graphs in the compiled Ulysses 2 run, 6 when it too ran eagerly)."""


def cp_attention_name(original: str) -> str:
    """Register (once) and return the CP attention wrapping the registered attention `original`."""
    name = _PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        if original not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"context parallel wraps a registered attention backend; {original!r} is not one")
        AttentionInterface.register(name, _cp_attention(original))
        if original in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def _optional_group(size: int, group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    return group if size > 1 else None


SplitDecoderKwargs = Callable[[dict[str, Any], CPBatch], dict[str, Any]]
"""A family's CP hook: the decoder's keyword arguments (full sequence) → this rank's (`split_sequence_kwargs`)."""
_NOT_SPLIT = frozenset(("attention_mask", CP_CONTEXT_KEY, BATCH_PLAN_KEY, *VARLEN_KEYS))


def split_sequence_kwargs(kwargs: dict[str, Any], batch: CPBatch) -> dict[str, Any]:
    """The default CP split of decoder keywords: every `[B, S, ...]` tensor along S.

    `position_ids` default to `arange(S)` per row (the decoder would build them from the
    *local* length otherwise). A tensor (or list of tensors) of any other shape is an error:
    its family must say how it splits (`split_decoder_kwargs`).
    """
    embeds_BSH = kwargs["inputs_embeds"]
    B, S = embeds_BSH.shape[:2]
    kwargs = dict(kwargs)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(S, device=embeds_BSH.device)
    if position_ids.dim() <= 2:
        kwargs["position_ids"] = position_ids.expand(B, S)
    out = {}
    for key, value in kwargs.items():
        if key in _NOT_SPLIT or value is None:
            out[key] = value
        elif torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (B, S):
            out[key] = batch.split(value)
        elif torch.is_tensor(value) or (isinstance(value, (list, tuple)) and any(torch.is_tensor(v) for v in value)):
            shape = tuple(value.shape) if torch.is_tensor(value) else f"a {type(value).__name__} of tensors"
            raise ValueError(
                f"context parallel cannot split the decoder keyword {key!r} ({shape}, not [B={B}, S={S}, ...]); "
                "the model family must split it in its split_decoder_kwargs"
            )
        else:
            out[key] = value
    return out


class ContextParallel:
    """The CP groups and ranks of one model, the batch plan and the split of the decoder's inputs."""

    def __init__(self, decoder: nn.Module, parallel_dims: Any):
        dims = parallel_dims
        self.ring_size, self.ring_rank = dims.ring_size, dims.ring_rank
        self.ulysses_size, self.ulysses_rank = dims.ulysses_size, dims.ulysses_rank
        self.cp_group = dims.cp_group
        self.ring_group = _optional_group(self.ring_size, dims.ring_group)
        self.ulysses_group = _optional_group(self.ulysses_size, dims.ulysses_group)
        config = decoder.config
        if config._attn_implementation.startswith(_PREFIX):
            raise RuntimeError("context parallel is already enabled on this model")
        config._attn_implementation = cp_attention_name(config._attn_implementation)

    def plan_batch(
        self, batch_size: int, seq_len: int, bounds: tuple[int, ...] | None, device: torch.device | str = "cpu"
    ) -> CPBatch:
        """The split of a `[batch_size, seq_len]` batch, packed when `bounds` (host sample bounds over the `B·S`
        tokens) are given; this rank's token indices go to `device` once (pinned, non-blocking)."""
        flatten = bounds is not None
        layout = CPLayout.create(
            batch_size * seq_len if flatten else seq_len,
            bounds,
            ring_size=self.ring_size, ring_rank=self.ring_rank,
            ulysses_size=self.ulysses_size, ulysses_rank=self.ulysses_rank,
        )
        return CPBatch(layout, flatten, to_device_async(layout.token_indices(), device))

    def plan_training_batch(self, model_kwargs: dict[str, Any], bounds: tuple[int, ...] | None) -> CPBatch:
        """The split of a training batch (its `input_ids` or `inputs_embeds` give `B, S` and the device)."""
        tokens = model_kwargs.get("input_ids")
        tokens = model_kwargs["inputs_embeds"] if tokens is None else tokens
        if bounds is None:
            check_right_padding(model_kwargs.get("attention_mask"))
        return self.plan_batch(tokens.shape[0], tokens.shape[1], bounds, tokens.device)

    def split_decoder_inputs(self, kwargs: dict[str, Any], batch: CPBatch, split_kwargs: SplitDecoderKwargs) -> dict[str, Any]:
        """The decoder's keywords for this rank: split by the family's hook, CP attention context added."""
        embeds_BSH = kwargs["inputs_embeds"]
        kwargs = split_kwargs(kwargs, batch)
        # an already-4-D mask is returned as it is by HF: no mask of the local length is built
        kwargs["attention_mask"] = embeds_BSH.new_zeros((0, 0, 0, 0), dtype=torch.bool)
        for key in VARLEN_KEYS:
            kwargs.pop(key, None)
        kwargs[CP_CONTEXT_KEY] = CPContext(batch.layout, self.ring_group, self.ulysses_group)
        return kwargs


def check_right_padding(attention_mask: torch.Tensor | None) -> None:
    """Context parallel attention is causal without a padding mask: padding must be on the right."""
    if attention_mask is not None and attention_mask.dim() == 2 and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        raise ValueError("context parallel needs right padding (attention_mask 1…1 0…0 per row); this batch is padded on the left")
