"""The GRPO family's loss and advantages equal TRL's `GRPOTrainer` (`trl==1.16.0`, the dev group's pin; issue 45).

- `test_policy_objective_equals_trl_loss`: `mmfsdp.model.rl.policy_objective` against TRL's loss code
  (`GRPOTrainer._compute_loss`, driven with a stand-in model that returns given per-token log-probabilities and
  entropies, as `tests/test_dpo_trl.py` drives `DPOTrainer._compute_loss`) for every loss type (`grpo`, `bnpo`,
  `dr_grpo`, `dapo`), β 0 and 0.04, token and sequence (GSPO) importance sampling, on-policy (`num_iterations: 1`,
  TRL's detached current log-probabilities) and off-policy (`num_iterations: 2`, given old log-probabilities far
  enough from the current ones to clip) with symmetric clipping, DAPO's clip-higher (`epsilon_high`) and
  INTELLECT-2's two-sided clipping (`delta`): the loss, every statistic TRL logs and the gradient with respect to
  the per-token log-probabilities, within 1e-5 relative in fp32. TRL runs with two gradient-accumulation steps and
  a `num_items_in_batch` larger than this micro-batch's tokens, ours with the matching global normalisers (this
  micro-batch is one of two of the step, the other holding as many sequences and 13 more tokens): the shares of
  `mmfsdp.model.rl`'s docstring.
- `test_sampling_correction_equals_trl`: TRL's vLLM importance-sampling correction (`vllm_importance_sampling_*`,
  each of its 4 modes) against `sampling_correction` and `policy_objective` with engine log-probabilities: TRL's
  weight and `sampling/importance_sampling_ratio/*` from `_generate_and_score_completions` (its `use_vllm` path,
  rollout and old-policy forward replaced by given values), its loss and gradient from `_compute_loss`; 1e-5 relative.
- `test_group_advantages_equal_trl`: `group_advantages` against TRL's `_generate_and_score_completions` (its
  rollout replaced by fixed completions; a reward function that returns each row's given reward) for
  `scale_rewards` group, batch and none, with `zero_std_groups` against its `frac_reward_zero_std` and
  `truncated_completions` / `mask_truncated` against its `mask_truncated_completions`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mmfsdp.model.rl import (
    SAMPLING_CORRECTION_MODES,
    group_advantages,
    mask_truncated,
    policy_objective,
    policy_stats,
    sampling_correction,
    truncated_completions,
    zero_std_groups,
)
from mmfsdp.model.testing import assert_close

TOL = 1e-5
BETA = 0.04
VOCAB = 64
PAD_ID, EOS_ID = 0, 2
NUM_GENERATIONS = 4
LENGTHS = (7, 3, 5, 0, 1, 7, 6, 2)
"""Completion lengths of the 8 sequences (two groups of 4): full, short, empty and one-token completions."""
PROMPT_LEN = 3
MAX_COMPLETION_LENGTH = 9
ACCUMULATION = 2
"""TRL's gradient-accumulation steps; ours: this micro-batch is one of `ACCUMULATION` of the step."""
OTHER_TOKENS = 13
"""Trained tokens of the step's other micro-batch (in TRL's `num_items_in_batch`)."""
CLIPS = {
    "symmetric": {"epsilon": 0.2},
    "clip_higher": {"epsilon": 0.2, "epsilon_high": 0.28},
    "two_sided": {"epsilon": 0.2, "epsilon_high": 0.28, "delta": 1.3},
    "no_kl_correction": {"epsilon": 0.2, "use_bias_correction_kl": False},
}
"""TRL `GRPOConfig` clipping keywords; ours are the same but `use_bias_correction_kl` -> `kl_bias_correction`."""
STATS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
         "clip_ratio/low_min", "clip_ratio/high_max")


def tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token=f"t{PAD_ID}", eos_token=f"t{EOS_ID}"
    )


def row_reward(completions, reward, **kwargs):
    """TRL reward function: each row's `reward` column."""
    return reward


