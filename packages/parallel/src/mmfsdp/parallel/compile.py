"""`torch.compile` per block (decoder layer): the block's own maths compiled, FSDP2's hooks left eager.

`apply_compile(model, patterns, backend=..., dynamic=True)` replaces the `forward` of every matched module, on the
instance, with `torch.compile(forward)` (the module's original bound forward; no wrapper module, so parameter and
state-dict names do not change). One compiled function per module; the graphs are shared between blocks of the same
class (their parameters are graph inputs), so a stack of 48 decoder layers compiles about once.

Order in `parallelize`: compile, then activation checkpointing, activation offload, then FSDP2.
- FSDP2: its pre/post-forward hooks live in the module's `__call__`, around the compiled forward, and run eagerly
  (they are `torch._dynamo.disable`d anyway); the all-gather and reduce-scatter are unchanged.
- Recompute (`apply_activation_checkpointing`): the checkpoint wraps the compiled forward, so backward recomputes by
  calling the same compiled function; the saved activations are dropped as without compile.
- HSDP: as FSDP2; the replicas' all-reduce is FSDP2's, outside the blocks.
- Context parallel: Ulysses / Ring attention run inside the block through the attention interface; Ulysses'
  all-to-alls are traced, a ring's attention runs eagerly as a whole (`torch.compiler.disable`, one graph break
  per layer: `mmfsdp.model.context_parallel`).
- Packed attention (`cu_seq_lens`): one opaque op in the block's graph (`mmfsdp::packed_sdpa`), whatever the
  lengths (`mmfsdp.model.attention`).
- Expert parallel (and MoE at EP 1): the experts module's forward (`experts_forward`) is `torch.compiler.disable`d,
  a graph break in each MoE layer: its dispatch (tokens per expert, all-to-all splits, the experts' row counts) is
  data-dependent, and a traced one would recompile for every new routing. The router before it and the residual
  after it are compiled. Where the expert GEMMs are traced (`local_experts` compiled directly), the grouped GEMM
  capability is asked for compile (`grouped_mm_supported(..., compiled=True)`): fp32 takes the loop there.
- LoRA: the adapters are injected before, so they are part of the compiled block.
- Chunk loss: `lm_head` is not a block and stays eager.

Variable lengths: a block's token dimension changes with every micro-batch (padding-free rows, packing, CP
shards), so with `dynamic=None` (torch.compile's default, the config's) each block is first traced with that
dimension symbolic: before every call the token dimension of the block's first tensor argument (the hidden states,
`(..., tokens, hidden)`) and every dimension of the other tensor arguments of the same size (position embeddings,
position ids, masks) is marked `maybe_mark_dynamic` (a hint: where the block's code needs the size, dynamo
specialises it and recompiles later as before). Without the hint dynamo specialises the first call on its length
and recompiles at the first other length: two traces where one does (the tiny Qwen3-VL on 2 CPU processes, aot_eager:
5.3 s + 8.8 s for the first two steps before, one trace at the first step now). A batch of one row, or a new input
such as an image the first time, may still add a graph, after which rows of every length run those graphs.
Generation (evaluation's greedy answers, the RL stage's embedded rollout engine) calls the blocks with a KV cache
(`cache`; `past_key_values` in older transformers): those calls run the original forward. Traced, the cache's
update specialises on the layer's index and the cache's length: every layer of a tiny Qwen3-VL compiled again for
`generate`, and a deep model hit dynamo's recompile limit (8) before falling back to eager anyway.
`dynamic=True` makes every dimension symbolic from the first call, hidden sizes too: the tiny Qwen3-VL's first
compiled step took 27 s with it, and the kernels cannot specialise on sizes that never change; `dynamic=False`
recompiles for every new length. `_FirstCallTimer` logs, once per process, how long the first compiled call took
(tracing and code generation of the first block).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
from torch import nn

from mmfsdp.config import get_logger
from mmfsdp.parallel.patterns import wrap_forwards

__all__ = ["apply_compile", "is_compiled"]

log = get_logger(__name__)


class _FirstCallTimer:
    """Calls `fn`; the first call in this process (over all compiled blocks) logs its wall time once."""

    logged = False

    def __init__(self, fn: Callable[..., Any], backend: str):
        self.fn = fn
        self.backend = backend

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _FirstCallTimer.logged:
            return self.fn(*args, **kwargs)
        _FirstCallTimer.logged = True
        started = time.perf_counter()
        out = self.fn(*args, **kwargs)
        log.info(f"compile: the first compiled block's first forward took {time.perf_counter() - started:.1f} s "
                 f"(torch.compile, backend {self.backend}; its backward compiles on the first backward)")
        return out


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among `values` and the tuples / lists in them (one level: position embeddings' `(cos, sin)`)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def mark_token_dims(args: tuple, kwargs: dict[str, Any]) -> None:
    """Hint dynamo that the token dimension is dynamic: dimension -2 of the first tensor argument (the block's
    hidden states, `(..., tokens, hidden)`) and each dimension of the other tensor arguments with that size, except
    where the size is also the hidden size (ambiguous: left to dynamo's automatic dynamic shapes); and the length
    of a 1-D integer tensor (a packed batch's `cu_seq_lens`, whose length is the number of samples plus one)."""
    tensors = _tensors((*args, *kwargs.values()))
    if not tensors or tensors[0].ndim < 2:
        return
    first = tensors[0]
    tokens, hidden = first.shape[-2], first.shape[-1]
    if tokens == hidden:
        return
    for tensor in tensors:
        dims = [d for d, size in enumerate(tensor.shape) if size == tokens]
        if tensor.ndim == 1 and not tensor.is_floating_point():
            dims = [0]  # a packed batch's sample bounds (`cu_seq_lens`): one more than its number of samples
        if dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dims)


_CACHE_KEYS = ("cache", "past_key_values", "past_key_value")
"""The KV cache's keyword in a decoder layer's call, as transformers' versions name it."""


class _CompiledForward:
    """The compiled forward of one module (marks the module as compiled for `is_compiled`); with `dynamic=None`
    each call's token dimensions are marked dynamic first (`mark_token_dims`)."""

    def __init__(self, forward: Callable[..., Any], backend: str, dynamic: bool | None):
        self.original = forward
        self.mark = dynamic is None
        self.compiled = _FirstCallTimer(torch.compile(forward, backend=backend, dynamic=dynamic), backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(kwargs.get(name) is not None for name in _CACHE_KEYS):
            return self.original(*args, **kwargs)  # a KV-cached (generation) call: eager, module docstring
        if self.mark:
            mark_token_dims(args, kwargs)
        return self.compiled(*args, **kwargs)


def is_compiled(module: nn.Module) -> bool:
    """Whether `apply_compile` has compiled this module's forward (also under a later checkpointing wrapper)."""
    forward = module.__dict__.get("forward")
    while isinstance(forward, functools.partial) and forward.args:
        forward = forward.args[0]
    return isinstance(forward, _CompiledForward)


def apply_compile(
    model: nn.Module, patterns: list[str], *, backend: str = "inductor", dynamic: bool | None = None,
    key: str = "features.compile_plan.apply_modules",
) -> list[str]:
    """Compile the forward of every module matched by `patterns` (before checkpointing and FSDP); return the names.

    A pattern that matches nothing is a `ConfigError` under `key`. Modules already compiled are left as they are.
    """
    names = wrap_forwards(
        model, patterns, lambda module: _CompiledForward(module.forward, backend, dynamic),
        key=key, what="apply_compile", is_wrapped=is_compiled,
    )
    if names:
        log.info(f"compile: {len(names)} modules compiled per block (backend {backend}, dynamic={dynamic})")
    return names
