"""GRPO equal to TRL's `GRPOTrainer` (`trl==1.16.0`, the dev group's pin; issue 45), whole model.

For each family (the tiny Qwen3-VL and Qwen3.5 of `examples/*/assets`, CPU) and each case of `CASES`, three prompts
of the example's synthetic shapes data (two with an image, one text-only; our data pipeline's tokens and pixels)
with four fixed completions each (of different lengths; some stop, some reach `max_completion_length`) and fixed
rewards of two weighted reward functions go through both implementations from the same weights:

- TRL: a `GRPOTrainer` with the plain HF model as the policy and a copy of the initial one as its reference (its
  build from the policy's path is replaced by that copy); its prompt tokenisation (`_tokenize_prompts`) gives our
  prompt tokens, its generation (`_generate_single_turn`) the fixed completions and its processing class our pixel
  inputs; everything else is TRL's own: `_generate_and_score_completions` (rewards, advantages, statistics, the old
  policy's and the reference's log-probabilities), then `compute_loss` and backward;
- ours: `GRPOObjective` with a stand-in rollout engine that returns the same completions (`FixedRollouts`, a
  `RolloutEngine`), the reward functions of `tests/grpo_rewards.py` with the same values, a `FrozenReference` of the
  same initial weights, `start_step` and `micro_batch` on our wrapper, our layout (one padding-free micro-batch).

Both policies are perturbed away from the initial weights (a non-zero KL), by the same noise. With `num_iterations:
2` both then train a second step on the same batch after the same further perturbation (a stand-in for the optimizer
step): TRL with the old log-probabilities its extra forward computed at generation, ours with those its first
iteration kept. At each iteration the loss, every statistic that both log (rewards, lengths, KL, entropy, clip
ratios) and every parameter's gradient agree within 1e-5 relative (`assert_close`: max |a − b| / max |b| per
tensor; the loss relative to the mean |advantage| when it is smaller: on-policy, `grpo` and β = 0 it is −mean A,
0 up to rounding). Each case prints its worst difference and the margin to the bound.

Qwen3-VL runs in fp32. Qwen3.5 runs in fp64, like with like (as `tests/test_dpo_trl.py`; TRL's fused LM head still
computes in fp32, `model_pair(..., same_kernels=True)` routes HF's Gated DeltaNet through ours): in fp32 the Gated
DeltaNet's `dt_bias` and `A_log` gradients, sums over every position and head of terms that cancel, differ by up to
1.5e-4 between TRL's left-padded rows and our packed row (the delta rule's chunks fall differently).

Also tested: a resumed objective rebuilds a generation batch from its checkpoint state (`state_dict`) exactly.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from transformers import AutoConfig

from mmfsdp.model import model_inputs
from mmfsdp.model.rollout import Rollout, RolloutEngine
from mmfsdp.model.testing import assert_close, model_pair, perturb, to_dtype
from mmfsdp.parallel.testing import assert_within
from mmfsdp.train.config import GRPOConfig as OurGRPOConfig
from mmfsdp.train.grpo import GRPOObjective
from mmfsdp.train.objective import ObjectiveContext
from mmfsdp.train.references import FrozenReference

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
G = 4
"""Completions per prompt."""
MAX_COMPLETION_LENGTH = 7
PROMPTS = (0, 1, 2)
"""Prompt indices of the synthetic shapes data: an image, text only, an image."""
LENGTHS = ((3, 7, 5, 1), (7, 2, 4, 6), (5, 7, 2, 3))
"""Per prompt, its completions' lengths; those of `MAX_COMPLETION_LENGTH` tokens reach it without a stop token."""
REWARDS = {"fixed_reward": (1.0, 0.0, 0.5, 1.0, 0.25, 0.25, 0.25, 0.25, 2.0, -1.0, 0.0, 0.75),
           "fixed_bonus": (0.0, 1.0, 1.0, 0.5, 0.0, 0.5, 0.0, 1.0, 0.25, 0.25, 0.0, 0.5)}
