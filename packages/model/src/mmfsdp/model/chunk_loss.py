"""Chunked lm_head + cross-entropy: the loss without the `[tokens, vocab]` logits.

Flow, step by step (shapes: T tokens, C chunk, H hidden, V vocab):
1. The model's forward stops at the final hidden states `[B, S, H]` and calls
   the `lm_head` *module* with a `LinearCrossEntropy` — the loss function,
   holding the targets, the per-token weights and the chunk size.
2. `ChunkLossLinear.forward` (the class `lm_head` gets) hands its own weight
   and bias to that loss function and returns the loss instead of the logits.
3. The loss function keeps only the trained tokens (target ≠ -100, weight ≠ 0)
   and runs `_ChunkedLinearCrossEntropy` with one sequence, which, for each chunk of C tokens:
   computes the logits `[C, V]` in fp32, the weighted CE, and at once its
   gradient `w · (softmax − onehot)` in place of the logits; from it the
   chunk's gradient w.r.t. the hidden states (`[C, H]`, stored) and the
   weight (accumulated in fp32 into one `[V, H]` buffer). The chunk's logits
   are then freed. Nothing is recomputed later.
4. Backward only scales the stored gradients by the incoming gradient (e.g.
   the trainer's `× world_size`) and returns them to autograd.
So the forward and backward hold one `[C, V]` chunk of logits at a time, and
cost one forward + backward matmul pass, like the plain path.

FSDP2: because `lm_head` is called as a module, FSDP's pre-forward hook has
all-gathered its weight, and `self.weight` inside the forward is the unsharded
parameter; the weight gradient returned by the Function lands on it, so FSDP's
post-backward reduce-scatters it as for any module. The targets and weights
travel inside the loss-function object, not as tensor arguments, so FSDP's
mixed-precision input cast leaves them alone (the hidden states are cast to
`param_dtype`, as they would be for the plain `lm_head`). With bf16
parameters the matmuls run in bf16 and the softmax / CE / weight-gradient
accumulation in fp32. A frozen `lm_head` skips the weight gradient; a tied one
(weight shared with the embedding) receives it through the shared parameter.

Per-sequence sums (preference training): given `sequence_ids`, the loss function returns the vector
`out[k] = Σ_{t in sequence k} w_t · CE_t` instead of one number; the token sum above is its one-sequence case, and
both run the same Function. With several sequences the gradient w.r.t. each token's logits,
`grad_out[k(t)] · w_t · (softmax − onehot)`, is known only in backward (a preference loss is not linear in the
sums), so the forward keeps the per-token log-sum-exp instead of step 3's gradients and the backward recomputes each
chunk's logits: one more `[C, H] × [H, V]` matmul per chunk than the one-sequence case, and still one `[C, V]` chunk
of logits at a time.

Per-token values (online RL, `per_token`): `chunked_linear_token_cross_entropy` returns, for every token, `w_t ·
CE(logits_t / T, y_t)` (with autograd), the entropy of `softmax(logits_t / T)` and the log of the mass of the tokens
not suppressed (both detached): `mmfsdp.model.loss.token_cross_entropy` of the logits, chunk by chunk. Only trained
tokens get logits (the others are 0). Each token is its own sequence, so the forward keeps the per-token
log-sum-exp and the backward recomputes each chunk's logits, as for per-sequence sums; the gradient w.r.t. a
token's logits is `grad_out_t · w_t · (softmax(logits_t / T) − onehot(y_t)) / T`.

Context parallel: each CP rank holds one shard of the sequence and its own
targets and weights; its loss is the shard's part of the weighted sum, and the
shard losses add up (no all-reduce inside the loss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from mmfsdp.model.loss import IGNORE_INDEX

__all__ = [
    "ChunkLossLinear",
    "LinearCrossEntropy",
    "chunked_linear_cross_entropy",
    "chunked_linear_sequence_cross_entropy",
    "chunked_linear_token_cross_entropy",
    "use_chunk_loss_head",
]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """`out[k] = Σ_{t : ids_t = k} w_t · CE(h_t Wᵀ + b, y_t)` over the rows of `hidden_TH`, k < `num_sequences`, one
    `[C, V]` chunk of logits at a time; the token sum is the case `num_sequences = 1` (`ids_T` unused).

    The gradient w.r.t. a row's logits is `grad_out[ids_t] · w_t · (softmax − onehot(y_t))`. With one sequence
    `grad_out` is one number, so the forward computes the gradients chunk by chunk (`with_grads`) and the backward
    only scales them; with several it is known only in backward, which recomputes each chunk's logits from the
    per-token log-sum-exp kept by the forward."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, bias_V, targets_T, weights_T, ids_T, num_sequences, chunk_size, with_grads):
        num_tokens = hidden_TH.shape[0]
        ctx.now = num_sequences == 1
        out = torch.zeros(num_sequences, dtype=torch.float32, device=hidden_TH.device)
        needed = ctx.needs_input_grad[:3] if with_grads and ctx.now else (False, False, False)
        grads = _zero_grads(hidden_TH, weight_VH, bias_V, needed)
        log_sum_exp_T = (torch.empty(num_tokens, dtype=torch.float32, device=hidden_TH.device)
                         if with_grads and not ctx.now else None)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            targets_C1 = targets_T[start:end, None]
            weights_C1 = weights_T[start:end, None]
            logits_CV = F.linear(hidden_TH[start:end], weight_VH, bias_V).float()
            target_logit_C1 = logits_CV.gather(1, targets_C1)
            row_max_C1 = logits_CV.amax(dim=1, keepdim=True)
            logits_CV.sub_(row_max_C1).exp_()
            sum_exp_C1 = logits_CV.sum(dim=1, keepdim=True)
            log_sum_exp_C1 = row_max_C1 + sum_exp_C1.log()
            ce_C1 = weights_C1 * (log_sum_exp_C1 - target_logit_C1)
            if num_sequences == 1:
                out += ce_C1.sum()
            else:
                out.index_add_(0, ids_T[start:end], ce_C1.squeeze(1))
            if log_sum_exp_T is not None:
                log_sum_exp_T[start:end] = log_sum_exp_C1.squeeze(1)
            if any(g is not None for g in grads):
                # logits_CV becomes d out / d logits = w · (softmax − onehot(y))
                logits_CV.mul_(weights_C1 / sum_exp_C1)
                logits_CV.scatter_add_(1, targets_C1, -weights_C1)
                _add_chunk_grads(grads, start, end, logits_CV, hidden_TH, weight_VH)
            del logits_CV
        if ctx.now:
            ctx.grads = _as_param_dtypes(grads, weight_VH, bias_V)
        elif with_grads:
            ctx.save_for_backward(hidden_TH, weight_VH, bias_V, targets_T, weights_T, ids_T, log_sum_exp_T)
            ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.now:  # computed in the forward: scaled by the one sequence's incoming gradient
            grads = ctx.grads
            ctx.grads = None
            return (*(None if g is None else g.mul_(grad_out.to(g.dtype)) for g in grads), *(None,) * 6)
        hidden_TH, weight_VH, bias_V, targets_T, weights_T, ids_T, log_sum_exp_T = ctx.saved_tensors
        grads = _zero_grads(hidden_TH, weight_VH, bias_V, ctx.needs_input_grad[:3])
        scale_T = weights_T * grad_out.to(torch.float32)[ids_T]
        for start in range(0, hidden_TH.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden_TH.shape[0])
            scale_C1 = scale_T[start:end, None]
            # d out / d logits, scaled: scale · (softmax − onehot(y))
            grad_logits_CV = F.linear(hidden_TH[start:end], weight_VH, bias_V).float()
            grad_logits_CV.sub_(log_sum_exp_T[start:end, None]).exp_().mul_(scale_C1)
            grad_logits_CV.scatter_add_(1, targets_T[start:end, None], -scale_C1)
            _add_chunk_grads(grads, start, end, grad_logits_CV, hidden_TH, weight_VH)
            del grad_logits_CV
        return (*_as_param_dtypes(grads, weight_VH, bias_V), *(None,) * 6)