def grpo_trainer(tmp_path, **config):
    """A `GRPOTrainer` on the CPU with a tiny Llama (never run: `_compute_loss` gets a stand-in model and the
    rollout is replaced) and a word-level tokenizer; the model goes by a directory, where TRL loads the reference
    from when β > 0."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    ).save_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=len(LENGTHS), num_generations=NUM_GENERATIONS,
        max_completion_length=MAX_COMPLETION_LENGTH, **config,
    )
    dataset = Dataset.from_dict({"prompt": ["t3 t4"] * 2, "reward": [0.0, 1.0]})
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=row_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer())
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # as Trainer's loop sets them
    trainer.model.train()
    return trainer


class TokenLogps:
    """A stand-in for a model with TRL's fused LM head: given per-token log-probabilities and entropies of the
    completion positions `[B, C]`, returned after `P` prompt positions (TRL keeps the last `C`)."""

    def __init__(self, log_probs: torch.Tensor, entropy: torch.Tensor, prompt_len: int):
        self.log_probs, self.entropy, self.prompt_len = log_probs, entropy, prompt_len

    def __call__(self, input_ids, **kwargs):
        pad = torch.zeros(self.log_probs.shape[0], self.prompt_len)
        return SimpleNamespace(log_probs=torch.cat([pad, self.log_probs], dim=1),
                               entropy=torch.cat([pad, self.entropy], dim=1))


def rollout(seed: int = 5):
    """Per-token log-probabilities of the policy (a leaf `values` of the trained tokens scattered into `[B, C]`),
    the old policy's and the reference's (each off by N(0, 0.35) per token), entropies, advantages, the mask."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    trained = mask.bool()

    def scattered(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(mask.shape).masked_scatter(trained, values)

    values = (-3 * torch.rand(int(trained.sum()), generator=generator)).requires_grad_()
    detached = values.detach()
    return SimpleNamespace(
        values=values,
        logps=scattered(values),
        old=scattered(detached + 0.35 * torch.randn(values.shape, generator=generator)),
        ref=scattered(detached + 0.35 * torch.randn(values.shape, generator=generator)),
        entropies=scattered(2 * torch.rand(values.shape, generator=generator)),
        advantages=torch.randn(len(LENGTHS), generator=generator),
        mask=mask,
    )


CASES = [
    (loss_type, beta, level, policy, clip)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")
    for beta in (0.0, BETA)
    for level in ("token", "sequence")
    for policy, clips in (("on_policy", ("symmetric",)), ("num_iterations_2", tuple(CLIPS)))
    for clip in clips
    if clip != "no_kl_correction" or beta
]


def _trl_inputs(data, batch: int, length: int, num_items: int) -> dict:
    """TRL's `_compute_loss` inputs for `data`'s completions (random prompt and completion ids: the stand-in model's
    log-probs do not read them)."""
    return {
        "prompt_ids": torch.randint(3, VOCAB, (batch, PROMPT_LEN)),
        "prompt_mask": torch.ones(batch, PROMPT_LEN, dtype=torch.long),
        "completion_ids": torch.randint(3, VOCAB, (batch, length)),
        "completion_mask": data.mask,
        "advantages": data.advantages,
        "num_items_in_batch": torch.tensor(num_items),
    }


@pytest.mark.parametrize(("loss_type", "beta", "level", "policy", "clip"), CASES)
def test_policy_objective_equals_trl_loss(loss_type, beta, level, policy, clip, tmp_path):
    off_policy = policy == "num_iterations_2"
    data = rollout()
    batch, length = data.mask.shape
    num_items = int(data.mask.sum()) + OTHER_TOKENS
    trainer = grpo_trainer(
        tmp_path, loss_type=loss_type, beta=beta, importance_sampling_level=level,
        num_iterations=2 if off_policy else 1, gradient_accumulation_steps=ACCUMULATION, **CLIPS[clip],
    )
    inputs = _trl_inputs(data, batch, length, num_items)
    if off_policy:
        inputs["old_per_token_logps"] = data.old
    if beta:
        inputs["ref_per_token_logps"] = data.ref
    their_loss = trainer._compute_loss(TokenLogps(data.logps, data.entropies, PROMPT_LEN), inputs)
    (their_grad,) = torch.autograd.grad(their_loss, data.values, retain_graph=True)
    logged = trainer._metrics["train"]

    ours = {key.replace("use_bias_correction_kl", "kl_bias_correction"): value for key, value in CLIPS[clip].items()}
    loss, terms = policy_objective(
        data.logps, data.advantages, data.mask,
        old_logps=data.old if off_policy else None, ref_logps=data.ref if beta else None, entropies=data.entropies,
        beta=beta, importance_sampling_level=level, loss_type=loss_type,
        num_sequences_global=ACCUMULATION * batch, num_tokens_global=num_items, num_batches_global=ACCUMULATION,
        max_completion_length=MAX_COMPLETION_LENGTH, **ours,
    )
    (our_grad,) = torch.autograd.grad(loss, data.values)
    stats = policy_stats(terms.names, terms.sums, terms.counts, terms.extremes)

    diffs = {"loss": assert_close(loss, their_loss, TOL, "loss")}
    assert their_grad.abs().max() > 0
    diffs["grad"] = assert_close(our_grad, their_grad, TOL, "grad of the token log-probabilities")
    expected = [name for name in STATS if name != "kl" or beta]
    assert sorted(stats) == sorted(expected) and all(name in logged for name in expected)
    for name in expected:
        diffs[name] = assert_close(torch.tensor(stats[name]), torch.tensor(logged[name][-1]), TOL, name)
    if off_policy and clip != "no_kl_correction":
        assert logged["clip_ratio/region_mean"][-1] > 0, "the old policy should be far enough away to clip"
    worst = max(diffs, key=diffs.get)
    print(f"worst: {worst} {diffs[worst]:.3g} (bound {TOL:g})")


ROLLOUT_COMPLETIONS = [
    [5, 6, EOS_ID], [7, 8, 9, 10], [11, PAD_ID], [12],
    [13, 14, 15, EOS_ID], [16], [17, 18], [19, 20, EOS_ID],
    [21, EOS_ID], [22, 23, 24], [25, 26, 27, 28], [29, EOS_ID],
]
"""Three groups of four completions; those not ending in eos or pad were truncated."""
REWARDS = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.25, 2.0, -1.0, 0.5]
"""A group with all-equal rewards (zero std), a binary one, a graded one."""


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale_rewards, tmp_path):
    trainer = grpo_trainer(tmp_path, scale_rewards=scale_rewards, mask_truncated_completions=True)
    prompt_ids = [[3, 4]] * len(ROLLOUT_COMPLETIONS)
    completions = [" ".join(f"t{i}" for i in ids) for ids in ROLLOUT_COMPLETIONS]
    trainer._generate = lambda prompts: (prompt_ids, ROLLOUT_COMPLETIONS, None, completions, None, None, None, None)
    theirs = trainer._generate_and_score_completions(
        [{"prompt": "t3 t4", "reward": reward} for reward in REWARDS]
    )

    rewards = torch.tensor(REWARDS)
    assert_close(group_advantages(rewards, NUM_GENERATIONS, scale_rewards), theirs["advantages"], TOL, "advantages")
    if scale_rewards != "batch":
        zero = zero_std_groups(rewards, NUM_GENERATIONS)
        assert zero.tolist() == [True, False, False]
        assert zero.float().mean().item() == trainer._metrics["train"]["frac_reward_zero_std"][-1]
    full_mask = torch.zeros_like(theirs["completion_mask"])
    for row, ids in enumerate(ROLLOUT_COMPLETIONS):
        full_mask[row, : len(ids)] = 1
    truncated = truncated_completions(ROLLOUT_COMPLETIONS, [*trainer.eos_token_ids, PAD_ID])
    assert truncated.any() and not truncated.all()
    assert torch.equal(mask_truncated(full_mask, truncated), theirs["completion_mask"])


