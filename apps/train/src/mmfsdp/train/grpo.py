"""`stage: grpo`: online RL with the GRPO family of losses, an objective of `mmfsdp.train.objective`.

The loader hands each rank `micro_batch_size` whole prompts per micro-batch (`mmfsdp.data.PromptDataset`: prompt
tokens, media, ground truth); a group (a prompt's `num_generations` completions) is therefore whole on one rank.
`GRPOObjective.start_step` turns the step's prompt micro-batches into its training micro-batches:

1. generation: every rank calls the rollout engine (`mmfsdp.model.rollout`, `training.grpo.rollout.engine`) with its
   prompts, in lockstep (the engine's collectives); the draws are keyed by (seed, generation index, prompt index,
   generation), the prompt index being the prompt's dataset index, so the completions do not depend on the layout;
2. rewards: this rank's completions (decoded, special tokens skipped) are scored against their ground truths by the
   run's `RewardSet` (`mmfsdp.data.rewards`, `training.grpo.reward_funcs`);
3. the step's table: every rank's per-completion rewards (total and per function), lengths and truncation flags are
   all-gathered (a few numbers per completion), so advantages (`mmfsdp.model.rl.group_advantages`, TRL's, with the
   batch std over the global batch for `scale_rewards: batch`), the global normalisers (sequences, trained tokens)
   and the reward and length statistics are computed from the same global numbers on every rank;
4. training micro-batches: micro-batch i holds the completions of the prompts of prompt micro-batch i, each
   sequence prompt + completion with labels on the completion (zeroed for a truncated completion with
   `mask_truncated_completions`), collated by the family's collator as the run's layout says (padded or
   padding-free); the host works out, once, where each completion's tokens lie in the batch
   (`mmfsdp.train.grpo_batches`).

With `dynamic_sampling` (DAPO's; `mmfsdp.train.grpo_sampling`) steps 1-3 run in rounds: groups whose rewards do not
vary are dropped and every rank draws the loader's next prompts (`ObjectiveContext.draw_step`) until the step has
as many varying groups as its first round had prompts, or the rounds run out; the groups are chosen in one global
order from the gathered table, so every rank and layout keeps the same ones. Each rank trains its own kept groups,
spread evenly over the number of micro-batches the fullest rank needs (`Generation.chunks`; a filler on a rank with
too few). Advantages and normalisers are over the kept groups; the reward and length statistics over every
completion generated.

`micro_batch` runs the policy forward in its per-token mode (`mmfsdp.model.training_forward`, step 8: log-probs of
`logits / temperature` over the whole vocabulary, TRL's, and entropies), the reference's the same way when β > 0
(`mmfsdp.train.references`: the one live-reference rule, DPO's), and returns its share of
`mmfsdp.model.rl.policy_objective`. `stats()` gives TRL's metric names and definitions, and
`rollout/logprob_diff_max`: the largest |engine sampling log-prob − trainer log-prob of the sampled distribution|
over the step's trained tokens, both from the weights before the update (the sampled distribution never draws a
media placeholder: the trainer's log-prob minus `.kept_logmass`; with top-k / top-p on they still differ by the log
of the mass those keep, docs/rl.md ("Rollout engines")). With `vllm_importance_sampling_correction` the policy term
is weighted by TRL's sampling correction from the old policy's and the engine's log-probabilities
(`TrainingPlan.engine_logps`; `mmfsdp.model.rl.sampling_correction`), logged as `sampling/importance_sampling_ratio/*`.

`num_iterations` (TRL's μ): each generation batch (`Generation`) trains `num_iterations` optimizer steps. Step s
generates when (s − 1) % μ = 0, its draws keyed by the generation index (s − 1) // μ + 1 (the step when μ = 1);
the following μ − 1 steps take nothing from the loader (`needs_batch`) and train on the same micro-batches,
advantages and normalisers. The old policy's log-probabilities are those of the weights that generated the batch:
TRL computes them with an extra no-grad forward before the first update; here the first iteration's forward runs on
exactly those weights, so its log-probabilities, detached, are kept per micro-batch (`Generation.old_logps`; on that
iteration the ratio is 1, TRL's shortcut for μ = 1) and the later iterations' ratios use them; the reference's
log-probabilities are kept the same way (TRL computes them once per generation batch too). A checkpoint taken inside
a generation batch holds it in this rank's state (`state_dict`: prompts, completions, rewards table, the kept
log-probabilities; the micro-batches are rebuilt from them), so a resumed run continues bitwise; with another world
size it cannot be restored and the next step generates a new batch (a warning).

Context parallel: the ranks of a CP group receive the same prompts (one data stream), so they generate the same
completions in lockstep on the whole model and build the same training micro-batches (the collator pads each packed
completion to CP's multiple). The per-token forward computes the log-probs on each rank's shard and all-gathers them
over the CP group (`mmfsdp.model.training_forward`, step 8), so every CP rank computes the same share of the
objective: it returns the share × `1 / cp_size` (the gather's backward sums the gradients over the group, and the
trainer sums the reported loss over all ranks). The rewards table, normalisers and statistics are gathered over
the data-parallel ranks only.

Chunk loss: the same per-token values from the hidden states, chunk by chunk (`mmfsdp.model.chunk_loss`), with or
without context parallel. LoRA: with β > 0 the reference is the policy with its adapters off. Expert parallel: the
family's step terms (router aux loss) are added by the trainer as in SFT.

Validation: `val_loss` on the held-out split as SFT rows (`eval_data`), the greedy reward (`validation_metrics`,
`mmfsdp.train.grpo_validation`); at the end eval.json's `policy_accuracy` beside `accuracy` (the exact match with
the argmax over the tokens the engine samples, `eval_metrics`).

A token budget packs each rank's kept sequences after generation, and balanced steps (`data.dataloader_param.balance`)
plan the kept completions of all ranks over the ranks by the cost model and move them (`grpo_sampling`); the loader
hands whole prompts in order either way (`loader_plan`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist

from mmfsdp.config import ConfigError, get_logger, warn_once
from mmfsdp.data.balance import CostModel
from mmfsdp.data.rewards import build_rewards
from mmfsdp.model.rl import (POLICY_EXTREME_STATS, SAMPLING_RATIO_MEAN, group_advantages, policy_objective,
                              sequence_mean_stats, zero_std_groups)
from mmfsdp.model.rollout import SamplingParams
from mmfsdp.train.grpo_batches import TrainingPlan, training_plan, training_sequence
from mmfsdp.train.grpo_engine import build_rollout_engine, kv_cache_term, prompt_request, sync_stats
from mmfsdp.train.grpo_sampling import (
    Generation, Round, balanced_share, budget_chunks, equal_chunks, gather_columns, group_owners, kept_layout,
    micro_batch_count, round_order, sample_rounds, split_evenly, write_completions,
)
from mmfsdp.train.grpo_validation import HeldOutRewards, PolicyArgmax
from mmfsdp.train.objective import MemoryTerm, Objective, ObjectiveContext
from mmfsdp.train.references import LIVE_REFERENCES, frozen_copy_bytes, live_reference_kind
from mmfsdp.train.supervise import beat

__all__ = ["GRPOObjective", "COMPLETIONS_FILE"]

log = get_logger("mmfsdp.train")

COMPLETIONS_FILE = "completions.jsonl"
PROMPT_META = ("prompt_index", "solution", "prompt_text", "image_paths")
"""Keys of a `PromptDataset` item that are not the family's sample keys."""
POLICY_MEANS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                SAMPLING_RATIO_MEAN)


