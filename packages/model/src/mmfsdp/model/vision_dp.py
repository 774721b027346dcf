"""Vision data parallel under context parallel: each CP rank encodes a share of the micro-batch's media.

Under context parallel every rank of a CP group receives the same micro-batch. Without vision DP each of
them runs the vision tower over all of its images and videos, so at CP n the vision work is done n times.
With `parallel.vision_dp` (`TrainingForwardMixin.enable_context_parallel(..., vision_dp=True)`) the
training forward replaces the base model's `get_image_features` for the duration of the HF forward
(`VisionDataParallel.patched`); every call of it (Qwen3-VL calls it for images and, through
`get_video_features`, for videos) runs:

1. The family's `vision_media_patches(call)` gives the patches of each media item (image or video) of the
   call; `media_costs` turns them into costs, `patches · (1 + patches / (6 · width))`: the linear layers of a
   vision block cost ∝ patches · 12·width², its attention ∝ patches² · 2·width (width: the tower's hidden size).
2. `assign_media(costs, cp_size)` assigns every item to one rank: largest cost first, each to the least
   loaded rank (ties: the lower rank). It is a pure function of the batch, so every rank of the group
   computes the same assignment without communicating.
3. The rank encodes its items with one call of the original `get_image_features` on the family's
   `select_vision_media(call, indices)` (the same keywords cut to those items). A rank with no item
   (fewer media than ranks) encodes the family's `placeholder_vision_inputs` instead and contributes zero
   rows: every rank thus runs the tower once per call and its FSDP2 collectives stay paired.
4. The per-item features the merge uses (HF's `pooler_output`, and Qwen3-VL's `deepstack_features`, one
   tensor per item each) are concatenated along the feature dim into one `[rows, F]` tensor per rank and
   gathered over the CP group by `gather_media` (one `all_reduce` of the per-item row counts, one
   `all_gather` padded to the largest share), then cut back into per-item tensors in the call's order.
   The merge into the sequence then runs unchanged, identical on every rank.

Backward of the gather (`_GatherRows`): each rank's loss uses every item's features, so the gradient of
an item's features is the sum over the CP group of each rank's gradient for it; the backward all-reduces
the gathered gradient over the CP group and hands the encoding rank its own rows. The trainer backpropagates
`loss × world_size` on every rank and FSDP2 averages parameter gradients over all ranks
(`mmfsdp.model.context_parallel`, "Loss and gradients"), so the encoding rank's vision gradient is
`world_size · Σ_r ∂l_r/∂f · ∂f/∂θ` and the average is `Σ_r ∂l_r/∂θ`: the same as when every rank encoded
every item (where each rank contributes `world_size · ∂l_r/∂f · ∂f/∂θ`). The other ranks' vision
parameters receive nothing from that item; the placeholder contributes exactly zero.

A micro-batch without any media never calls `get_image_features`: the training forward's placeholder
runs on every rank as without vision DP. Only the features above are gathered; the rest of the local
output (`last_hidden_state`, `hidden_states`) is this rank's share and must not be used by the merge.

Audio clips (`AudioDataParallel`, Qwen3-Omni's audio tower) are shared out the same way, by the same switch:
the base model's `get_audio_features` is replaced, each clip costs its mel frames (the tower attends within
fixed windows: linear in the frames), the family's `audio_media_frames`, `select_audio_media` and
`placeholder_audio_inputs` play the vision hooks' parts, and the features gathered are the rows of
`last_hidden_state` (the merge's), `audio_media_rows(frames)` rows per clip (from the frames already on the host:
one host read of the clips' sizes per call, as vision's grids). A clip's features do not depend on the
other clips of the call (the tower cuts each clip into its own chunks and windows), so any split gives the
features of the whole call.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

__all__ = ["AudioDataParallel", "VisionDataParallel", "assign_media", "gather_media", "media_costs"]


def media_costs(patches: list[int], width: int) -> list[float]:
    """The vision cost of each media item of `patches` patches for a tower of hidden size `width`."""
    return [p * (1.0 + p / (6.0 * width)) for p in patches]


def assign_media(costs: list[float], num_ranks: int) -> list[list[int]]:
    """The indices of the items each rank encodes, ascending: largest cost first to the least loaded rank."""
    loads = [0.0] * num_ranks
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        loads[rank] += costs[index]
        shares[rank].append(index)
    return [sorted(share) for share in shares]


class _GatherRows(torch.autograd.Function):
    """All-gather of `[rows_r, F]` over a group (rows differ per rank); backward: all-reduce, own rows."""

    @staticmethod
    def forward(ctx, local_RF: torch.Tensor, rows: list[int], rank: int, group: dist.ProcessGroup) -> torch.Tensor:
        padded = local_RF.new_zeros((max(rows), *local_RF.shape[1:]))
        padded[: rows[rank]] = local_RF
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=group)
        ctx.rows, ctx.rank, ctx.group = rows, rank, group
        return torch.cat([part[:n] for part, n in zip(parts, rows)])

    @staticmethod
    def backward(ctx, grad_RF: torch.Tensor):
        grad_RF = grad_RF.contiguous().clone()
        dist.all_reduce(grad_RF, group=ctx.group)
        start = sum(ctx.rows[: ctx.rank])
        return grad_RF[start : start + ctx.rows[ctx.rank]], None, None, None


def gather_media(
    local_RF: torch.Tensor, local_rows: list[int], shares: list[list[int]], rank: int, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Every item's `[rows, F]` features in item order. `local_RF` holds this rank's items (`shares[rank]`, of
    `local_rows` rows each) one after the other; a rank without items passes a tensor of no rows that is tied to
    its placeholder's graph, so that its tower runs the same backward (and FSDP2 collectives) as the others."""
    counts = [0] * sum(len(share) for share in shares)
    for index, num_rows in zip(shares[rank], local_rows, strict=True):
        counts[index] = num_rows
    counts = torch.tensor(counts, dtype=torch.int64, device=local_RF.device)
    dist.all_reduce(counts, group=group)
    counts = counts.tolist()
    rows = [sum(counts[i] for i in share) for share in shares]
    gathered = _GatherRows.apply(local_RF, rows, rank, group)
    items: list[torch.Tensor] = [gathered] * len(counts)
    start = 0
    for share in shares:
        for index in share:
            items[index] = gathered[start : start + counts[index]]
            start += counts[index]
    return items