SAMPLING_CASES = [
    *((mode, "dapo", 0.0, "on_policy", None, 3.0) for mode in SAMPLING_CORRECTION_MODES),  # TRL's defaults
    *((mode, "grpo", BETA, "num_iterations_2", 0.5, 2.0) for mode in SAMPLING_CORRECTION_MODES),
    ("token_truncate", "bnpo", 0.0, "on_policy", 0.8, 1.25),
    ("sequence_mask", "dr_grpo", BETA, "on_policy", None, None),
]
"""(mode, loss type, β, policy, C_min, C_max) of TRL's vLLM importance-sampling correction."""
SAMPLING_STATS = ("min", "mean", "max")


@pytest.mark.parametrize(("mode", "loss_type", "beta", "policy", "clip_min", "clip_max"), SAMPLING_CASES)
def test_sampling_correction_equals_trl(mode, loss_type, beta, policy, clip_min, clip_max, tmp_path):
    """TRL's weight comes from `_generate_and_score_completions` (its `use_vllm` path, the rollout replaced by the
    completions with given engine log-probabilities, its old-policy forward by given log-probabilities), its loss
    from `_compute_loss` with that weight; ours from `policy_objective` with the engine log-probabilities."""
    off_policy = policy == "num_iterations_2"
    data = rollout()
    batch, length = data.mask.shape
    generator = torch.Generator().manual_seed(11)
    engine = data.logps.detach() + 0.6 * torch.randn(data.mask.shape, generator=generator)
    engine[0, 1] -= 2.0  # a token the engine finds far less likely than the trainer (weight > 3), and the reverse
    engine[5, 2] += 2.0
    engine = engine * data.mask
    old = data.old if off_policy else data.logps.detach()
    num_items = int(data.mask.sum()) + OTHER_TOKENS
    trainer = grpo_trainer(
        tmp_path, loss_type=loss_type, beta=beta, num_iterations=2 if off_policy else 1,
        gradient_accumulation_steps=ACCUMULATION, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
        vllm_importance_sampling_clip_max=clip_max,
    )
    trainer.use_vllm = True  # the correction's code path; the rollout itself is replaced
    completion_ids = [list(range(3, 3 + n)) for n in LENGTHS]
    engine_lists = [engine[row, :n].tolist() for row, n in enumerate(LENGTHS)]
    trainer._generate = lambda prompts: ([[3, 4]] * batch, completion_ids, None, ["t3"] * batch, engine_lists,
                                         None, None, None)
    trainer._get_per_token_logps_and_entropies = lambda model, *args, **kwargs: (
        (old if model is trainer.model else data.ref), None, None)
    generated = trainer._generate_and_score_completions([{"prompt": "t3 t4", "reward": 1.0}] * batch)
    del trainer._get_per_token_logps_and_entropies  # `_compute_loss` runs the stand-in model through it
    theirs_weight = generated["importance_sampling_ratio"]
    inputs = {
        **_trl_inputs(data, batch, length, num_items),
        "old_per_token_logps": old,
        "importance_sampling_ratio": theirs_weight,
    }
    if beta:
        inputs["ref_per_token_logps"] = data.ref
    their_loss = trainer._compute_loss(TokenLogps(data.logps, data.entropies, PROMPT_LEN), inputs)
    (their_grad,) = torch.autograd.grad(their_loss, data.values, retain_graph=True)
    logged = trainer._metrics["train"]

    correction = {"sampling_correction_mode": mode, "sampling_clip_min": clip_min, "sampling_clip_max": clip_max}
    weight = sampling_correction(old, engine, data.mask, mode, clip_min, clip_max)
    loss, terms = policy_objective(
        data.logps, data.advantages, data.mask, old_logps=data.old if off_policy else None,
        ref_logps=data.ref if beta else None, entropies=data.entropies, beta=beta, loss_type=loss_type,
        num_sequences_global=ACCUMULATION * batch, num_tokens_global=num_items, num_batches_global=ACCUMULATION,
        max_completion_length=MAX_COMPLETION_LENGTH, engine_logps=engine, **correction,
    )
    (our_grad,) = torch.autograd.grad(loss, data.values)
    stats = policy_stats(terms.names, terms.sums, terms.counts, terms.extremes)

    diffs = {"weight": assert_close(weight, theirs_weight, TOL, "importance weight")}
    bounded = [bound for bound in (clip_min, clip_max) if bound is not None]
    outside = (weight == 0) if mode.endswith("mask") else torch.isin(weight, torch.tensor(bounded))
    assert not bounded or outside.any(), "some weight should reach a bound"
    diffs["loss"] = assert_close(loss, their_loss, TOL, "loss")
    diffs["grad"] = assert_close(our_grad, their_grad, TOL, "grad of the token log-probabilities")
    for name in (f"sampling/importance_sampling_ratio/{stat}" for stat in SAMPLING_STATS):
        diffs[name] = assert_close(torch.tensor(stats[name]), torch.tensor(logged[name][-1]), TOL, name)
    for name in (name for name in STATS if name != "kl" or beta):
        diffs[name] = assert_close(torch.tensor(stats[name]), torch.tensor(logged[name][-1]), TOL, name)
    worst = max(diffs, key=diffs.get)
    print(f"worst: {worst} {diffs[worst]:.3g} (bound {TOL:g})")