"""Each reward function's value per completion (prompt-major); the second prompt's first function is constant."""
REWARD_WEIGHTS = (1.0, 0.5)
TEMPERATURE = 0.7
BETA = 0.04
FAMILIES = {"qwen3_vl": ("qwen3vl-tiny", torch.float32), "qwen3_5": ("qwen3_5-tiny", torch.float64)}
"""model id: (its example, the comparison's dtype: module docstring)."""
CASES = {  # name: ours and TRL's GRPOConfig keywords (the same names); a covering set of the pairs of settings
    "grpo": {"loss_type": "grpo"},
    "grpo_beta_sequence_iter2_high": {"loss_type": "grpo", "beta": BETA, "importance_sampling_level": "sequence",
                                      "num_iterations": 2, "epsilon_high": 0.28},
    "bnpo_sequence_iter2": {"loss_type": "bnpo", "importance_sampling_level": "sequence", "num_iterations": 2},
    "bnpo_beta_high": {"loss_type": "bnpo", "beta": BETA, "epsilon_high": 0.28},
    "dr_grpo_iter2_high": {"loss_type": "dr_grpo", "num_iterations": 2, "epsilon_high": 0.28},
    "dr_grpo_beta_sequence": {"loss_type": "dr_grpo", "beta": BETA, "importance_sampling_level": "sequence"},
    "dapo_sequence_high": {"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon_high": 0.28},
    "dapo_beta_iter2": {"loss_type": "dapo", "beta": BETA, "num_iterations": 2},
    "dapo_iter2_delta_masked": {"loss_type": "dapo", "num_iterations": 2, "epsilon_high": 0.28, "delta": 1.3,
                                "mask_truncated_completions": True, "scale_rewards": "none"},
}
STATS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/fixed_reward/mean", "rewards/fixed_reward/std",
         "rewards/fixed_bonus/mean", "rewards/fixed_bonus/std", "completions/mean_length", "completions/min_length",
         "completions/max_length", "completions/clipped_ratio", "kl", "entropy", "clip_ratio/low_mean",
         "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max")
"""The statistics both log (`kl` with β > 0)."""
DIMS = SimpleNamespace(dp_size=1, dp_rank=0, dp_group=None, cp_size=1)


# -- the data, the completions and the models of a family (built once per family) -------------------------------


@dataclass
class Family:
    dataset: Any
    """Our `PromptDataset` of the example's synthetic shapes data."""
    collator: Any
    """The training loader's collator (`ObjectiveContext.train_collator`)."""
    prompts: list[dict[str, Any]]
    completions: list[list[int]]
    """Prompt-major, `G` per prompt."""
    texts: list[str]
    """The completions decoded as our objective decodes them (special tokens skipped): our reward tables' keys."""
    ours: torch.nn.Module
    hf: torch.nn.Module
    data_cfg: Any = None
    """The data config (the objective's held-out rewards read it)."""
    processor: Any = None


def _completions(tokenizer, excluded: set[int]) -> list[list[int]]:
    """Text tokens drawn at random, a stop token (eos) ending each completion shorter than the maximum."""
    generator = torch.Generator().manual_seed(5)
    allowed = torch.tensor([t for t in range(3, 300) if t not in excluded])
    out = []
    for length in (n for lengths in LENGTHS for n in lengths):
        tokens = allowed[torch.randint(len(allowed), (length,), generator=generator)].tolist()
        if length < MAX_COMPLETION_LENGTH:
            tokens[-1] = tokenizer.eos_token_id
        out.append(tokens)
    return out


def build_family(model_id: str, tmp: Path) -> Family:
    from mmfsdp.data import build_dataloader, build_dataset, build_processor
    from mmfsdp.data.dataset import prepare_dataset
    from mmfsdp.train.config import load_config

    example_name, dtype = FAMILIES[model_id]
    example = ROOT / "examples" / example_name
    assets = example / "assets"
    cfg = load_config(str(example / "config.yaml"), [
        "training.stage=grpo", f"model.model_name_or_path={assets}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={assets}",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp / 'data'}",
        f"data.dataset_param.basic_parameters.cache_dir={tmp / 'cache'}",
        "data.dataset_param.synthetic.num_train=8", "data.dataset_param.synthetic.num_eval=1",
    ])
    prepare_dataset(cfg.data)
    processor = build_processor(cfg.data)
    dataset = build_dataset(cfg.data, processor, "train")
    loader = build_dataloader(dataset, cfg.data, micro_batch_size=len(PROMPTS), dp_rank=0, dp_size=1, seed=0,
                              pad_to_multiple_of=1, sample_multiple=1, gradient_accumulation_steps=1,
                              micro_batch_tokens=None)
    prompts = [to_dtype(dataset[index], dtype) for index in PROMPTS]
    assert ["pixel_values" in p for p in prompts] == [True, False, True], "two prompts with an image, one without"
    tokenizer = processor.tokenizer
    completions = _completions(tokenizer, set(dataset.encoder.plugin.image_token_ids))
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    assert len(set(texts)) == len(texts), "the reward tables are keyed by the completions' texts"
    ours, hf = model_pair(AutoConfig.from_pretrained(assets), same_kernels=True)
    ours.to(dtype)
    hf.to(dtype)
    ours.set_media_kinds(["image"])
    return Family(dataset, loader.collator, prompts, completions, texts, ours, hf, cfg.data, processor)


