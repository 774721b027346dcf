"""Rollout engines: prompts in, sampled completions with their sampling log-probabilities out (online RL, GRPO).

`RolloutEngine` is the interface a training stage talks to; `HFRolloutEngine` is the embedded default, which
generates inside the training processes from the live (FSDP2-sharded) model. Requests and results are plain data
(ints, lists, CPU tensors, frozen dataclasses that pickle), so an engine in another process (vLLM, next issue) sits
behind the same interface: `sync_weights` hands it the trainer's weights after an optimizer step and
`weights_version` says which step's weights produced a rollout.

Sampling (`SamplingParams`, TRL's `GRPOConfig` names): temperature T, then top-k, then top-p (the order of vLLM
and of transformers' warpers), then one draw from the renormalised distribution; T = 0 is greedy (argmax of the
raw logits). The log-probability returned with each token is that of the distribution actually sampled from,
vLLM's `logprobs_mode="processed_logprobs"` (which TRL requires of vLLM for its importance-sampling correction):
`log_softmax(warp(z))[token]` with `warp(z) = z / T` restricted to the top-k / top-p set. With top-k and top-p
off it is `log_softmax(z / T)[token]`, what TRL's trainer computes from its own forward (logits divided by the
temperature); with them on the two differ by the log of the kept mass, as with vLLM. At T = 0 it is
`log_softmax(z)[token]` (vLLM's greedy log-probs are the raw ones).

Layout independence: the draw for generated token t of generation g of prompt p at RL step s is a Gumbel-max
`argmax(warp(z) + G)` whose noise `G[v] = −log(−log u[v])` comes from a counter-based hash of
(seed, s, p, g, t, v) (`gumbel_noise`), computed on the device with no generator state. A prompt's completions
therefore depend on its own logits only, not on which rank holds it, its row in the batch or what else is
generated beside it; the logits themselves differ between layouts by rounding only (other padding, other batch
shapes), so tokens agree unless a draw falls within rounding of a tie.

`HFRolloutEngine.generate`, step by step:
1. The requests (each a prompt and `num_generations`) become one left-padded batch of prompts; each prompt's
   media (the per-media keys its family's collator makes: `pixel_values` and `image_grid_thw` / `image_sizes`,
   videos likewise) are concatenated in prompt order, smaller trailing dims zero-padded at the end (the
   collators' layout, e.g. Pixtral's images padded bottom/right).
2. Positions: the family's `prepare_inputs` hook (the one the training forward uses) computes them on the whole
   prompt, M-RoPE for Qwen3-VL from `get_rope_index` (left padding masked); otherwise they count the real tokens.
   A generated token's position is its predecessor's plus one on every axis (transformers' generation rule; for
   M-RoPE, text after the prompt continues at `max + 1`), so the training forward on prompt + completion sees
   the same positions.
3. One prefill forward over the prompts (`logits_to_keep=1`), with the KV cache. Its call carries no cache, so
   the training forward runs its vision placeholder for each kind of media the call lacks (docs/model.md,
   "Text-only micro-batches"): a rank with text-only prompts makes the same vision-tower passes, hence the same
   FSDP2 all-gathers, as a rank with images.
4. The cache rows are repeated per generation (`Cache.reorder_cache`, a row gather for every kind of cache layer,
   linear attention included): a prompt is encoded once however many completions it gets.
5. Decode: one forward per step for all rows (a row that stopped keeps stepping, its tokens discarded), sampling
   on the device. Under FSDP2 the prefill all-gathers each group once and the groups stay gathered through the
   decode steps (`gather_weights`, the default: `mmfsdp.parallel.fsdp_gathered`; with it off, every forward
   gathers them again, one group at a time); every forward still runs FSDP2's hooks, so every rank must make the
   same number of forwards: once per step the ranks all-reduce (MIN over the group) whether all their rows have
   stopped, and all stop together when every rank is done or at `max_new_tokens`. That one-element all-reduce and
   the `.item()` reading it are the loop's only host synchronisation, a small constant per step (generation, not a
   training hot path); before the loop, one more checks the requests on every rank (all raise together) and the prompts'
   positions are computed on the host side of the family's hook; the tokens and log-probs reach the host once,
   at the end.
A stop token ends its completion and is part of it (with its log-prob), as in TRL's completion mask. Completion
tokens are text: a trainer re-reading prompt + completion gives them token type 0 (Qwen3-VL's
`mm_token_type_ids`, as transformers' generation extends them), whatever their id.

Why a loop of our own rather than `model.generate`: transformers samples with the global generator over the whole
batch (completions would depend on the batch and the rank), the log-probs would need its `[R, V]` scores kept per
step, and `synced_gpus` reduces over the world group only. The loop uses the model's own pieces for what is
family-specific: the family's `prepare_inputs` for the positions, the HF cache, media in the prefill only (as
transformers' `prepare_inputs_for_generation`), and positions that continue by one per token (as its
`_update_model_kwargs_for_generation`). Positions are always passed, so Qwen3-VL's stateful `rope_deltas` (its
M-RoPE offset of generated tokens, implied here by the prompt's last position) is neither read nor left stale.

FSDP2 and other parallelisms: the engine only calls the model's forward; the sharded parameters are gathered by
FSDP2's hooks per module and call. Every rank of `group` (default: the world) calls `generate` with the same
`sampling` and `step`, each with its own requests, possibly none (a rank without prompts runs one placeholder row).
Context parallel is not applied to generation (the training forward splits sequences only for the loss): each
rank decodes whole sequences. The NPU fusion attention backend reads no padding mask and is refused.

Shape legend: P prompts, R rows (generations), V vocabulary, S prompt length.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from mmfsdp.parallel.fsdp import fsdp_gathered

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "FinishReason",
    "HFRolloutEngine",
    "Rollout",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingParams",
    "gumbel_from_hash",
    "gumbel_noise",
    "row_keys",
    "sample_tokens",
    "warp_logits",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How completions are sampled (TRL `GRPOConfig` / vLLM `SamplingParams` names and meanings)."""

    max_new_tokens: int
    """Most tokens a completion gets; one that reaches it without a stop token finishes with "length"."""
    temperature: float = 1.0
    """Logits are divided by it before sampling; 0: greedy (argmax)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches it (after temperature, top-k); 1: all."""
    top_k: int = 0
    """Keep the k most likely tokens (ties kept); 0: all."""
    stop_token_ids: tuple[int, ...] = ()
    """The template's end token(s): generating one ends the completion (it is included)."""
    seed: int = 0
    """With the RL step, prompt index and generation index, it keys every draw (module docstring)."""
    suppress_token_ids: tuple[int, ...] = ()
    """Tokens never sampled: their logits are −inf before anything else (transformers' `suppress_tokens`). An RL
    stage suppresses the media placeholder tokens (a completion is text; a placeholder without its image would break
    the training forward); its trainer's log-probabilities are over the whole vocabulary (TRL's), those of the
    sampled distribution are lower by the log of the kept mass (`training_forward` step 8, `.kept_logmass`)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {self.max_new_tokens} must be at least 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: {self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k: {self.top_k} must be >= 0 (0 keeps all tokens)")
        if self.seed < 0:
            raise ValueError(f"seed: {self.seed} must be >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(token) for token in self.stop_token_ids))
        object.__setattr__(self, "suppress_token_ids", tuple(sorted({int(token) for token in self.suppress_token_ids})))


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutRequest:
    """One prompt to complete `num_generations` times."""

    prompt_index: int
    """The prompt's index in the RL step's batch (the same on every rank and layout): it keys the draws."""
    prompt_ids: list[int]
    """The prompt's token ids, chat template applied (ending where the completion starts)."""
    num_generations: int = 1
    """Completions of this prompt (GRPO's group size); generation indices 0 .. num_generations − 1."""
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    """The prompt's per-media inputs as its family's collator makes them for a batch of this one prompt
    (`pixel_values` with `image_grid_thw` or `image_sizes`; videos likewise), CPU tensors; empty: text only."""
    images: tuple[bytes, ...] = ()
    """The prompt's image files as bytes, in prompt order: an engine in another process (vLLM) processes them with
    its own processor, since vLLM takes raw images (or embeddings), not processed pixels; empty: none given."""

    def problem(self) -> str | None:
        """What is wrong with the request, in words; None when it can be generated."""
        if self.prompt_index < 0:
            return f"prompt_index {self.prompt_index} is negative"
        if not self.prompt_ids:
            return f"prompt {self.prompt_index} has no tokens"
        if self.num_generations < 1:
            return f"prompt {self.prompt_index}: num_generations {self.num_generations} must be at least 1"
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """One completion of one prompt."""

    prompt_index: int
    generation_index: int
    completion_ids: list[int]
    """The generated tokens, the stop token included when there is one."""
    logprobs: list[float]
    """Per completion token: its log-probability under the distribution it was sampled from (module docstring)."""
    finish_reason: FinishReason
    """"stop": it ends with a stop token; "length": it reached `max_new_tokens`."""
    weights_version: int
    """`weights_version` of the engine when it generated this (the training step whose weights it used)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What a training stage asks of a rollout engine, wherever it runs (module docstring)."""

    @property
    def weights_version(self) -> int:
        """The version of the weights `generate` uses (the `version` of the last `sync_weights`; 0 before)."""
        ...

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Generate from `model`'s current weights from now on (called by every rank after an optimizer step;
        an engine in another process copies them, the embedded engine uses them in place)."""
        ...

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams, step: int) -> list[Rollout]:
        """Completions of this rank's requests, per request its generations in order, requests in the order given.
        Every rank calls it with the same `sampling` and `step` (its draws are keyed by them)."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside the training processes (a server it launched); every rank."""
        ...