def _per_item(value: Any, sizes: list[int]) -> list[torch.Tensor]:
    """A feature as one tensor per item: HF returns a tuple per item (older versions: one concatenated tensor)."""
    if torch.is_tensor(value):
        return list(torch.split(value, sizes))
    return list(value)


class _EncoderDataParallel:
    """Replaces a base model's encoder method (`method`) by `encode` within `patched` (module docstring)."""

    method = ""

    def __init__(self, model: Any, group: dist.ProcessGroup, rank: int, size: int, width: int):
        self.model, self.group, self.rank, self.size, self.width = model, group, rank, size, width
        self.encoded: deque[tuple[int, int]] = deque(maxlen=4096)
        """Per call, the media items this rank encoded (0: the placeholder) and those of the call; for tests."""

    @contextlib.contextmanager
    def patched(self, base: torch.nn.Module) -> Iterator[None]:
        """`base.<method>` runs this data parallel inside the block."""
        setattr(base, self.method, self._wrap(getattr(base, self.method)))
        try:
            yield
        finally:
            delattr(base, self.method)

    @contextlib.contextmanager
    def suspended(self, base: torch.nn.Module) -> Iterator[None]:
        """Inside `patched`: `base.<method>` is the original again (the placeholder pass of a media kind the call
        lacks is every rank's own, like the rest of the placeholder: nothing to share or gather)."""
        patched = base.__dict__.pop(self.method, None)
        try:
            yield
        finally:
            if patched is not None:
                setattr(base, self.method, patched)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)
        var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

        def encoder(*args: Any, **kwargs: Any) -> Any:
            call = dict(signature.bind(*args, **kwargs).arguments)
            call.update(call.pop(var_keyword, {}) if var_keyword else {})
            return self.encode(original, call)

        return encoder

    def encode(self, original: Callable[..., Any], call: dict[str, Any]) -> Any:
        raise NotImplementedError