# the quick tier compares the Qwen3-VL cases; the Qwen3.5 ones (fp64, twice the seconds) run in the full suite
@pytest.fixture(scope="module", params=[pytest.param(name, marks=[pytest.mark.slow] if name == "qwen3_5" else [])
                                        for name in FAMILIES])
def family(request, tmp_path_factory) -> Family:
    return build_family(request.param, tmp_path_factory.mktemp(request.param))


# -- our side: the objective with a stand-in engine -----------------------------------------------------------------


class FixedRollouts:
    """A `RolloutEngine` that returns given completions (prompt index -> its `G`), "stop" when the last token is a stop
    token, with zero sampling log-probabilities (they feed only `rollout/logprob_diff_max`)."""

    def __init__(self, completions: dict[int, list[list[int]]]):
        self.completions = completions
        self.version = 0
        self.keys: list[int] = []
        """The `step` key of each `generate` call."""

    @property
    def weights_version(self) -> int:
        return self.version

    def close(self) -> None:
        pass

    def sync_weights(self, model, version: int) -> None:
        self.version = version

    def generate(self, requests, sampling, step: int) -> list[Rollout]:
        self.keys.append(step)
        return [
            Rollout(prompt_index=r.prompt_index, generation_index=g, completion_ids=list(ids), logprobs=[0.0] * len(ids),
                    finish_reason="stop" if ids[-1] in sampling.stop_token_ids else "length",
                    weights_version=self.version)
            for r in requests for g, ids in enumerate(self.completions[r.prompt_index][: r.num_generations])
        ]


def our_objective(family: Family, case: dict, model, reference, tmp_path: Path, state=None, step=0) -> GRPOObjective:
    rewards_file = ROOT / "tests" / "grpo_rewards.py"
    reward_funcs = [{"name": f"{rewards_file}:{name}", "options": {"table": dict(zip(family.texts, values))}}
                    for name, values in REWARDS.items()]
    g = OurGRPOConfig(num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH, temperature=TEMPERATURE,
                      reward_funcs=reward_funcs, reward_weights=list(REWARD_WEIGHTS), **case)
    engine = FixedRollouts({p["prompt_index"]: family.completions[k * G : (k + 1) * G]
                            for k, p in enumerate(family.prompts)})
    assert isinstance(engine, RolloutEngine)
    ctx = ObjectiveContext(
        cfg=SimpleNamespace(data=family.data_cfg, training=SimpleNamespace(
            grpo=g, seed=0, micro_batch_size=len(PROMPTS), micro_batch_tokens=None, eval_batch_size=len(PROMPTS))),
        dims=DIMS, device=torch.device("cpu"), rank=0, output_dir=tmp_path, step=step, model=model,
        train_dataset=family.dataset, evaluator=SimpleNamespace(processor=family.processor), frozen_copy=None, train_collator=family.collator, fresh_loader=None,
        to_device=lambda batch: batch, state=state,
    )
    return GRPOObjective(ctx, engine, FrozenReference(reference) if reference is not None else None)


# -- TRL's side -----------------------------------------------------------------------------------------------------