# -- sampling (pure functions) ------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x · c) mod 2³² for 0 <= x, c < 2³² without int64 overflow (x an int or an int64 tensor)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _MASK32


def _hash32(x):
    """Chris Wellons' `lowbias32`: a bijection of 32-bit integers with good avalanche (an int or int64 tensor)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix(key, value):
    return _hash32(key ^ _hash32(value))


def row_keys(seed: int, step: int, prompt_index: torch.Tensor, generation_index: torch.Tensor) -> torch.Tensor:
    """int64 `[R]` keys of the rows' draws from (seed, RL step, prompt index, generation index), all >= 0."""
    key = _mix(_mix(_mix(0x9E3779B9, seed & _MASK32), seed >> 32), step)
    return _mix(_mix(key, prompt_index.to(torch.int64)), generation_index.to(torch.int64))


def gumbel_from_hash(h: torch.Tensor) -> torch.Tensor:
    """fp32 standard Gumbel noise from 32-bit hashes: `u = (h >> 9 + ½) / 2²³`, `G = −log(−log u)`.

    23 bits, so that `u` is exact in fp32 and strictly inside (0, 1): u ∈ [2⁻²⁴, 1 − 2⁻²⁴], G ∈ [−2.8, 16.6]. (24
    bits, as this was first written, rounds the largest hash's `2²⁴ − ½` up to 2²⁴: u = 1, G = +∞, so that draw took
    whichever token the hash fell on, about one sampled token in a hundred at a 152k vocabulary, and a suppressed
    token's −∞ + ∞ = NaN won the argmax: a media placeholder in a completion.)"""
    u = ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def gumbel_noise(keys_R: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """fp32 `[R, V]` standard Gumbel noise for generated token `position` of each row, a pure function of
    (row key, position, vocabulary index): `gumbel_from_hash` of a 32-bit hash of the three."""
    vocab_V = _hash32(torch.arange(vocab_size, device=keys_R.device, dtype=torch.int64))
    return gumbel_from_hash(_hash32(_mix(keys_R, position)[:, None] ^ vocab_V[None, :]))


def warp_logits(logits_RV: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The scores sampled from: `logits / T`, then −inf outside the top-k, then outside the top-p set (transformers'
    `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`; vLLM's `apply_top_k_top_p`). T = 0: the raw
    logits (greedy). `suppress_token_ids` are −inf first, at any temperature."""
    scores = logits_RV.float()
    if sampling.suppress_token_ids:
        suppressed = torch.tensor(sampling.suppress_token_ids, device=scores.device)
        scores = scores.index_fill(-1, suppressed, float("-inf"))
    if sampling.temperature == 0:
        return scores
    scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_scores, order = torch.sort(scores, dim=-1)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        remove[..., -1] = False
        scores = scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return scores


def sample_tokens(
    logits_RV: torch.Tensor, sampling: SamplingParams, keys_R: torch.Tensor, position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens `[R]`, their fp32 log-probs `[R]`) for generated token `position` of each row: greedy at T = 0,
    else Gumbel-max over `warp_logits` with `gumbel_noise(keys_R, position)`; log-probs of the warped distribution."""
    scores = warp_logits(logits_RV, sampling)
    if sampling.temperature == 0:
        tokens = scores.argmax(dim=-1)
    else:
        tokens = (scores + gumbel_noise(keys_R, position, scores.shape[-1])).argmax(dim=-1)
    logprobs = scores.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


# -- the embedded engine --------------------------------------------------------------------------

_NO_PADDING_MASK = ("mmfsdp_npu_fusion",)
"""Attention backends that read no padding mask (`mmfsdp.model.attention`): left-padded prompts would attend to
their padding."""


def _concat_media(values: list[torch.Tensor]) -> torch.Tensor:
    """Per-media tensors of several prompts along dim 0; smaller trailing dims zero-padded at their end."""
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    if all(list(v.shape[1:]) == shape for v in values):
        return torch.cat(values)
    out = values[0].new_zeros((sum(len(v) for v in values), *shape))
    start = 0
    for v in values:
        out[(slice(start, start + len(v)), *(slice(0, n) for n in v.shape[1:]))] = v
        start += len(v)
    return out


def _prompt_batch(requests: list[RolloutRequest], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-padded `input_ids` and `attention_mask` `[P, S]` and the media keys of `requests` (CPU)."""
    length = max(len(r.prompt_ids) for r in requests)
    input_ids = torch.full((len(requests), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(requests), length), dtype=torch.long)
    media: dict[str, list[torch.Tensor]] = {}
    for i, request in enumerate(requests):
        n = len(request.prompt_ids)
        input_ids[i, length - n :] = torch.as_tensor(request.prompt_ids, dtype=torch.long)
        attention_mask[i, length - n :] = 1
        for key, value in request.media.items():
            media.setdefault(key, []).append(value)
    return {"input_ids": input_ids, "attention_mask": attention_mask, **{k: _concat_media(v) for k, v in media.items()}}


class HFRolloutEngine:
    """Generation inside the training processes from the live model (module docstring): a `RolloutEngine`.

    `model` is a family model (`TrainingForwardMixin`), sharded by FSDP2 or not; `group` is the process group
    whose ranks generate together (default: the world when a process group exists, else none). `gather_weights`:
    each FSDP2 group is all-gathered once per `generate` and kept gathered while decoding (`fsdp_gathered`: the
    whole unsharded model in memory meanwhile); False: gathered for each forward, one group at a time, as in
    training (one all-gather per group per generated token)."""

    def __init__(self, model: nn.Module, *, group: dist.ProcessGroup | None = None, pad_token_id: int = 0,
                 gather_weights: bool = True):
        backend = getattr(model.config, "_attn_implementation", None)
        if backend in _NO_PADDING_MASK:
            raise ValueError(
                f"attention backend {backend!r} reads no padding mask, and the hf rollout engine left-pads its "
                "prompts; use sdpa, eager or flash_attention_2 for generation"
            )
        self.model = model
        self.group = group
        self.pad_token_id = pad_token_id
        self.gather_weights = gather_weights
        self._weights_version = 0

    @property
    def weights_version(self) -> int:
        return self._weights_version

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """The embedded engine generates from `model` itself (FSDP2 gathers its current shards): nothing to copy."""
        self.model = model
        self._weights_version = version

    def close(self) -> None:
        """Nothing outside the training processes to release."""

    def _group(self) -> dist.ProcessGroup | None:
        if self.group is not None:
            return self.group
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def _all_ranks(self, flag: torch.Tensor) -> bool:
        """Whether `flag` (a 0-d bool tensor) holds on every rank of the group; one all-reduce and one host read."""
        group = self._group()
        value = flag.to(torch.int32).reshape(1)
        if group is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        return bool(value.item())

    def _check(self, requests: list[RolloutRequest], device: torch.device) -> None:
        """Raise on every rank together when any rank's requests are invalid (a rank raising alone would leave the
        others waiting in the prefill's collectives)."""
        problems = [p for p in map(RolloutRequest.problem, requests) if p is not None]
        if not self._all_ranks(torch.tensor(not problems, device=device)):
            raise ValueError(problems[0] if problems else "another rank's rollout requests are invalid")

    @torch.no_grad()
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams, step: int) -> list[Rollout]:
        requests = list(requests)
        model = self.model
        device = next(model.parameters()).device
        self._check(requests, device)
        placeholder = not requests
        if placeholder:  # this rank still makes every forward the others make
            requests = [RolloutRequest(prompt_index=0, prompt_ids=[self.pad_token_id])]
        counts = [r.num_generations for r in requests]
        prompt_of_row = torch.repeat_interleave(torch.arange(len(requests)), torch.tensor(counts))
        prompt_index = torch.tensor([r.prompt_index for r in requests])[prompt_of_row]
        generation_index = torch.cat([torch.arange(n) for n in counts])
        keys_R = row_keys(sampling.seed, step, prompt_index, generation_index).to(device, non_blocking=True)
        rows_P = prompt_of_row.to(device, non_blocking=True)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long).to(device, non_blocking=True)

        batch = {k: v.to(device, non_blocking=True) for k, v in _prompt_batch(requests, self.pad_token_id).items()}
        batch = model.prepare_inputs(batch, None)
        if batch.get("position_ids") is None:
            batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        mask = batch["attention_mask"].index_select(0, rows_P)
        positions = batch["position_ids"][..., -1:].index_select(-2, rows_P)

        was_training = model.training
        model.eval()
        try:
            with fsdp_gathered(model) if self.gather_weights else contextlib.nullcontext():
                # each FSDP2 group gathered once, for the prefill and every decode step after it
                outputs = model(**batch, use_cache=True, logits_to_keep=1)
                cache = outputs.cache
                cache.reorder_cache(rows_P)
                logits = outputs.logits[:, -1].index_select(0, rows_P)
                del outputs, batch
                num_rows = len(prompt_of_row)
                tokens = torch.zeros(num_rows, sampling.max_new_tokens, dtype=torch.long, device=device)
                logprobs = torch.zeros(num_rows, sampling.max_new_tokens, dtype=torch.float32, device=device)
                stopped = torch.full((num_rows,), placeholder, dtype=torch.bool, device=device)
                lengths = torch.full((num_rows,), sampling.max_new_tokens, dtype=torch.long, device=device)
                for t in range(sampling.max_new_tokens):
                    if t > 0:
                        mask = torch.cat([mask, mask.new_ones(num_rows, 1)], dim=1)
                        positions = positions + 1
                        logits = model(
                            input_ids=tokens[:, t - 1 : t], attention_mask=mask, position_ids=positions, cache=cache,
                            use_cache=True,
                        ).logits[:, -1]
                    tokens[:, t], logprobs[:, t] = sample_tokens(logits, sampling, keys_R, t)
                    ends = torch.isin(tokens[:, t], stop_ids) & ~stopped
                    lengths = torch.where(ends, t + 1, lengths)
                    stopped |= ends
                    if t + 1 == sampling.max_new_tokens or self._all_ranks(stopped.all()):
                        break
        finally:
            model.train(was_training)
        if placeholder:
            return []
        tokens_h, logprobs_h, lengths_h = tokens.tolist(), logprobs.tolist(), lengths.tolist()
        stop_set = set(sampling.stop_token_ids)
        rollouts = []
        for row, (p, g) in enumerate(zip(prompt_index.tolist(), generation_index.tolist())):
            n = lengths_h[row]
            completion = tokens_h[row][:n]
            rollouts.append(Rollout(
                prompt_index=p, generation_index=g, completion_ids=completion, logprobs=logprobs_h[row][:n],
                finish_reason="stop" if completion[-1] in stop_set else "length", weights_version=self._weights_version,
            ))
        return rollouts
