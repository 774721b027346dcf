"""Router statistics of a mixture-of-experts decoder: the load-balancing loss and the expert load.

A MoE family's training forward (with `loss_weights`) returns `outputs.router_load`, a
`RouterLoad` of this rank's micro-batch: per MoE layer, how many top-k assignments
each expert received and the sum of its router probabilities over the counted
tokens. `RouterLoadRecorder` makes it with forward hooks — pre-hooks on the
decoder keep the batch's attention mask, cut to this rank's tokens under context
parallel (padding is not counted; with packing there is no mask and every token
counts), and a hook on each router
keeps its logits `[T, E]` (as HF's `output_router_logits` does) until the forward
ends, when they become the two `[E]` sums per layer.

The load-balancing loss is HF's `load_balancing_loss_func` for the family (the
Switch Transformer loss, pooled over layers):

    aux = E · Σ_e f_e · P_e,   f_e = Σ_layers count_e / (L · T),   P_e = Σ_layers prob_e / (L · T)

with T the counted tokens of the batch; the gradient flows through P only (the
counts come from a top-k). `load_balancing_loss(load)` is that on one micro-batch
of one process. Over several ranks (data parallel, and context parallel where each
rank routes its own shard) the counts and T are global sums, and P is linear:
give `load_balancing_loss` the all-reduced `tokens_per_expert` (`[E]`, summed over
layers) and `num_tokens`, and each rank gets its share — the shares add up to the
aux loss of the global batch, exactly as the LM loss shares do (so the same
"× fsdp group size" backward applies). Under activation checkpointing the hooks
record only in the forward, not in the recomputation.

`RouterStepTerms` is a MoE family's `StepTerms` (`mmfsdp.model.spec`): per micro-batch it sums the
counts and tokens over every rank and returns `coef × share / num_micro_batches`; for the step's log it gives
`aux_loss` (the unscaled aux loss of the global batch, mean over micro-batches) and `expert_load_max` /
`expert_load_mean` (top-k assignments per expert and layer over the step's global batch).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mmfsdp.model.context_parallel import CP_CONTEXT_KEY, CPBatch
from mmfsdp.model.spec import StepTerms

__all__ = [
    "RouterLoad",
    "RouterLoadForward",
    "RouterLoadRecorder",
    "RouterStepTerms",
    "load_balancing_loss",
    "expert_load_summary",
]


@dataclass(slots=True)
class RouterLoad:
    """Routing of one forward's tokens on this rank, per MoE layer (L layers, E experts)."""

    tokens_per_expert: torch.Tensor
    """`[L, E]` fp32, no grad: top-k assignments each expert received from the counted tokens."""
    probs_per_expert: torch.Tensor
    """`[L, E]` fp32, with grad: each expert's router probability summed over the counted tokens."""
    num_tokens: torch.Tensor
    """`[]` fp32: tokens counted (the same in every layer)."""


def load_balancing_loss(
    load: RouterLoad, *, tokens_per_expert: torch.Tensor | None = None, num_tokens: torch.Tensor | float | None = None
) -> torch.Tensor:
    """HF's auxiliary loss `E · Σ_e f_e · P_e` (unscaled by `router_aux_loss_coef`); with the global
    `tokens_per_expert` `[E]` (Σ over layers and ranks) and `num_tokens` this rank's share (module docstring)."""
    num_layers, num_experts = load.probs_per_expert.shape
    counts = load.tokens_per_expert.sum(0) if tokens_per_expert is None else tokens_per_expert
    tokens = load.num_tokens if num_tokens is None else torch.as_tensor(num_tokens, dtype=torch.float32)
    rows = (tokens * num_layers).clamp(min=1).to(counts.device)
    return num_experts * ((counts / rows) * (load.probs_per_expert.sum(0) / rows)).sum()