class _ChunkedTokenCrossEntropy(torch.autograd.Function):
    """Per row of `hidden_NH`: `w · CE(logits / T, y)`, the entropy of `softmax(logits / T)` and, given
    `suppress_S` (maybe empty: 0), the log of the other tokens' mass (the last two without gradient), one `[C, V]` chunk of logits at
    a time; the backward recomputes each chunk's logits from the kept log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, targets_N, weights_N, temperature, suppress_S, chunk_size):
        num_tokens = hidden_NH.shape[0]
        out_N, entropy_N, kept_N, log_sum_exp_N = (
            torch.empty(num_tokens, dtype=torch.float32, device=hidden_NH.device) for _ in range(4)
        )
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits_CV = F.linear(hidden_NH[start:end], weight_VH, bias_V).float().div_(temperature)
            log_sum_exp_C = logits_CV.logsumexp(dim=1)
            logps_CV = logits_CV.sub_(log_sum_exp_C[:, None])
            out_N[start:end] = -weights_N[start:end] * logps_CV.gather(1, targets_N[start:end, None]).squeeze(1)
            entropy_N[start:end] = -(logps_CV.exp() * logps_CV).sum(dim=1)
            kept_N[start:end] = torch.log1p(-logps_CV.index_select(1, suppress_S).logsumexp(dim=1).exp())
            log_sum_exp_N[start:end] = log_sum_exp_C
            del logits_CV, logps_CV
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, targets_N, weights_N, log_sum_exp_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy_N, kept_N)
        return out_N, entropy_N, kept_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out_N, grad_entropy, grad_kept):
        hidden_NH, weight_VH, bias_V, targets_N, weights_N, log_sum_exp_N = ctx.saved_tensors
        grads = _zero_grads(hidden_NH, weight_VH, bias_V, ctx.needs_input_grad[:3])
        scale_N = weights_N * grad_out_N.to(torch.float32) / ctx.temperature
        for start in range(0, hidden_NH.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden_NH.shape[0])
            scale_C1 = scale_N[start:end, None]
            # d out / d logits, scaled: scale · (softmax(logits / T) − onehot(y))
            grad_logits_CV = F.linear(hidden_NH[start:end], weight_VH, bias_V).float().div_(ctx.temperature)
            grad_logits_CV.sub_(log_sum_exp_N[start:end, None]).exp_().mul_(scale_C1)
            grad_logits_CV.scatter_add_(1, targets_N[start:end, None], -scale_C1)
            _add_chunk_grads(grads, start, end, grad_logits_CV, hidden_NH, weight_VH)
            del grad_logits_CV
        return (*_as_param_dtypes(grads, weight_VH, bias_V), *(None,) * 5)


def _zero_grads(hidden_TH, weight_VH, bias_V, needed):
    """The buffers the chunks fill: the hidden states' gradient (one slice per chunk) and the weight's and bias's
    (fp32, accumulated over the chunks); None where no gradient is needed."""
    need_h, need_w, need_b = needed
    return (
        torch.empty_like(hidden_TH) if need_h else None,
        torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_w else None,
        torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device) if need_b else None,
    )


def _add_chunk_grads(grads, start, end, grad_logits_CV, hidden_TH, weight_VH):
    """One chunk's part of the gradients from its fp32 gradient w.r.t. the logits (matmuls in the weight's dtype)."""
    grad_hidden_TH, grad_weight_VH, grad_bias_V = grads
    if grad_bias_V is not None:
        grad_bias_V += grad_logits_CV.sum(dim=0)
    grad_logits_CV = grad_logits_CV.to(weight_VH.dtype)
    if grad_hidden_TH is not None:
        torch.mm(grad_logits_CV, weight_VH, out=grad_hidden_TH[start:end])
    if grad_weight_VH is not None:
        hidden_CH = hidden_TH[start:end]
        if grad_weight_VH.dtype == grad_logits_CV.dtype == hidden_CH.dtype:
            grad_weight_VH.addmm_(grad_logits_CV.t(), hidden_CH)
        else:
            grad_weight_VH += torch.mm(grad_logits_CV.t(), hidden_CH)


def _as_param_dtypes(grads, weight_VH, bias_V):
    grad_hidden_TH, grad_weight_VH, grad_bias_V = grads
    return (
        grad_hidden_TH,
        None if grad_weight_VH is None else grad_weight_VH.to(weight_VH.dtype),
        None if grad_bias_V is None else grad_bias_V.to(bias_V.dtype),
    )


def _flat_targets(hidden_states: torch.Tensor, shift_labels: torch.Tensor, loss_weights: torch.Tensor):
    hidden_TH = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets_T = shift_labels.reshape(-1).to(hidden_TH.device)
    weights_T = loss_weights.reshape(-1).to(device=hidden_TH.device, dtype=torch.float32)
    if targets_T.shape[0] != hidden_TH.shape[0] or weights_T.shape[0] != hidden_TH.shape[0]:
        raise ValueError(
            f"{hidden_TH.shape[0]} hidden states but {targets_T.shape[0]} targets and {weights_T.shape[0]} loss weights"
        )
    return hidden_TH, targets_T, weights_T


def _trained_rows(hidden_TH, targets_T, weights_T, keep_T=None, *extra_T):
    """The rows that carry loss (a target, a non-zero weight and `keep_T` where given) of the hidden states, the
    targets, the weights and each of `extra_T`: only they need logits."""
    mask_T = (targets_T != IGNORE_INDEX) & (weights_T != 0)
    if keep_T is not None:
        mask_T &= keep_T
    trained = mask_T.nonzero().squeeze(1)
    return tuple(t.index_select(0, trained) for t in (hidden_TH, targets_T, weights_T, *extra_T))


def chunked_linear_sequence_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shift_labels: torch.Tensor,
    loss_weights: torch.Tensor,
    sequence_ids: torch.Tensor,
    num_sequences: int,
    chunk_size: int,
) -> torch.Tensor:
    """fp32 `[num_sequences]`, chunk by chunk: equals `sequence_cross_entropy` of the logits (`mmfsdp.model.loss`)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    hidden_TH, targets_T, weights_T = _flat_targets(hidden_states, shift_labels, loss_weights)
    ids_T = sequence_ids.reshape(-1).to(hidden_TH.device)
    hidden_NH, targets_N, weights_N, ids_N = _trained_rows(hidden_TH, targets_T, weights_T, ids_T >= 0, ids_T)
    return _ChunkedLinearCrossEntropy.apply(
        hidden_NH, weight, bias, targets_N, weights_N, ids_N.to(torch.int64), num_sequences, chunk_size,
        torch.is_grad_enabled(),
    )