class VisionDataParallel(_EncoderDataParallel):
    """The vision-DP replacement of a base model's `get_image_features` (module docstring); family hooks on `model`."""

    method = "get_image_features"

    def encode(self, original: Callable[..., Any], call: dict[str, Any]) -> Any:
        """This rank's share of the call's media encoded, every item's features gathered (module docstring)."""
        patches = self.model.vision_media_patches(call)
        shares = assign_media(media_costs(patches, self.width), self.size)
        mine = shares[self.rank]
        call = {**call, "return_dict": True}
        if mine:
            output = original(**self.model.select_vision_media(call, mine))
        else:
            pixels = next(v for v in call.values() if torch.is_tensor(v) and v.is_floating_point())
            placeholder = self.model.placeholder_vision_inputs(pixels.device, pixels.dtype)
            output = original(**{**call, **placeholder})
        self.encoded.append((len(mine), len(patches)))
        pooler = list(output.pooler_output)
        sizes = [item.shape[0] for item in pooler]
        deepstack = getattr(output, "deepstack_features", None)
        kinds = [pooler] + [_per_item(layer, sizes) for layer in (deepstack or [])]
        if mine:  # items the family's selection added after this rank's are dropped
            kinds, sizes = [kind[: len(mine)] for kind in kinds], sizes[: len(mine)]
        widths = [kind[0].shape[-1] for kind in kinds]
        local_RF = torch.cat([torch.cat([kind[i] for kind in kinds], dim=-1) for i in range(len(sizes))])
        if not mine:
            local_RF, sizes = local_RF[:0], []  # no rows, but the placeholder's graph
        items = gather_media(local_RF, sizes, shares, self.rank, self.group)
        split = [torch.split(item, widths, dim=-1) for item in items]
        output.pooler_output = tuple(parts[0] for parts in split)
        if deepstack is not None:
            output.deepstack_features = [tuple(parts[k] for parts in split) for k in range(1, len(kinds))]
        return output


class AudioDataParallel(_EncoderDataParallel):
    """The audio-DP replacement of a base model's `get_audio_features` (module docstring); family hooks on `model`
    (`audio_media_frames`, `audio_media_rows`, `select_audio_media`, `placeholder_audio_inputs`). `width` is unused:
    a clip costs its frames."""

    method = "get_audio_features"

    def encode(self, original: Callable[..., Any], call: dict[str, Any]) -> Any:
        """This rank's share of the call's clips encoded, every clip's feature rows gathered in the call's order."""
        frames = self.model.audio_media_frames(call)
        shares = assign_media([float(f) for f in frames], self.size)
        mine = shares[self.rank]
        call = {**call, "return_dict": True}
        if mine:
            output = original(**self.model.select_audio_media(call, mine))
            rows = self.model.audio_media_rows([frames[i] for i in mine])
            local_RF = output.last_hidden_state
        else:
            features = next(v for v in call.values() if torch.is_tensor(v) and v.is_floating_point())
            output = original(**{**call, **self.model.placeholder_audio_inputs(features.device, features.dtype)})
            rows, local_RF = [], output.last_hidden_state[:0]  # no rows, but the placeholder's graph
        self.encoded.append((len(mine), len(frames)))
        output.last_hidden_state = torch.cat(gather_media(local_RF, rows, shares, self.rank, self.group))
        return output
