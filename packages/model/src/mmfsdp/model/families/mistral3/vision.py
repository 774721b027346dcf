"""Per-image attention in the vision tower.

A Pixtral-style tower flattens the patches of all images of a batch into one
sequence. Each image's patches must attend only to patches of the same image,
whatever the attention backend. A forward pre-hook on the tower computes, from
`image_sizes` and the patch size, the per-image `cu_seq_lens_q/k` (int32,
leading 0) and `max_length_q/k` and passes them as the varlen keywords every
backend of `mmfsdp.model.attention` understands: flash-attn and the NPU kernel
run one sequence per image, SDPA runs each image alone (eager, the reference,
builds a block-diagonal mask).

HF's Pixtral tower also builds a dense `[1, 1, P, P]` block mask over all `P`
patches of the batch for any backend but flash-attn — quadratic in the patches
of the whole batch (a few thousand patches are already hundreds of MiB), and
unused once the varlen keywords are there. While a hooked tower runs, that
mask builder returns None instead (`_without_dense_block_mask`); any other
caller gets HF's mask as before.

The tower is not part of context parallel: every rank runs it on all of its
images, or with vision data parallel on whole images of its share
(`mmfsdp.model.vision_dp`), so these lengths are always whole images.
"""

from __future__ import annotations

import contextvars
from typing import Any, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["image_patch_counts", "per_image_attention_kwargs", "install_per_image_attention"]


def image_patch_counts(image_sizes: torch.Tensor | Sequence[Sequence[int]], patch_size: int) -> list[int]:
    """Number of patches of each image: (height // patch) · (width // patch)."""
    sizes = image_sizes.tolist() if torch.is_tensor(image_sizes) else image_sizes
    return [(int(h) // patch_size) * (int(w) // patch_size) for h, w in sizes]


def per_image_attention_kwargs(image_sizes, patch_size: int, device: torch.device) -> dict[str, Any]:
    """The varlen keywords that make each image one attention sequence."""
    counts = image_patch_counts(image_sizes, patch_size)
    cu_seq_lens = torch.zeros(len(counts) + 1, dtype=torch.int32, device=device)
    cu_seq_lens[1:] = torch.tensor(counts, dtype=torch.int32, device=device).cumsum(0)
    longest = max(counts, default=0)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest, "max_length_k": longest}


_in_varlen_tower: contextvars.ContextVar[bool] = contextvars.ContextVar("mmfsdp_in_varlen_tower", default=False)
_tokens: dict[int, list[contextvars.Token]] = {}


def _per_image_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    pixel_values = args[0] if args else kwargs["pixel_values"]
    image_sizes = kwargs.get("image_sizes", args[1] if len(args) > 1 else None)
    if image_sizes is None:
        image_sizes = [tuple(pixel_values.shape[-2:])] * pixel_values.shape[0]
    kwargs.update(per_image_attention_kwargs(image_sizes, module.patch_size, pixel_values.device))
    _tokens.setdefault(id(module), []).append(_in_varlen_tower.set(True))
    return args, kwargs


def _leave_tower(module: nn.Module, *_: Any) -> None:
    stack = _tokens.get(id(module))
    if stack:
        _in_varlen_tower.reset(stack.pop())


def _without_dense_block_mask() -> None:
    """Wrap HF Pixtral's dense block-mask builder (once) so that it returns None inside a hooked tower."""
    try:
        from transformers.models.pixtral import modeling_pixtral
    except ImportError:
        return
    original = getattr(modeling_pixtral, "generate_block_attention_mask", None)
    if original is None or getattr(original, "_mmfsdp_varlen_aware", False):
        return

    def generate_block_attention_mask(patch_embeds_list, tensor):
        return None if _in_varlen_tower.get() else original(patch_embeds_list, tensor)

    generate_block_attention_mask._mmfsdp_varlen_aware = True
    modeling_pixtral.generate_block_attention_mask = generate_block_attention_mask


def install_per_image_attention(vision_tower: nn.Module) -> list[RemovableHandle]:
    """Make `vision_tower` (which has `patch_size` and takes `pixel_values, image_sizes`) attend per image."""
    _without_dense_block_mask()
    return [
        vision_tower.register_forward_pre_hook(_per_image_hook, with_kwargs=True),
        vision_tower.register_forward_hook(_leave_tower, always_call=True),
    ]