class GRPOObjective(Objective):
    """`stage: grpo` (module docstring)."""

    stage = "grpo"

    @classmethod
    def configure(cls, cfg) -> None:
        # a GRPO run reads prompts: a row is a prompt and its ground truth
        cfg.data.dataset_param.attr.prompt_only = True

    @classmethod
    def eval_data(cls, data_cfg) -> Any:
        """The held-out split read as SFT rows (the prompt and its answer), not as prompts: a prompt trains no
        token, so its exact match would count nothing. The held-out accuracy is then SFT's and DPO's, the greedy
        answer's exact match of the row's answer; it needs eval rows that end with their answer."""
        param = data_cfg.dataset_param
        attr = dataclasses.replace(param.attr, prompt_only=False)
        return dataclasses.replace(data_cfg, dataset_param=dataclasses.replace(param, attr=attr))

    @classmethod
    def check_config(cls, cfg) -> None:
        t, g = cfg.training, cfg.training.grpo
        planner = ("training.micro_batch_tokens" if t.micro_batch_tokens is not None
                   else "data.dataloader_param.balance" if cfg.data.dataloader_param.balance else None)
        if planner and g.loss_type == "bnpo":
            raise ConfigError("training.grpo.loss_type", f"bnpo averages each micro-batch's token mean, and {planner} "
                              "decides the micro-batches: use dapo, grpo or dr_grpo, or leave that setting off")
        if cfg.data.dataset_param.attr.ranking:
            raise ConfigError("data.dataset_param.attr.ranking", "grpo reads prompts (attr.prompt_only), not pairs; "
                                                                 "set it false")
        if cfg.data.dataset_param.preprocess_parameters.train_on_prompt:
            raise ConfigError("data.dataset_param.preprocess_parameters.train_on_prompt",
                              "grpo trains on completions only; set it false")
        attr = cfg.data.dataset_param.attr
        unsent = [f"attr.{kind}" for kind in ("videos", "audios") if getattr(attr, kind)]
        if g.rollout.engine == "vllm" and unsent:
            raise ConfigError(
                "training.grpo.rollout.engine",
                f"the vllm engine sends a prompt's images only, and the data reads {' and '.join(unsent)}: use "
                "engine hf for prompts with videos or audio, or drop those columns",
            )
        if g.beta and live_reference_kind(t) == "lora" and t.lora.pretrained_lora_path:
            raise ConfigError(
                "training.grpo.beta",
                "a run that continues a trained adapter (training.lora.pretrained_lora_path) with LoRA has the base "
                "model without that adapter as its live reference; a reference with the adapter is not done yet: set "
                "beta: 0",
            )
        for i, spec in enumerate(g.reward_funcs):
            if isinstance(spec, dict) and "name" not in spec:
                raise ConfigError(f"training.grpo.reward_funcs[{i}].name", "missing")
        build_rewards(cls._reward_specs(g), key="training.grpo.reward_funcs").close()

    @classmethod
    def loader_plan(cls, cfg) -> tuple[Any, int | None]:
        """Whole prompts in order, `micro_batch_size` a micro-batch: the budget and balance plan the completions."""
        loader = dataclasses.replace(cfg.data.dataloader_param, balance=False)
        return dataclasses.replace(cfg.data, dataloader_param=loader), None

    @classmethod
    def sequence_shape(cls, cfg) -> tuple[int, int]:
        """A prompt brings `num_generations` sequences of prompt (≤ `cutoff_len`) + completion tokens."""
        g = cfg.training.grpo
        return g.num_generations, cfg.data.dataset_param.preprocess_parameters.cutoff_len + g.max_completion_length

    @classmethod
    def memory_terms(cls, cfg, model: torch.nn.Module, shard_size: int) -> list[MemoryTerm]:
        terms = kv_cache_term(cfg, model)
        if cfg.training.grpo.beta and live_reference_kind(cfg.training) == "frozen":
            size = frozen_copy_bytes(cfg, model, shard_size)
            terms.append(MemoryTerm("reference", "GRPO reference", size, f"frozen copy, {cfg.model.dtype} / {shard_size}"))
        return terms

    @staticmethod
    def _reward_specs(g) -> list[Any]:
        specs = [dict(spec) if isinstance(spec, dict) else {"name": spec} for spec in g.reward_funcs]
        if g.reward_weights is not None:
            for spec, weight in zip(specs, g.reward_weights):
                spec["weight"] = weight
        return specs

    @classmethod
    def build(cls, ctx: ObjectiveContext) -> GRPOObjective:
        if not getattr(ctx.train_dataset, "is_prompt", False):
            raise ConfigError("training.stage", "grpo needs prompt data (data.dataset_param.attr.prompt_only: true)")
        g = ctx.cfg.training.grpo
        reference = LIVE_REFERENCES[live_reference_kind(ctx.cfg.training)].build(ctx) if g.beta else None
        engine = build_rollout_engine(ctx, frozenset(ctx.train_dataset.encoder.plugin.image_token_ids))
        return cls(ctx, engine, reference)

    def __init__(self, ctx: ObjectiveContext, engine, reference):
        self.g = ctx.cfg.training.grpo
        self.dims = ctx.dims
        self.cp_share = 1.0 / max(1, ctx.dims.cp_size)  # every CP rank holds the whole micro-batch's share
        self.device = ctx.device
        self.rank = ctx.rank
        self.output_dir = ctx.output_dir
        self.model = ctx.model
        self.engine = engine
        self.reference = reference
        self.step = ctx.step
        self._synced = False  # whether this process has synced the engine yet (`rollout.sync_interval`)
        self._lag = 0  # optimizer steps between the policy and the engine's weights at the last generation
        self.draw_step = ctx.draw_step
        self.micro_batch_size = ctx.cfg.training.micro_batch_size
        self.budget = ctx.cfg.training.micro_batch_tokens
        self.balance = ctx.cfg.data.dataloader_param.balance
        self._dataset = ctx.train_dataset  # a balanced step reads the prompts it did not generate from again
        if self.budget is not None or self.balance:  # prompt tokens and vision work by dataset index (as SFT's)
            self._cost_model = CostModel.load(ctx.cfg.data.dataloader_param.cost_model)
            self._prompt_stats = ctx.train_dataset.sample_stats()
            self._vision = self._cost_model.vision_tokens(self._prompt_stats)
        self._budget_bins = 0  # this rank's micro-batches within the budget before the ranks run M (tests read it)
        encoder = ctx.train_dataset.encoder
        self.tokenizer = encoder.processor.tokenizer
        self.plugin = encoder.plugin
        self.collator = ctx.train_collator.collator
        self.sampling = SamplingParams(
            max_new_tokens=self.g.max_completion_length, temperature=self.g.temperature, top_p=self.g.top_p,
            top_k=self.g.top_k, stop_token_ids=tuple(encoder.stop_token_ids()), seed=ctx.cfg.training.seed,
            suppress_token_ids=tuple(self.plugin.image_token_ids),  # completions are text (rollout.SamplingParams)
        )
        self._suppressed = torch.tensor(self.sampling.suppress_token_ids, dtype=torch.long, device=self.device)
        self.rewards = build_rewards(self._reward_specs(self.g), key="training.grpo.reward_funcs",
                                     num_workers=self.g.reward_workers)
        self.reward_names = [_metric_name(name) for name in self.rewards.names]
        self.held_out = HeldOutRewards(
            data_cfg=ctx.cfg.data, processor=ctx.evaluator.processor, engine=engine, sampling=self.sampling,
            rewards=self.rewards, reward_names=self.reward_names, dims=ctx.dims, device=ctx.device,
            batch_size=ctx.cfg.training.eval_batch_size, media=self._media)
        self._plans: list[TrainingPlan] = []
        self._stats: dict[str, torch.Tensor] = {}
        self._num_sequences = torch.ones((), device=self.device)
        self._num_tokens = torch.ones((), device=self.device)
        self._num_batches = 1
        self._policy = torch.zeros(len(POLICY_MEANS), device=self.device)
        self._extremes = torch.zeros(len(POLICY_EXTREME_STATS), device=self.device)
        self._names: tuple[str, ...] = ()
        self._correction = self.g.correction_terms()  # {} when off
        self._sequence_means = sequence_mean_stats(self.g.importance_sampling_level,
                                                   self._correction.get("sampling_correction_mode"))
        self._any_trained = True
        self._generation: Generation | None = None
        if self.step % self.g.num_iterations:  # resumed inside a generation batch
            self._generation = self._restore((ctx.state or {}).get("generation"))

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generation batch while steps remain on it (after step s with s % num_iterations != 0): its prompts,
        completions, rewards table and the first iteration's log-probs, on the CPU; else nothing."""
        g = self._generation
        if g is None or self.step % self.g.num_iterations == 0:
            return {}
        saved = {field.name: getattr(g, field.name) for field in dataclasses.fields(Generation)}
        saved.update(old_logps=[_moved(t, "cpu") for t in g.old_logps],
                     ref_logps=[_moved(t, "cpu") for t in g.ref_logps], diff_max=g.diff_max.cpu(),
                     diff_sum=g.diff_sum.cpu())
        return {"generation": {**saved, "num_generations": self.g.num_generations}}

    def _restore(self, saved: dict[str, Any] | None) -> Generation | None:
        """The generation batch of a checkpoint taken inside it, with its training micro-batches rebuilt; None (a
        warning: the next step generates a new batch) when the checkpoint has none for this rank."""
        fields = dataclasses.fields(Generation)
        names = [f.name for f in fields if f.default is dataclasses.MISSING or f.name in (saved or {})]
        if not saved or saved["num_generations"] != self.g.num_generations or not set(names) <= set(saved):
            log.warning(f"the checkpoint of step {self.step} was taken inside a generation batch "
                        f"(num_iterations: {self.g.num_iterations}) but does not hold it for this rank (another world "
                        "size or num_generations, a run with fewer iterations, or a checkpoint from before dynamic "
                        f"sampling): step {self.step + 1} generates a new batch")
            return None
        generation = Generation(**{name: saved[name] for name in names})
        generation.old_logps = [_moved(t, self.device) for t in generation.old_logps]
        generation.ref_logps = [_moved(t, self.device) for t in generation.ref_logps]
        generation.diff_max, generation.diff_sum = generation.diff_max.to(self.device), generation.diff_sum.to(self.device)
        self._build(generation)
        return generation

    # -- the step ------------------------------------------------------------------------------------------------
    @staticmethod
    def _sample(item: dict[str, Any]) -> dict[str, Any]:
        """A prompt item's keys of the family's samples."""
        return {k: v for k, v in item.items() if k not in PROMPT_META}

    def _media(self, item: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The rollout request's media: the family collator's media keys of the item alone."""
        sample = self._sample(item)
        token_keys = set(self.plugin.token_inputs(item["input_ids"][:1]))
        media_keys = set(sample) - {"input_ids", "labels", *token_keys}
        if not media_keys:
            return {}
        batch = self.collator([[sample]])
        return {k: batch[k] for k in batch if k in media_keys}

    def needs_batch(self) -> bool:
        """A new generation batch every `num_iterations` steps (steps 1, 1 + μ, ...), or when none is held (a
        resume that could not restore one)."""
        return self._generation is None or self.step % self.g.num_iterations == 0

    def start_step(self, micro_batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        fresh = self.needs_batch()
        self.step += 1
        self._seconds, self._sync_s = (0.0, 0.0), 0.0  # a step on a kept batch neither syncs, generates nor scores
        if fresh:
            self._generation, rounds, groups = self._generate(micro_batches)
            advantages = self._build(self._generation)
            interval = self.g.log_completions_interval
            if interval and self.rank == 0 and any((self.step + k) % interval == 0
                                                   for k in range(self.g.num_iterations)):
                own = self._generation.offset  # this rank's own kept groups' completions (balanced: trained anywhere)
                write_completions(self.output_dir / COMPLETIONS_FILE, self.step, rounds, groups,
                                  advantages[own : own + len(groups) * self.g.num_generations],
                                  self.reward_names, num_generations=self.g.num_generations,
                                  dynamic=self.g.dynamic_sampling)
        self._policy = torch.zeros(len(POLICY_MEANS), device=self.device)
        self._extremes = torch.tensor([float("inf"), float("-inf")] * 2, device=self.device)
        return [plan.batch for plan in self._plans]

    def _sync_engine(self, number: int) -> None:
        """Hand the engine the policy's weights before generation batch `number` when `rollout.sync_interval` says
        (batches 1, 1 + k, ...), and always at a process's first batch: a resumed run's engine holds no older
        weights, so a resume between two syncs generates from the resumed ones (a warning)."""
        interval = self.g.rollout.sync_interval
        if self._synced and ((number - 1) % interval or self.engine.weights_version == self.step - 1):
            return  # between syncs, or the engine has these weights already (a validation synced them)
        if not self._synced and (number - 1) % interval and self.rank == 0:
            log.warning(f"rollout: resumed at generation batch {number}, between two weight syncs "
                        f"(rollout.sync_interval {interval}): the engine starts from the resumed weights, where the "
                        f"uninterrupted run's held those of batch {number - (number - 1) % interval}")
        started = time.perf_counter()
        self.engine.sync_weights(self.model, self.step - 1)
        self._sync_s = time.perf_counter() - started
        self._synced = True

    def _generate(self, micro_batches: list[dict[str, Any]]) -> tuple[Generation, list[Round], list[tuple]]:
        """Steps 1-3 of the module docstring, in rounds with dynamic sampling (`mmfsdp.train.grpo_sampling`): the
        generation batch, its rounds and this rank's kept groups (round, position) for the completions log."""
        G, dp = self.g.num_generations, self.dims.dp_size
        number = (self.step - 1) // self.g.num_iterations + 1
        self._sync_engine(number)
        self._lag = self.step - 1 - self.engine.weights_version
        rounds: list[Round] = []

        def next_round(r: int) -> tuple[list[tuple], torch.Tensor]:
            beat(f"step {self.step} generation round {r + 1}")  # each round is progress for the hang watch
            drawn = micro_batches if r == 0 else self.draw_step()
            rounds.append(self._round([item for mb in drawn for item in mb["prompts"]], number))
            table, owners = rounds[-1].table, rounds[-1].owners
            keys = [(r, round_order(self.sampling.seed, number, int(table[-1, j * G])), int(table[-1, j * G]), *owner)
                    for j, owner in enumerate(owners)]
            return keys, ~zero_std_groups(table[0].float(), G)

        if self.g.dynamic_sampling:
            selection = sample_rounds(next_round, max_rounds=1 + self.g.max_resample_rounds)
            kept = selection.kept
            if selection.found < selection.target:  # said once; the metrics say it for every step
                warn_once(f"dynamic sampling found fewer groups with varying rewards than the step's prompts after "
                          f"{selection.rounds} rounds (training.grpo.max_resample_rounds: {self.g.max_resample_rounds}); "
                          "such a step trains on those it found (rollout/groups_kept)", log)
        else:
            next_round(0)
            kept = torch.ones(len(rounds[0].owners), dtype=torch.bool)
        layout = kept_layout([r.owners for r in rounds], kept, num_generations=G, dp_size=dp,
                             dp_rank=self.dims.dp_rank)
        prompts = [rounds[r].prompts[p] for r, p in layout.groups]
        rollouts = [rounds[r].rollouts[p * G + g] for r, p in layout.groups for g in range(G)]
        table = torch.cat([r.table for r in rounds], dim=1)
        completions = [list(r.completion_ids) for r in rollouts]
        engine_logps = [torch.tensor(r.logprobs, dtype=torch.float32) for r in rollouts]
        balanced = {}
        if self.balance:  # the kept completions of every rank, planned over the ranks (grpo_sampling)
            prompts, completions, engine_logps, balanced = balanced_share(
                table, layout.columns, prompts, rollouts, prompt_stats=self._prompt_stats,
                read=self._dataset.__getitem__,
                dims=self.dims, device=self.device, micro_batch_size=self.micro_batch_size * G, budget=self.budget,
                packing=self.collator.packing, cost_model=self._cost_model, width=self.g.max_completion_length)
            chunks, num_batches = balanced.pop("chunks"), balanced.pop("num_batches")
        elif self.budget is not None:  # micro-batches within the budget, as many on every rank (grpo_sampling)
            owners = [prompts[k // G] for k in range(len(rollouts))]
            chunks = budget_chunks([len(p["input_ids"]) + len(r.completion_ids) for p, r in zip(owners, rollouts)],
                                   [float(self._vision[p["prompt_index"]]) for p in owners], self.budget,
                                   packing=self.collator.packing)
            self._budget_bins = len(chunks)
            count = int(gather_columns(torch.tensor([[float(len(chunks))]], dtype=torch.float64), self.dims,
                                       self.device)[0].max())
            chunks = equal_chunks(chunks, count)
            num_batches = sum(min(count, k * G) for k in layout.per_rank)
        elif self.g.dynamic_sampling:  # every rank makes the same number of micro-batches (grpo_sampling)
            count = micro_batch_count(layout.per_rank, self.micro_batch_size)
            chunks = split_evenly(len(rollouts), count)
            num_batches = sum(min(count, k * G) for k in layout.per_rank)
        else:
            chunks = [len(mb["prompts"]) * G for mb in micro_batches]
            num_batches = len(chunks) * dp
        first = rounds[0]
        generation = Generation(
            number=number, prompts=prompts, completions=completions, engine_logps=engine_logps, chunks=chunks,
            filler={"prompt": first.prompts[0], "completion": list(first.rollouts[0].completion_ids)}
            if 0 in chunks else None,
            table=table, columns=layout.columns, offset=layout.offset,
            num_batches=max(1, num_batches), rounds=len(rounds), old_logps=[None] * len(chunks),
            ref_logps=[None] * len(chunks), diff_max=torch.zeros((), device=self.device),
            diff_sum=torch.zeros((), device=self.device), **balanced,
        )
        return generation, rounds, layout.groups

    def _round(self, prompts: list[dict[str, Any]], number: int) -> Round:
        """One round of steps 1-3: this rank's prompts generated and scored, every rank's numbers gathered."""
        G = self.g.num_generations
        requests = [prompt_request(item, self._media(item), G) for item in prompts]
        started = time.perf_counter()
        rollouts = self.engine.generate(requests, self.sampling, number)
        generated = time.perf_counter()
        items = [item for item in prompts for _ in range(G)]
        texts = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
        totals, per_function, counters = self.rewards.score(
            texts, [item["solution"] for item in items], [item["prompt_text"] for item in items])
        generate_s, reward_s = self._seconds
        self._seconds = (generate_s + generated - started, reward_s + time.perf_counter() - generated)
        for name, counts in counters.items():
            if counts["errors"] or counts["timeouts"]:
                log.warning(f"reward {name}: {counts['errors']} errors, {counts['timeouts']} timeouts this step "
                            f"(scored 0); last: {self.rewards.last_errors.get(name)}")
        lengths = torch.tensor([len(r.completion_ids) for r in rollouts], dtype=torch.float64)
        truncated = torch.tensor([r.finish_reason == "length" for r in rollouts], dtype=torch.float64)
        indices = torch.tensor([item["prompt_index"] for item in items], dtype=torch.float64)
        local = torch.cat([totals[None].double(), per_function.double(), lengths[None], truncated[None], indices[None]])
        table, offsets = gather_columns(local.reshape(local.shape[0], -1), self.dims, self.device)
        return Round(prompts=prompts, rollouts=rollouts, texts=texts, totals=totals, per_function=per_function,
                     table=table, owners=group_owners(offsets, G))

    def _build(self, generation: Generation) -> torch.Tensor:
        """Steps 4-5 of the module docstring, from a generation batch alone (also a restored one): advantages,
        global normalisers, reward statistics and the training micro-batches (`_plans`). Returns the advantages of the
        step's kept completions, every rank's, in the order of `generation.columns`."""
        G = self.g.num_generations
        offset, count = generation.offset, len(generation.completions)
        table = generation.table[:, generation.columns]
        F = table.shape[0] - 4
        totals, lengths, truncated = table[0], table[1 + F], table[2 + F]
        advantages = group_advantages(totals.float(), G, self.g.scale_rewards)
        positions = generation.positions if generation.positions is not None else range(offset, offset + count)
        owners = generation.owners if generation.owners is not None else [k // G for k in range(count)]
        mine = advantages[list(positions)]
        trains = torch.ones_like(truncated) if not self.g.mask_truncated_completions else 1 - truncated
        self._num_sequences = torch.tensor(float(totals.numel()), device=self.device)
        trained_tokens = float((lengths * trains).sum())
        self._any_trained = trained_tokens > 0
        self._num_tokens = torch.tensor(trained_tokens, device=self.device)
        self._num_batches = generation.num_batches
        self._stats = self._reward_stats(generation)

        samples = [self._sample(item) for item in generation.prompts]
        self._plans, start = [], 0
        for size in generation.chunks:
            if not size:  # a filler: the same collectives, no trained token (grpo_sampling)
                filler = generation.filler
                sequence = training_sequence(self._sample(filler["prompt"]), filler["completion"], False, self.plugin)
                self._plans.append(self._plan([sequence], [torch.zeros(len(filler["completion"]))], torch.zeros(1)))
                continue
            sequences = [training_sequence(samples[owners[k]], generation.completions[k], bool(trains[positions[k]]),
                                           self.plugin) for k in range(start, start + size)]
            self._plans.append(self._plan(sequences, generation.engine_logps[start : start + size],
                                          mine[start : start + size]))
            start += size
        return advantages

    def _plan(self, sequences: list[dict[str, Any]], engine: list[torch.Tensor],
              advantages: torch.Tensor) -> TrainingPlan:
        return training_plan(sequences, engine, advantages, collator=self.collator, device=self.device)

    def _reward_stats(self, generation: Generation) -> dict[str, torch.Tensor]:
        """TRL's reward and completion statistics of every completion generated (float64 on the host -> device
        scalars); `reward_std` is TRL's: the std of the whole batch's rewards (not of each group's). With dynamic
        sampling they cover every round, dropped groups too, and the rounds and kept and dropped groups join them."""
        G, table = self.g.num_generations, generation.table
        F = table.shape[0] - 4
        totals, functions, lengths, truncated = table[0], table[1 : 1 + F], table[1 + F], table[2 + F]
        stats = {
            "reward": totals.mean(),
            "reward_std": totals.std(),
            "frac_reward_zero_std": zero_std_groups(totals.float(), G).double().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": truncated.mean(),
        }
        for name, values in zip(self.reward_names, functions):
            stats[f"rewards/{name}/mean"] = values.mean()
            stats[f"rewards/{name}/std"] = values.std() if values.numel() > 1 else values.new_zeros(())
        if generation.planned_imbalance is not None:  # balanced: the plan's (the trainer's meter has no loader plan)
            stats["planned_imbalance"] = generation.planned_imbalance
        if self.g.dynamic_sampling:
            kept, groups = len(generation.columns) // G, table.shape[1] // G
            stats.update({"rollout/gen_rounds": generation.rounds, "rollout/groups_kept": kept,
                          "rollout/groups_dropped": groups - kept})
        return {k: torch.as_tensor(v).float().to(self.device) for k, v in stats.items()}

    def micro_batch(self, model, index: int, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        plan = self._plans[index]
        keywords = {"shift_labels": plan.targets, "loss_weights": plan.weights, "per_token": True,
                    "temperature": self.g.temperature or 1.0}  # 0: greedy, log-probs of the raw logits
        generation, keep = self._generation, self.g.num_iterations > 1
        ref = generation.ref_logps[index]
        if self.reference is not None and ref is None:
            ref = self.reference.logps(inputs, keywords, None).reshape(-1)[plan.index]
            generation.ref_logps[index] = ref if keep else None
        out = model(**inputs, **keywords, suppress_token_ids=self._suppressed)
        logps = (-out.loss).reshape(-1)[plan.index] * plan.mask
        entropies = out.entropy.reshape(-1)[plan.index]
        old = generation.old_logps[index]  # None: the first iteration, on the weights that generated the batch
        if old is None and keep:
            generation.old_logps[index] = logps.detach()
        loss, terms = policy_objective(
            logps, plan.advantages, plan.mask, old_logps=old, loss_type=self.g.loss_type,
            num_sequences_global=self._num_sequences,
            num_tokens_global=self._num_tokens, num_batches_global=self._num_batches,
            max_completion_length=self.g.max_completion_length, ref_logps=ref, entropies=entropies, beta=self.g.beta,
            epsilon=self.g.epsilon, epsilon_high=self.g.epsilon_high, delta=self.g.delta,
            importance_sampling_level=self.g.importance_sampling_level, engine_logps=plan.engine_logps,
            **self._correction,
        )
        with torch.no_grad():
            self._names = terms.names
            for name, value in zip(terms.names, terms.sums):
                count = self._num_sequences if name in self._sequence_means else self._num_tokens
                self._policy[POLICY_MEANS.index(name)] += value / count.clamp(min=1.0)
            self._extremes = torch.stack([torch.minimum(self._extremes[0::2], terms.extremes[0::2]),
                                          torch.maximum(self._extremes[1::2], terms.extremes[1::2])], 1).flatten()
            if old is None:  # the sampler's log-probabilities: the engine never draws a media placeholder
                kept = out.kept_logmass
                sampled = logps.detach() - (0.0 if kept is None else kept.reshape(-1)[plan.index])
                gaps = (sampled - plan.engine_logps).abs() * plan.mask
                gap = gaps.max() if plan.mask.numel() else 0.0
                generation.diff_max = torch.maximum(generation.diff_max, torch.as_tensor(gap, device=self.device))
                generation.diff_sum = generation.diff_sum + gaps.sum()
        return out, loss * self.cp_share

    def close(self) -> None:
        self.engine.close()
        self.rewards.close()

    def eval_metrics(self) -> PolicyArgmax:
        """eval.json's `policy_accuracy`: the held-out exact match as the engine decodes (`PolicyArgmax`)."""
        return PolicyArgmax(self.sampling.suppress_token_ids)

    def validation_metrics(self, step: int) -> dict[str, float]:
        """The held-out greedy reward (`mmfsdp.train.grpo_validation`) on the weights after `step`."""
        self.engine.sync_weights(self.model, step)
        return self.held_out(step)

    def stats(self) -> tuple[dict[str, torch.Tensor], list[Any]]:
        reductions = []
        low, high = self._extremes[0::2].clone(), self._extremes[1::2].clone()  # [clip ratio, sampling weight]
        diff_max = self._generation.diff_max.clone()  # the generation's: kept (unreduced) for its later steps
        diff_mean = self._generation.diff_sum / self._num_tokens.clamp(min=1.0)  # this rank's share of the mean
        if not self._any_trained and self.g.importance_sampling_level == "token":
            low[0].fill_(float("nan")), high[0].fill_(float("nan"))  # no sequence with a trained token: TRL's NaN
        if self.dims.dp_size > 1:
            group = self.dims.dp_group
            reductions += [dist.all_reduce(self._policy, group=group, async_op=True),
                           dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group, async_op=True),
                           dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group, async_op=True),
                           dist.all_reduce(diff_max, op=dist.ReduceOp.MAX, group=group, async_op=True),
                           dist.all_reduce(diff_mean, group=group, async_op=True)]
        policy = {name: self._policy[POLICY_MEANS.index(name)] for name in self._names}
        if self._correction:  # TRL's sampling/importance_sampling_ratio/min and /max
            policy.update(zip(POLICY_EXTREME_STATS[2:], (low[1], high[1])))
        generate_s, reward_s = self._seconds  # rank 0's (the log line's); the ranks generate in lockstep
        return {**self._stats, **policy, "clip_ratio/low_min": low[0], "clip_ratio/high_max": high[0],
                "rollout/logprob_diff_max": diff_max, "rollout/logprob_diff_mean": diff_mean,
                **sync_stats(self.engine, self._sync_s, self.device),
                "rollout/weights_lag": torch.tensor(float(self._lag), device=self.device),
                "time/generate_s": torch.tensor(generate_s, device=self.device),
                "time/reward_s": torch.tensor(reward_s, device=self.device)}, reductions

def _moved(tensor: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _metric_name(name: str) -> str:
    """A reward function's name in the metrics: a user function's own name (`file.py:fn` -> `fn`, TRL's
    `__name__`), a registered one's name."""
    path, _, function = name.rpartition(":")
    return function if path.endswith(".py") else name
