"""The held-out greedy reward of a `stage: grpo` run, at its validation steps (`training.val_interval`).

What an RL user watches besides the validation loss (`mmfsdp.train.evaluate.Evaluator.validation_loss`, the held-out
answers' cross-entropy): how well the policy answers held-out prompts when it does not sample. At each validation
step `HeldOutRewards` (`GRPOObjective.validation_metrics`, called by the evaluator on every rank):

1. reads the evaluation split as prompts (the run's data config, `attr.prompt_only`: prompt tokens, media, ground
   truth; built on first use), each data-parallel rank a strided share of it, `eval_batch_size` prompts a call;
2. completes each prompt once through the run's rollout engine at temperature 0 (greedy: argmax, no draw; the
   run's `max_completion_length` and stop tokens, media placeholders suppressed), on the weights after the step;
3. scores the completions with the run's reward functions against their ground truths;
4. sums the rewards (total and per function) and counts the prompts, all-reduced over the data-parallel group.

It gives `val_reward` (the mean weighted total) and `val_rewards/<function>/mean` (TRL's per-function names with the
`val_` prefix of `val_loss`), in the step's record and log line.

Collectives: every rank makes the same number of `generate` calls (ceil(prompts / dp_size / eval_batch_size)); a
rank whose share is shorter calls with no request, and the engine then runs its placeholder row (the engine's
forwards are FSDP2's all-gathers). The ranks of a context-parallel group share a data-parallel rank, so they
generate the same prompts in lockstep and are counted once. A prompt whose media fail to decode is skipped
(counted nowhere).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from mmfsdp.data import build_dataset
from mmfsdp.model.rollout import SamplingParams
from mmfsdp.train.grpo_engine import prompt_request

__all__ = ["HeldOutRewards", "PolicyArgmax", "greedy"]


class PolicyArgmax:
    """The stage's held-out accuracy as its policy decodes (`GRPOObjective.eval_metrics`, eval.json's
    `policy_accuracy`): the evaluator's exact match (every answer token the argmax, under teacher forcing) with the
    argmax taken over the tokens the rollout engine can emit, the media placeholders suppressed
    (`SamplingParams.suppress_token_ids`). The policy GRPO trains is that distribution (the sampler never draws a
    placeholder, and the loss's log-probs are of the renormalised kept mass), so a placeholder's logit is never
    trained down; greedy decoding through the engine (temperature 0, `greedy`) answers exactly when this counts a
    hit. eval.json's `accuracy` stays the argmax over the whole vocabulary (SFT's definition)."""

    num_sums = 2
    """Per batch: exact matches, samples."""

    def __init__(self, suppressed: tuple[int, ...]):
        self.suppressed = torch.tensor(suppressed, dtype=torch.long)

    def batch(self, batch: dict[str, Any], inputs: dict[str, Any], logits: torch.Tensor,
              targets: torch.Tensor) -> torch.Tensor:
        from mmfsdp.train.evaluate import exact_match

        kept = logits.index_fill(-1, self.suppressed.to(logits.device), float("-inf"))
        hits = exact_match(kept, targets)
        return torch.tensor([float(hits.sum()), float(hits.numel())], dtype=torch.float64)

    def result(self, sums: list[float]) -> dict[str, float]:
        hits, samples = sums
        return {"policy_accuracy": hits / max(samples, 1)}

    @staticmethod
    def describe(result: dict[str, Any]) -> str:
        return (f"policy accuracy {result['policy_accuracy']:.3f} (the argmax over the tokens the rollout engine "
                f"samples) on {result['num_samples']} held-out samples")


def greedy(sampling: SamplingParams) -> SamplingParams:
    """`sampling` at temperature 0 with top-k and top-p off: the argmax token at every step."""
    return dataclasses.replace(sampling, temperature=0.0, top_k=0, top_p=1.0)


class HeldOutRewards:
    """Steps 1-4 of the module docstring; `__call__` is a collective of every rank."""

    def __init__(self, *, data_cfg: Any, processor: Any, engine: Any, sampling: SamplingParams, rewards: Any,
                 reward_names: list[str], dims: Any, device: torch.device, batch_size: int,
                 media: Callable[[dict[str, Any]], dict[str, torch.Tensor]]):
        self.data_cfg = data_cfg
        self.processor = processor
        self.engine = engine
        self.sampling = greedy(sampling)
        self.rewards = rewards
        self.reward_names = reward_names
        self.dims = dims
        self.device = device
        self.batch_size = batch_size
        self.media = media
        self.dataset = None

    @torch.no_grad()
    def __call__(self, step: int) -> dict[str, float]:
        if self.dataset is None:
            self.dataset = build_dataset(self.data_cfg, self.processor, split="eval")
        dims, n = self.dims, len(self.dataset)
        indices = list(range(dims.dp_rank, n, dims.dp_size))
        num_calls = math.ceil(math.ceil(n / dims.dp_size) / self.batch_size)
        F = len(self.reward_names)
        sums = torch.zeros(2 + F, dtype=torch.float64)  # total, each function, prompts
        for call in range(num_calls):
            items = [self.dataset[i] for i in indices[call * self.batch_size : (call + 1) * self.batch_size]]
            items = [item for item in items if "bad_reason" not in item]
            requests = [prompt_request(item, self.media(item)) for item in items]
            rollouts = self.engine.generate(requests, self.sampling, step)
            if not items:
                continue
            texts = [self.processor.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
            totals, per_function, _ = self.rewards.score(
                texts, [item["solution"] for item in items], [item["prompt_text"] for item in items])
            sums[0] += totals.double().sum()
            sums[1 : 1 + F] += per_function.double().sum(dim=1)
            sums[1 + F] += len(items)
        sums = sums.to(self.device)
        if dims.dp_size > 1:
            dist.all_reduce(sums, group=dims.dp_group)
        sums = sums.cpu()
        count = max(float(sums[1 + F]), 1.0)
        return {"val_reward": float(sums[0]) / count,
                **{f"val_rewards/{name}/mean": float(sums[1 + f]) / count for f, name in enumerate(self.reward_names)}}