def chunked_linear_token_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shift_labels: torch.Tensor,
    loss_weights: torch.Tensor,
    chunk_size: int,
    temperature: float = 1.0,
    suppress_token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunk by chunk, what `mmfsdp.model.loss.token_cross_entropy` computes from the logits (fp32, the shape of
    `shift_labels`): `w_t · CE(logits_t / T, y_t)`, the detached entropies and, given `suppress_token_ids`, the
    detached log of the kept mass; tokens that do not train hold 0 in all three."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    hidden_TH, targets_T, weights_T = _flat_targets(hidden_states, shift_labels, loss_weights)
    rows_T = torch.arange(targets_T.shape[0], device=hidden_TH.device)
    hidden_NH, targets_N, weights_N, rows_N = _trained_rows(hidden_TH, targets_T, weights_T, None, rows_T)
    suppressed = suppress_token_ids is not None and suppress_token_ids.numel() > 0
    suppress = (suppress_token_ids if suppressed else torch.zeros(0, dtype=torch.long)).to(hidden_TH.device)
    values = _ChunkedTokenCrossEntropy.apply(
        hidden_NH, weight, bias, targets_N, weights_N, float(temperature), suppress, chunk_size,
    )
    zeros_T = torch.zeros(targets_T.shape[0], dtype=torch.float32, device=hidden_TH.device)
    loss, entropy, kept = (zeros_T.index_copy(0, rows_N, v).reshape(shift_labels.shape) for v in values)
    return loss, entropy, kept if suppressed else None


