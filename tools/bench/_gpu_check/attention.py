"""The `attention` section: the SDPA backend the trainer picks and which torch SDPA kernel really ran."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

from .common import error_text

if TYPE_CHECKING:
    from .context import Context

_SDPA_OPS = ("aten::_scaled_dot_product", "aten::_efficient_attention", "aten::_flash_attention",
             "aten::_cudnn_attention")
_KERNEL_MARKS = ("flash", "fmha", "attention", "attn", "sdpa")
_KERNEL_KINDS = (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "mem_efficient"), ("math", "math"))


def sdpa_profiler(ctx: Context, seen: dict[str, dict[str, int]], *, device_kernels: bool) -> Callable:
    """A context manager factory for `Runs.train(around_step=...)`: profiles the second step (the first one
    warms up) and counts into `seen` the SDPA aten ops (`sdpa_ops`, they name the kernel torch chose) and the
    other profiler events whose names look like attention (`attention_events`: the device kernels with
    `device_kernels` on CUDA; autograd nodes on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device_kernels and ctx.device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    seen.setdefault("sdpa_ops", {})
    seen.setdefault("attention_events", {})

    @contextlib.contextmanager
    def profiled():
        with profile(activities=activities) as prof:
            yield
        for event in prof.key_averages():
            name = event.key
            if name.startswith(_SDPA_OPS):
                seen["sdpa_ops"][name] = seen["sdpa_ops"].get(name, 0) + event.count
            elif not name.startswith("aten::") and any(mark in name.lower() for mark in _KERNEL_MARKS):
                seen["attention_events"][name[:120]] = seen["attention_events"].get(name[:120], 0) + event.count

    return lambda trainer: profiled() if trainer.step == 1 else contextlib.nullcontext()


def kernels_used(ops: dict[str, int]) -> list[str]:
    """The SDPA kernels the aten ops name (`flash`, `mem_efficient`, `cudnn`, `math`)."""
    names = " ".join(ops)
    return [kind for mark, kind in _KERNEL_KINDS if mark in names] or ["none seen"]


def section_attention(ctx: Context) -> dict[str, Any]:
    import torch

    from mmfsdp.model.attention import resolve_attention_backend

    backend = resolve_attention_backend("sdpa", ctx.device_type)
    out: dict[str, Any] = {"attn_implementation": "sdpa", "hf_attention_function": backend.hf_name,
                           "dtype": ctx.sizes.compute_dtype}
    dtype = {"parallel.fsdp_plan.param_dtype": ctx.sizes.compute_dtype}
    for layout, padding_free in (("packed_varlen", "true"), ("padded", "false")):
        seen: dict[str, dict[str, int]] = {}
        cfg = ctx.runs.config("qwen3vl_tiny", ctx.runs.overrides(
            "qwen3vl_tiny", f"attention_{layout}", steps=2, micro_batch=ctx.sizes.micro_batch,
            extra={**dtype, "data.dataloader_param.padding_free": padding_free}))
        ctx.runs.train(cfg, around_step=sdpa_profiler(ctx, seen, device_kernels=True))
        out[layout] = {**seen, "kernels_used": kernels_used(seen["sdpa_ops"])}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        cfg = ctx.runs.config("qwen3vl_tiny", ctx.runs.overrides(
            "qwen3vl_tiny", "attention_flash_only", steps=1, micro_batch=ctx.sizes.micro_batch, extra=dtype))
        ctx.runs.train(cfg, around_step=lambda trainer: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
        flash_only: dict[str, Any] = {
            "status": "ok", "note": "every SDPA call of a packed training step ran with only the flash kernel"}
    except Exception as err:  # a restriction some call cannot meet raises "No available kernel"
        flash_only = {"status": "error", "error": error_text(err)}
    out["flash_only_step"] = flash_only
    out["torch_flash_sdp_enabled"] = bool(torch.backends.cuda.flash_sdp_enabled())
    try:  # the other fast path: `attn_implementation: flash_attention_2` (the flash-attn package), not run here
        out["flash_attention_2"] = {"available": True,
                                    "hf_attention_function": resolve_attention_backend("flash_attention_2",
                                                                                       ctx.device_type).hf_name}
    except Exception as err:
        out["flash_attention_2"] = {"available": False, "reason": error_text(err)}
    return out