def trl_trainer(family: Family, case: dict, policy, reference, tmp_path: Path, monkeypatch):
    """A `GRPOTrainer` on the CPU in fp32 whose tokenisation, generation and processing give our prompts and the
    fixed completions (module docstring); its rows are the prompts, each `G` times (TRL's sampler's order)."""
    from datasets import Dataset
    from PIL import Image
    from transformers import BatchFeature, ProcessorMixin
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    prompts = {f"prompt {k}": p for k, p in enumerate(family.prompts)}
    tokens = {key: p["input_ids"] for key, p in prompts.items()}

    class FixedProcessor(ProcessorMixin):
        """The real tokenizer; the chat template gives each prompt's key, the processor our pixel inputs and
        `mm_token_type_ids` (left-padded as TRL pads the prompts)."""

        attributes: ClassVar[list[str]] = ["tokenizer"]

        def __init__(self, tokenizer):
            super().__init__(tokenizer=tokenizer)

        def apply_chat_template(self, conversation, **kwargs):
            return next(part["text"] for message in conversation for part in message["content"] if part["type"] == "text")

        def __call__(self, images=None, text=None, **kwargs):
            rows = [prompts[key] for key in text]
            width = max(len(row["input_ids"]) for row in rows)
            types = torch.zeros(len(rows), width, dtype=torch.long)
            for i, row in enumerate(rows):
                types[i, width - len(row["input_ids"]) :] = row["mm_token_type_ids"]
            with_images = [row for row in rows if "pixel_values" in row]
            return BatchFeature({
                "input_ids": torch.zeros_like(types), "attention_mask": torch.ones_like(types), "mm_token_type_ids": types,
                "pixel_values": torch.cat([row["pixel_values"] for row in with_images]),
                "image_grid_thw": torch.cat([row["image_grid_thw"] for row in with_images]),
            })

    def reward_function(name: str, values):
        table = {tuple(ids): value for ids, value in zip(family.completions, values)}

        def reward(prompts, completions, completion_ids, **kwargs):
            return [table[tuple(ids)] for ids in completion_ids]

        reward.__name__ = name
        return reward

    monkeypatch.setattr(grpo_trainer, "create_model_from_path", lambda *args, **kwargs: reference)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        per_device_train_batch_size=len(PROMPTS) * G, num_generations=G, max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE, reward_weights=list(REWARD_WEIGHTS), **case,
    )
    processor = FixedProcessor(family.dataset.encoder.processor.tokenizer)
    trainer = GRPOTrainer(
        model=policy, reward_funcs=[reward_function(name, values) for name, values in REWARDS.items()], args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": key}] for key in prompts]}),
        processing_class=processor,
    )
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # as Trainer's loop sets them
    trainer._tokenize_prompts = lambda batch: (
        [tokens[message[0]["content"][-1]["text"]].tolist() for message in batch],
        [[Image.new("RGB", (8, 8))] if "pixel_values" in prompts[message[0]["content"][-1]["text"]] else None
         for message in batch],
        {},
    )
    trainer._generate_single_turn = lambda prompt_ids, images, fields, num_generations: (
        [list(ids) for ids in family.completions], None)
    rows = [{"prompt": [{"role": "user", "content": key}],
             "image": Image.new("RGB", (8, 8)) if "pixel_values" in p else None}
            for key, p in prompts.items() for _ in range(G)]
    return trainer, rows


# -- the comparison --------------------------------------------------------------------------------------------------


def _compare(ours_loss, our_stats, trl_loss, trl_metrics, our_model, trl_model, case: dict, what: str,
             scale: float) -> dict:
    """`scale`: the loss's, the mean |advantage| of the batch when the loss is smaller (on-policy, `grpo` and β = 0
    it is −mean A = 0 up to rounding)."""
    loss_diff = abs(float(ours_loss) - float(trl_loss)) / max(abs(float(trl_loss)), scale)
    diffs = {"loss": assert_within(loss_diff, TOL, f"{what} loss: {float(ours_loss)} vs {float(trl_loss)}")}
    names = [name for name in STATS if name != "kl" or case.get("beta")]
    for name in names:
        ours, theirs = float(our_stats[name]), trl_metrics[name][-1]
        diffs[name] = assert_close(torch.tensor(ours), torch.tensor(theirs), TOL, f"{what} {name}: {ours} vs {theirs}")
    their_params = dict(trl_model.named_parameters())
    our_params = dict(our_model.named_parameters())
    assert our_params.keys() == their_params.keys()
    for name, param in our_params.items():
        theirs = their_params[name].grad
        if theirs is None:  # a parameter no input reaches in TRL's forward: none in ours either
            assert param.grad is None or not param.grad.any(), f"{what} {name}: TRL has no gradient"
            continue
        diffs[f"grad {name}"] = assert_close(param.grad, theirs, TOL, f"{what} grad {name}")
    return diffs