def chunked_linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shift_labels: torch.Tensor,
    loss_weights: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """Σ_t w_t · CE(hidden_t · Wᵀ + b, y_t) in fp32, chunk by chunk; equals `weighted_cross_entropy` of the logits."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    hidden_NH, targets_N, weights_N = _trained_rows(*_flat_targets(hidden_states, shift_labels, loss_weights))
    out = _ChunkedLinearCrossEntropy.apply(
        hidden_NH, weight, bias, targets_N, weights_N, None, 1, chunk_size, torch.is_grad_enabled(),
    )
    return out.squeeze(0)


class LinearCrossEntropy:
    """The loss function `lm_head` receives under chunk loss: targets, weights and chunk size (and, for
    per-sequence sums, the tokens' sequence ids).

    A plain object on purpose: FSDP2 casts floating tensors found in a module's
    arguments (and in lists, dicts, dataclasses) to its `param_dtype`; the fp32
    loss weights must not be.
    """

    __slots__ = ("shift_labels", "loss_weights", "chunk_size", "sequence_ids", "num_sequences", "per_token")

    def __init__(
        self, shift_labels: torch.Tensor, loss_weights: torch.Tensor, chunk_size: int,
        sequence_ids: torch.Tensor | None = None, num_sequences: int = 0, per_token: dict | None = None,
    ):
        self.shift_labels = shift_labels
        self.loss_weights = loss_weights
        self.chunk_size = chunk_size
        self.sequence_ids = sequence_ids
        self.num_sequences = num_sequences
        self.per_token = per_token
        """Per-token values: `chunked_linear_token_cross_entropy`'s `temperature` and `suppress_token_ids`."""

    def __call__(self, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.per_token is not None:
            return chunked_linear_token_cross_entropy(
                hidden_states, weight, bias, self.shift_labels, self.loss_weights, self.chunk_size, **self.per_token
            )
        if self.sequence_ids is not None:
            return chunked_linear_sequence_cross_entropy(
                hidden_states, weight, bias, self.shift_labels, self.loss_weights, self.sequence_ids,
                self.num_sequences, self.chunk_size,
            )
        return chunked_linear_cross_entropy(hidden_states, weight, bias, self.shift_labels, self.loss_weights, self.chunk_size)


class ChunkLossLinear(nn.Linear):
    """`nn.Linear` that, given a loss function, returns the loss of its output instead of the output."""

    def forward(self, input: torch.Tensor, loss_function: LinearCrossEntropy | None = None) -> torch.Tensor:
        if loss_function is None:
            return super().forward(input)
        return loss_function(input, self.weight, self.bias)


def use_chunk_loss_head(linear: nn.Linear) -> None:
    """Give a plain `nn.Linear` the `ChunkLossLinear` class in place (same parameters, hooks and state-dict keys)."""
    if type(linear) is ChunkLossLinear:
        return
    if type(linear) is not nn.Linear:
        raise TypeError(f"expected a plain nn.Linear lm_head (before FSDP wraps it), got {type(linear).__name__}")
    linear.__class__ = ChunkLossLinear