def expert_load_summary(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    """`max` and `mean` tokens per expert of an `[L, E]` count (summed over micro-batches and ranks first)."""
    return {"max": float(tokens_per_expert.max()), "mean": float(tokens_per_expert.float().mean())}


class RouterStepTerms(StepTerms):
    """The router load-balancing loss (× `coef`) and the expert load of one optimizer step (module docstring).

    Every rank routes its own tokens (data and context parallel alike), so the counts and the token count are
    summed over the whole world; the shares then add up to the aux loss of the micro-batch's global batch and
    take the same `× world_size` backward as the LM loss. A forward without `outputs.router_load` adds nothing.
    """

    def __init__(self, coef: float):
        self.coef = coef
        self._aux: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def loss(self, outputs, *, num_micro_batches: int) -> torch.Tensor | None:
        load = getattr(outputs, "router_load", None)
        if load is None:
            return None
        counts = load.tokens_per_expert.detach().clone()
        tokens = load.num_tokens.detach().clone().float()
        dist.all_reduce(counts)
        dist.all_reduce(tokens)
        share = load_balancing_loss(load, tokens_per_expert=counts.sum(0), num_tokens=tokens) / num_micro_batches
        self._aux = share.detach() if self._aux is None else self._aux + share.detach()
        self._counts = counts if self._counts is None else self._counts + counts
        return self.coef * share

    def stats(self) -> dict[str, torch.Tensor]:
        if self._aux is None:
            return {}
        dist.all_reduce(self._aux)
        return {"aux_loss": self._aux, "expert_load_max": self._counts.max(),
                "expert_load_mean": self._counts.float().mean()}


class RouterLoadRecorder:
    """Forward hooks on a decoder and its routers that build a `RouterLoad` while `recording()`.

    A router's forward returns its logits `[T, E]` (or a tuple whose first item they are, as HF's
    `*TopKRouter`s do), one row per decoder token in row-major `[B, S]` order.
    """

    def __init__(self, decoder: nn.Module, routers: Sequence[nn.Module], *, top_k: int):
        self.top_k = top_k
        self._active = False
        self._mask: torch.Tensor | None = None
        self._token_mask: torch.Tensor | None = None
        self._packed = False
        self._logits: list[torch.Tensor] = []
        decoder.register_forward_pre_hook(self._full_mask_hook, with_kwargs=True, prepend=True)
        decoder.register_forward_pre_hook(self._local_mask_hook, with_kwargs=True)
        for router in routers:
            router.register_forward_hook(self._router_hook)

    @contextlib.contextmanager
    def recording(self, token_mask: torch.Tensor | None = None) -> Iterator[None]:
        """Record the routers of one forward. `token_mask` (`[B, S]`, 1 = a real token): the batch's own
        attention mask, which counts when the decoder gets none (packed rows: the varlen lengths replace it,
        and the padding after the last sample, e.g. context parallel's multiple, must not count)."""
        self._active, self._mask, self._logits, self._token_mask = True, None, [], token_mask
        try:
            yield
        finally:
            self._active, self._token_mask = False, None

    def result(self) -> RouterLoad | None:
        """The `RouterLoad` of the last recording; None when no router ran."""
        logits, mask, self._logits, self._mask = self._logits, self._mask, [], None
        if not logits:
            return None
        tokens, probs = [], []
        for layer_logits in logits:
            layer_probs = torch.softmax(layer_logits.float(), dim=-1)
            weight = torch.ones(layer_logits.shape[0], dtype=torch.float32, device=layer_logits.device)
            if mask is not None:
                assert mask.numel() == layer_logits.shape[0], "a router sees one row per decoder token"
                weight = mask.reshape(-1).to(device=layer_logits.device, dtype=torch.float32)
            with torch.no_grad():
                selected = torch.topk(layer_probs, self.top_k, dim=-1).indices.reshape(-1)
                counts = torch.zeros(layer_logits.shape[-1], dtype=torch.float32, device=layer_logits.device)
                tokens.append(counts.scatter_add_(0, selected, weight.repeat_interleave(self.top_k)))
            probs.append((layer_probs * weight.unsqueeze(-1)).sum(0))
        return RouterLoad(torch.stack(tokens), torch.stack(probs), weight.sum())

    def _full_mask_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if self._active:
            # the decoder gets the 2-D padding mask, or none for packed rows (the training forward drops it):
            # then the batch's own mask, whose rows are flattened into one under context parallel
            mask = kwargs.get("attention_mask")
            self._packed = not (isinstance(mask, torch.Tensor) and mask.dim() == 2)
            self._mask = self._token_mask if self._packed else mask
        return None

    def _local_mask_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        # after the training forward's hook: under context parallel the decoder runs on this rank's shard and its
        # mask was replaced, so the rows of the whole-sequence mask are cut the same way (a 2-D mask is unpacked)
        context = kwargs.get(CP_CONTEXT_KEY)
        if self._active and self._mask is not None and context is not None:
            self._mask = CPBatch(context.layout, flatten=self._packed).split(self._mask)
        return None

    def _router_hook(self, module: nn.Module, args: tuple, output):
        # only keeps the logits: anything computed here would be saved for backward inside a checkpointed
        # layer, which its recomputation (not recording) would not save again
        if self._active:
            logits = output[0] if isinstance(output, tuple) else output
            self._logits.append(logits.reshape(-1, logits.shape[-1]))
        return None


class RouterLoadForward:
    """A MoE family's model-class mixin, first in the bases (before the family's training mixin and the HF class):
    the training forward (with `loss_weights`) also returns `outputs.router_load`.

    The class's `__init__` calls `init_router_load(moe_block, top_k=...)` after the training mixin's
    `init_training_forward()`, so the recorder's decoder pre-hooks go around the training forward's: every
    `moe_block` module of the decoder (`decoder_name`) has its router as `gate`.
    """

    def init_router_load(self, moe_block: type[nn.Module], *, top_k: int) -> None:
        decoder = self.get_submodule(self.decoder_name)
        routers = [module.gate for module in decoder.modules() if isinstance(module, moe_block)]
        self._router_recorder = RouterLoadRecorder(decoder, routers, top_k=top_k)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers decides by looking for its experts decorator in the source of the class's module; the
        # experts are the HF class's, so its answer holds (without this, grouped_mm is refused once requested)
        hf_class = next(base for base in cls.__mro__ if base.__module__.startswith("transformers."))
        return hf_class._can_set_experts_implementation()

    def forward(self, *args, loss_weights=None, **kwargs):
        if loss_weights is None:
            return super().forward(*args, **kwargs)
        with self._router_recorder.recording(token_mask=kwargs.get("attention_mask")):
            outputs = super().forward(*args, loss_weights=loss_weights, **kwargs)
        outputs.router_load = self._router_recorder.result()
        return outputs