@pytest.mark.parametrize("case_name", list(CASES))
def test_grpo_equals_trl(family, case_name, tmp_path, monkeypatch):
    case = CASES[case_name]
    beta = case.get("beta", 0.0)
    ours, hf = copy.deepcopy(family.ours), copy.deepcopy(family.hf)
    our_ref, hf_ref = (copy.deepcopy(family.ours).eval(), copy.deepcopy(family.hf).eval()) if beta else (None, None)
    for model in (our_ref, hf_ref):
        if model is not None:
            model.requires_grad_(False)
    perturb([ours, hf], seed=3, scale=0.05)
    trainer, rows = trl_trainer(family, case, hf, hf_ref, tmp_path, monkeypatch)
    objective = our_objective(family, case, ours, our_ref, tmp_path)

    worst = {}
    for iteration in range(case.get("num_iterations", 1)):
        if iteration == 0:
            inputs = trainer._generate_and_score_completions(rows)
            assert ("old_per_token_logps" in inputs) == (case.get("num_iterations", 1) > 1)
        else:
            perturb([ours, hf], seed=10 + iteration, scale=0.05)  # the same update on both sides
        hf.zero_grad(set_to_none=True)
        trl_loss = trainer.compute_loss(hf, dict(inputs))
        trl_loss.backward()

        assert objective.needs_batch() == (iteration == 0)
        batches = objective.start_step([{"prompts": family.prompts}] if iteration == 0 else [])
        ours.zero_grad(set_to_none=True)
        _, share = objective.micro_batch(ours, 0, model_inputs(batches[0]))
        share.backward()
        stats, pending = objective.stats()
        assert not pending

        diffs = _compare(share, stats, trl_loss, trainer._metrics["train"], ours, hf, case, f"iteration {iteration + 1}",
                         scale=float(inputs["advantages"].abs().mean()))
        name = max(diffs, key=diffs.get)
        worst[f"iteration {iteration + 1}: {name}"] = diffs[name]
    assert objective.engine.keys == [1], "one generation for the whole batch"
    if beta:
        assert trainer._metrics["train"]["kl"][-1] > 1e-4, "the policy should be away from the reference"
    if case.get("num_iterations", 1) > 1:
        assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] > 0, "the old policy should be far enough to clip"
    objective.rewards.close()
    key = max(worst, key=worst.get)
    print(f"worst: {key} {worst[key]:.3g} (bound {TOL:g}, margin {TOL / max(worst[key], 1e-300):.0f}x)")


def test_a_resumed_objective_rebuilds_its_generation_batch(family, tmp_path):
    """The checkpoint state of an objective after the first of two iterations gives a new objective (a resumed run at
    that step) the same training micro-batch, old log-probabilities and statistics; after the last iteration there
    is nothing to keep."""
    case = {"loss_type": "dapo", "num_iterations": 2}
    ours = copy.deepcopy(family.ours)
    objective = our_objective(family, case, ours, None, tmp_path)
    (batch,) = objective.start_step([{"prompts": family.prompts}])
    objective.micro_batch(ours, 0, model_inputs(batch))[1].backward()
    first, _ = objective.stats()
    state = objective.state_dict()
    assert set(state) == {"generation"}

    resumed = our_objective(family, case, ours, None, tmp_path, state=state, step=1)
    assert not resumed.needs_batch() and not objective.needs_batch()
    (again,) = resumed.start_step([])
    (same,) = objective.start_step([])
    assert again.keys() == same.keys() and all(torch.equal(again[k], same[k]) for k in same if torch.is_tensor(same[k]))
    for obj in (objective, resumed):
        obj.micro_batch(ours, 0, model_inputs(same))
    stats = [obj.stats()[0] for obj in (objective, resumed)]
    assert {k: float(v) for k, v in stats[0].items()} == {k: float(v) for k, v in stats[1].items()}
    assert {k: float(v) for k, v in stats[0].items() if k.startswith("reward")} == {
        k: float(v) for k, v in first.items() if k.startswith("reward")}
    assert objective.state_dict() == {} and resumed.needs_batch()
    for obj in (objective, resumed):
        obj.rewards.close()
