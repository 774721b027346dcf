"""GRPO (`training.stage: grpo`) through the real trainer on the synthetic shapes as prompts (question -> prompt,
answer -> ground truth; image and text-only rows mixed), the tiny Qwen3-VL in fp32 on gloo, 3 steps:

- one process: every step generates, scores and trains (a non-zero gradient, the weights move), logs TRL's metric
  names, writes `completions.jsonl`, and the rollout engine's sampling log-probabilities equal the trainer's
  log-probabilities of the same tokens on the same weights (`rollout/logprob_diff_max` <= 1e-5);
- FSDP2 on 2 processes (one prompt per micro-batch and rank, the same global batch) gives the 1-process run's
  per-step loss, gradient norm, tokens and statistics within 1e-5: the completions are keyed by (seed, step, prompt
  index, generation), not by the layout (`mmfsdp.model.rollout`); with TRL's defaults (`dapo`, group std), and with
  the KL to a frozen FSDP2 reference (β = 0.04), the batch std, GSPO's sequence-level ratio and `loss_type: grpo`;
- padded training micro-batches (`padding_free: false`) give the padding-free run's steps and statistics;
- context parallel: Ulysses 2 and Ring 2 on the padding-free (packed) completions, Ring 2 on padded ones, and Ring 2
  with the frozen reference and the variants above, give the 1-process runs' (per-token log-probs computed on each
  CP shard and gathered, `mmfsdp.model.training_forward` step 8);
- LoRA with β = 0.04 (the reference is the policy with its adapters off) on FSDP2 2 and Ulysses 2 = its 1-process
  run; the MoE family (router aux loss, its `aux_loss` and expert load compared with the statistics) with expert
  parallel 2 = its 1-process run; Qwen3.5 (Gated DeltaNet) with packed completions on 1 process, FSDP2 2 and Ring 2
  = its padded 1-process run;
- on every DP-2 case one rank's prompts are all text-only at step 3 while the other's have an image (recorded, and
  checked): generation and training run the same collectives on both;
- chunk loss (per-token log-probs from the hidden states, no full logits) on FSDP2 2 and Ulysses 2 = one process;
- DAPO's dynamic sampling (`training.grpo.dynamic_sampling`) with a reward that is 0 for every text-only prompt, so
  their groups never vary: the one-process run resamples (a second round of prompts at some step) and drops groups,
  and FSDP2 2 and Ulysses 2 keep the same groups and train the same steps (the kept groups are chosen in one global
  order, `mmfsdp.train.grpo_sampling`); without resampling (`max_resample_rounds: 0`) on FSDP2 2, the rank whose
  prompts are all text-only at step 3 keeps no group and runs a filler micro-batch (the same collectives, exactly
  zero loss and gradient): its tokens are the only difference from the one-process run, counted exactly;
- Qwen3-Omni (router aux loss on) on the audio rows of `tests/parity.py` as prompts (clips, images, videos with
  their audio tracks interleaved, text only): generation's and training's log-probabilities agree, and FSDP2 2 =
  one process;
- balanced steps (`data.dataloader_param.balance`: every rank's kept completions planned over the ranks by the cost
  model, some trained on the rank that did not generate them) on FSDP2 2 = one process without balance, and with a
  token budget and dynamic sampling = the 1-process dynamic run.

The rewards: `accuracy` (0 for a random model) and a user reward file (`tests/grpo_rewards.py`) whose values vary
within a group. The cases are a table run by `tests/parity.py`.
"""

import json
from pathlib import Path

import pytest

from apprun import MOE, MOE_ASSETS, QWEN, QWEN3_5, QWEN3_5_ASSETS, ROOT
from parity import QWEN_SETTINGS, Case, Probe, run_cases, session_dir

from mmfsdp.parallel.testing import assert_within

pytestmark = [pytest.mark.timeout(1800)]
REWARD_FILE = ROOT / "tests" / "grpo_rewards.py"
USER_REWARD = f"{REWARD_FILE}:shared_letters"
IMAGE_REWARD = f"{REWARD_FILE}:image_letters"  # 0 on text-only prompts: their groups never vary
BASE = {
    **QWEN_SETTINGS,
    "training.stage": "grpo",
    "training.train_iters": 3,
    "training.lr": 1.0e-2,
    "training.micro_batch_size": 2,
    "training.gradient_accumulation_steps": 2,
    "training.grpo.num_generations": 4,
    "training.grpo.max_completion_length": 6,
    "training.grpo.reward_funcs": f"[accuracy, '{USER_REWARD}']",
    "training.grpo.log_completions_interval": 1,
}
OMNI = ROOT / "examples" / "qwen3omni-tiny" / "config.yaml"
OMNI_SETTINGS = {
    "model.model_name_or_path": str(OMNI.parent / "assets"),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(OMNI.parent / "assets"),
    "features.loss_cfg.router_aux_loss_coef": 0.5,
    "training.seed": 1240,
}
"""Qwen3-Omni on `tests/parity.py`'s audio rows as prompts (clips, images, videos with their audio tracks, text)."""
TRL_NAMES = (
    "reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
    "completions/max_length", "completions/clipped_ratio", "rewards/accuracy/mean", "rewards/accuracy/std",
    "rewards/shared_letters/mean", "rewards/shared_letters/std", "entropy", "clip_ratio/low_mean",
    "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min", "clip_ratio/high_max",
)


MEDIA_KEYS = {"image": "pixel_values", "video": "pixel_values_videos", "audio": "input_features"}
"""A prompt's media kinds, by the collator's keys."""


class GRPORecord(Probe):
    """Every step's statistics, the first trained parameter before and after, and the completions file's rows.

    The reward workers are child processes of the rank: `rank_may_start_processes` while the case runs."""

    name = "grpo"

    def __init__(self, case: dict, rank: int):
        from mmfsdp.parallel.testing import rank_may_start_processes

        super().__init__(case, rank)
        self.children = rank_may_start_processes()
        self.children.__enter__()

    def detach(self) -> None:
        self.children.__exit__(None, None, None)

    def attach(self, trainer) -> None:
        self.before = _first_weights(trainer)
        self.images: list[list[list[bool]]] = []  # per step, micro-batch and prompt: whether it has an image
        self.media: list[list[str]] = []  # per step: the kinds of media of this rank's prompts
        self.fillers: list[int] = []  # per step, the tokens of this rank's filler micro-batches (the trainer's count)
        self.budget: list[tuple[int, int, int]] = []  # per step: micro-batches within the budget, run, largest tokens
        self.moved_prompts: list[int] = []  # per step: prompts it trains that its loader did not hand it (balance)
        objective, start_step = trainer.objective, trainer.objective.start_step
        counted = trainer.dims.cp_rank == 0  # the trainer counts a CP group's tokens once

        def recording(micro_batches):
            self.images.append([["pixel_values" in item for item in mb["prompts"]] for mb in micro_batches])
            self.media.append(sorted({kind for mb in micro_batches for item in mb["prompts"]
                                      for kind, key in MEDIA_KEYS.items() if key in item}))
            trained = start_step(micro_batches)
            own = {item["prompt_index"] for mb in micro_batches for item in mb["prompts"]}
            self.moved_prompts.append(sum(item["prompt_index"] not in own for item in objective._generation.prompts))
            chunks = objective._generation.chunks  # 0: a filler (dynamic sampling, mmfsdp.train.grpo_sampling)
            self.fillers.append(sum(int(mb["attention_mask"].sum()) for mb, size in zip(trained, chunks)
                                    if counted and not size))
            self.budget.append((objective._budget_bins, len(trained),
                                max(int(mb["attention_mask"].sum()) for mb, size in zip(trained, chunks) if size > 1)
                                if any(size > 1 for size in chunks) else 0))
            return trained

        objective.start_step = recording

    def result(self, trainer) -> dict:
        path = Path(trainer.output_dir) / "completions.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        moved = float((_first_weights(trainer) - self.before).abs().max())
        return {"stats": [dict(r.stats) for r in trainer.history], "moved": moved, "completions": rows,
                "images": self.images, "fillers": self.fillers, "val": dict(trainer.evaluator.val_stats),
                "budget": self.budget, "moved_prompts": self.moved_prompts, "media": self.media}


def _text_only_rank_step(*ranks) -> bool:
    """Whether, at some step, one rank's prompts (all its micro-batches) were text-only while another's had an image:
    that rank generated and trained with the vision placeholder passes only (on the shapes data at micro-batch
    size 1, step 3 of every DP-2 case)."""
    steps = [[any(any(mb) for mb in step) for step in rank] for rank in ranks]
    return any(not all(flags) and any(flags) for flags in zip(*steps))


def _first_weights(trainer):
    from parity import full_tensor

    return full_tensor(next(p for p in trainer.model.parameters() if p.requires_grad)).detach().clone()


VARIANTS = {  # the KL to a frozen FSDP2 reference, the batch std (gathered over ranks), GSPO, per-sequence means
    "training.grpo.beta": 0.04,
    "training.grpo.scale_rewards": "batch",
    "training.grpo.importance_sampling_level": "sequence",
    "training.grpo.loss_type": "grpo",
}
LORA = {  # the reference is the policy with its adapters off (β > 0)
    "training.grpo.beta": 0.04,
    "training.lora.enable": "true",
    "training.lora.init_lora_weights": "false",  # B random too: the policy differs from the reference at step 1
    "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj,qkv]",
}
MOE_SETTINGS = {  # the MoE family with its router aux loss (logged as `aux_loss`, compared with the statistics)
    "model.model_name_or_path": str(MOE_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(MOE_ASSETS),
    "features.loss_cfg.router_aux_loss_coef": 0.5,
    "parallel.expert_parallel_size": 1,
}
QWEN3_5_SETTINGS = {  # Gated DeltaNet: packed completions restart its state and convolution per completion
    "model.model_name_or_path": str(QWEN3_5_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(QWEN3_5_ASSETS),
    # the family example's lr: at 1e-2 AdamW turns the rounding differences of Ring 2's reordered delta rule (3e-7
    # on step 1's gradient norm) into full-size steps of the tiny-gradient elements, 9.3e-6 by step 3
    "training.lr": 5.0e-4,
}
CHUNK = {"features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16}
DYNAMIC = {"training.grpo.dynamic_sampling": "true", "training.grpo.reward_funcs": f"[accuracy, '{IMAGE_REWARD}']"}
DROP_ONLY = {**DYNAMIC, "training.grpo.max_resample_rounds": 0}
BUDGET = {"training.micro_batch_tokens": 48}  # a rank's 8 sequences a step fit 6 to 8 micro-batches: counts differ
BALANCE = {"data.dataloader_param.balance": "true"}  # every rank's kept completions planned over the ranks
TIS = {"training.grpo.rollout.tis_cap": 2.0}  # verl's spelling: TRL's correction, token_truncate at 2
VALIDATION = {"training.val_interval": 1}  # val_loss and the held-out greedy reward after every step
FILLERS = {"grpo_drop_fsdp2"}
"""Cases where a rank must run a filler micro-batch at some step (a rank that keeps no group)."""
CASES = [
    Case("grpo_ref", 1, QWEN, BASE, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_fsdp2", 2, QWEN, {**BASE, "training.micro_batch_size": 1}, "grpo_ref", dataset="shapes",
         probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_padded", 1, QWEN, {**BASE, "data.dataloader_param.padding_free": "false"}, "grpo_ref",
         dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_variants_ref", 1, QWEN, {**BASE, **VARIANTS}, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_variants_fsdp2", 2, QWEN, {**BASE, **VARIANTS, "training.micro_batch_size": 1}, "grpo_variants_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_ulysses2", 2, QWEN, {**BASE, "parallel.ulysses_parallel_size": 2}, "grpo_ref", dataset="shapes",
         probes=(GRPORecord,), layout={"dp": 1, "ulysses": 2}),
    Case("grpo_ring2_packed", 2, QWEN, {**BASE, "parallel.ring_attention_size": 2}, "grpo_ref", dataset="shapes",
         probes=(GRPORecord,), layout={"dp": 1, "ring": 2}),
    Case("grpo_chunk_fsdp2", 2, QWEN, {**BASE, **CHUNK, "training.micro_batch_size": 1}, "grpo_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_chunk_ulysses2", 2, QWEN, {**BASE, **CHUNK, "parallel.ulysses_parallel_size": 2}, "grpo_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 1, "ulysses": 2}),
    Case("grpo_lora_ref", 1, QWEN, {**BASE, **LORA}, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_lora_fsdp2", 2, QWEN, {**BASE, **LORA, "training.micro_batch_size": 1}, "grpo_lora_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_moe_ref", 1, MOE, {**BASE, **MOE_SETTINGS}, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_moe_ep2", 2, MOE, {**BASE, **MOE_SETTINGS, "training.micro_batch_size": 1,
                                  "parallel.expert_parallel_size": 2}, "grpo_moe_ref", dataset="shapes",
         probes=(GRPORecord,), layout={"dp": 2, "ep": 2}),
    Case("grpo_qwen3_5_ref", 1, QWEN3_5, {**BASE, **QWEN3_5_SETTINGS, "data.dataloader_param.padding_free": "false"},
         dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_qwen3_5_packed", 1, QWEN3_5, {**BASE, **QWEN3_5_SETTINGS}, "grpo_qwen3_5_ref", dataset="shapes",
         probes=(GRPORecord,)),
    Case("grpo_qwen3_5_packed_fsdp2", 2, QWEN3_5, {**BASE, **QWEN3_5_SETTINGS, "training.micro_batch_size": 1},
         "grpo_qwen3_5_ref", dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_qwen3_5_ring2_packed", 2, QWEN3_5, {**BASE, **QWEN3_5_SETTINGS, "parallel.ring_attention_size": 2},
         "grpo_qwen3_5_ref", dataset="shapes", probes=(GRPORecord,), layout={"dp": 1, "ring": 2}),
    Case("grpo_lora_ulysses2", 2, QWEN, {**BASE, **LORA, "parallel.ulysses_parallel_size": 2}, "grpo_lora_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 1, "ulysses": 2}),
    Case("grpo_ring2_padded", 2, QWEN, {**BASE, "parallel.ring_attention_size": 2,
                                       "data.dataloader_param.padding_free": "false"}, "grpo_ref", dataset="shapes",
         probes=(GRPORecord,), layout={"dp": 1, "ring": 2}),
    Case("grpo_variants_ring2", 2, QWEN, {**BASE, **VARIANTS, "parallel.ring_attention_size": 2}, "grpo_variants_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 1, "ring": 2}),
    Case("grpo_dynamic_ref", 1, QWEN, {**BASE, **DYNAMIC}, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_dynamic_fsdp2", 2, QWEN, {**BASE, **DYNAMIC, "training.micro_batch_size": 1}, "grpo_dynamic_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_dynamic_ulysses2", 2, QWEN, {**BASE, **DYNAMIC, "parallel.ulysses_parallel_size": 2},
         "grpo_dynamic_ref", dataset="shapes", probes=(GRPORecord,), layout={"dp": 1, "ulysses": 2}),
    Case("grpo_drop_ref", 1, QWEN, {**BASE, **DROP_ONLY}, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_drop_fsdp2", 2, QWEN, {**BASE, **DROP_ONLY, "training.micro_batch_size": 1}, "grpo_drop_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_budget_fsdp2", 2, QWEN, {**BASE, **BUDGET, "training.micro_batch_size": 1}, "grpo_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_balance_fsdp2", 2, QWEN, {**BASE, **BALANCE, "training.micro_batch_size": 1}, "grpo_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_balance_budget_dynamic_fsdp2", 2, QWEN,
         {**BASE, **BALANCE, **BUDGET, **DYNAMIC, "training.micro_batch_size": 1}, "grpo_dynamic_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_tis_ref", 1, QWEN, {**BASE, **TIS}, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_tis_fsdp2", 2, QWEN, {**BASE, **TIS, "training.micro_batch_size": 1}, "grpo_tis_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_val_ref", 1, QWEN, {**BASE, **VALIDATION}, dataset="shapes", probes=(GRPORecord,)),
    Case("grpo_val_fsdp2", 2, QWEN, {**BASE, **VALIDATION, "training.micro_batch_size": 1}, "grpo_val_ref",
         dataset="shapes", probes=(GRPORecord,), layout={"dp": 2}),
    Case("grpo_omni_ref", 1, OMNI, {**BASE, **OMNI_SETTINGS}, dataset="audio", probes=(GRPORecord,)),
    Case("grpo_omni_fsdp2", 2, OMNI, {**BASE, **OMNI_SETTINGS, "training.micro_batch_size": 1}, "grpo_omni_ref",
         dataset="audio", probes=(GRPORecord,), layout={"dp": 2}),
]


def test_grpo_one_process_trains_and_logs_trl_metrics(tmp_path_factory):
    result = run_cases(CASES[:1], tmp_path_factory.mktemp("grpo"), session_dir(tmp_path_factory))["grpo_ref"]
    record = result["grpo"][0]
    assert len(result["steps"]) == 3
    for step, stats in enumerate(record["stats"], start=1):
        missing = [name for name in TRL_NAMES if name not in stats]
        assert not missing, f"step {step} lacks {missing}"
        assert_within(stats["rollout/logprob_diff_max"], 1e-5, f"step {step} rollout/logprob_diff_max")
        assert stats["time/generate_s"] > 0 and stats["time/reward_s"] > 0, "each step generates and scores"
        assert stats["frac_reward_zero_std"] < 1.0, "the user reward varies within some group"
        assert stats["completions/max_length"] <= 6
    assert all(grad_norm > 0 for _, grad_norm, _ in result["steps"])
    assert record["moved"] > 0
    rows = record["completions"]
    assert len(rows) == 3 * 4 * 4  # steps x prompts x generations
    assert {"step", "prompt", "completion", "solution", "reward", "advantage"} <= set(rows[0])
    assert any(row["prompt"].startswith("<image>") for row in rows)
    assert any("<image>" not in row["prompt"] for row in rows)


@pytest.mark.slow
def test_grpo_on_audio_and_video_prompts(tmp_path_factory):
    """Qwen3-Omni on prompts with clips, images and videos with their audio tracks: the rollouts' sampling
    log-probabilities equal the trainer's (the positions of a video's interleaved track agree between generation and
    training) and every kind of media is generated from (its DP-2 run equals it: `test_grpo_layout_matches_...`)."""
    cases = [c for c in CASES if c.name == "grpo_omni_ref"]
    record = run_cases(cases, tmp_path_factory.mktemp("grpo"), session_dir(tmp_path_factory))["grpo_omni_ref"]["grpo"][0]
    assert {kind for step in record["media"] for kind in step} == {"image", "video", "audio"}, record["media"]
    for step, stats in enumerate(record["stats"], start=1):
        assert_within(stats["rollout/logprob_diff_max"], 1e-5, f"step {step} rollout/logprob_diff_max")
    assert record["moved"] > 0


def test_sampling_correction_runs_and_logs(tmp_path_factory):
    """The stage with TRL's sampling correction on (hf engine): the weight is the sampled distribution's kept mass
    (media tokens suppressed, docs/rl.md), at most 1, and logged under TRL's names."""
    cases = [c for c in CASES if c.name == "grpo_tis_ref"]
    record = run_cases(cases, tmp_path_factory.mktemp("grpo"), session_dir(tmp_path_factory))["grpo_tis_ref"]
    for step, stats in enumerate(record["grpo"][0]["stats"], start=1):
        low, mean, high = (stats[f"sampling/importance_sampling_ratio/{s}"] for s in ("min", "mean", "max"))
        assert 0 < low <= mean <= high <= 1 + 1e-6, f"step {step}: {low}, {mean}, {high}"


def test_dynamic_sampling_resamples_and_drops(tmp_path_factory):
    """The dynamic-sampling references do what their parity cases are meant to cover: groups dropped, a second round
    generated from the loader's next prompts (the metrics and the completions log say so), and without resampling
    a step that keeps fewer groups than it generated."""
    cases = [c for c in CASES if c.name in ("grpo_dynamic_ref", "grpo_drop_ref")]
    results = run_cases(cases, tmp_path_factory.mktemp("grpo"), session_dir(tmp_path_factory))
    dynamic, drop = (results[name]["grpo"][0] for name in ("grpo_dynamic_ref", "grpo_drop_ref"))
    rounds = [stats["rollout/gen_rounds"] for stats in dynamic["stats"]]
    assert max(rounds) > 1, f"no step resampled: {rounds}"
    assert any(stats["rollout/groups_dropped"] for stats in dynamic["stats"])
    for stats in dynamic["stats"]:  # 4 prompts a round; a round more only while fewer than 4 vary
        assert stats["rollout/groups_kept"] + stats["rollout/groups_dropped"] == 4 * stats["rollout/gen_rounds"]
        kept, rounds = stats["rollout/groups_kept"], stats["rollout/gen_rounds"]
        assert kept == 4 or (kept < 4 and rounds == 4), f"{kept} groups kept after {rounds} rounds"
    groups: dict[tuple, list[dict]] = {}
    for row in dynamic["completions"]:
        groups.setdefault((row["step"], row["round"], row["prompt_index"]), []).append(row)
    assert {r for _, r, _ in groups} >= {1, 2}
    for (step, r, _), rows in groups.items():
        varies, kept = len({row["reward"] for row in rows}) > 1, rows[0]["kept"]
        assert all(row["kept"] == kept and (row["advantage"] is None) != kept for row in rows)
        assert varies or not kept, f"step {step}: a group whose rewards are all equal was kept"
        assert kept or not varies or r > 1, f"step {step}: a varying group of the first round was dropped"
        assert varies or "<image>" in rows[0]["prompt"] or not kept
    assert not any(row["kept"] for row in dynamic["completions"] if "<image>" not in row["prompt"])
    assert all(stats["rollout/gen_rounds"] == 1 for stats in drop["stats"])
    assert any(stats["rollout/groups_kept"] < 4 for stats in drop["stats"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [case.name for case in CASES if case.reference is not None])
def test_grpo_layout_matches_one_process(tmp_path_factory, name):
    """The loss is compared in absolute terms: with `num_iterations: 1` its value is Σ −A·n / N over advantages that
    sum to 0 within each group (completions of equal length give exactly 0), rounding noise on terms of size 1;
    the gradient norm, tokens and statistics are compared as the other parity tests do."""
    case = next(c for c in CASES if c.name == name)
    cases = [c for c in CASES if c.name in (name, case.reference)]
    results = run_cases(cases, tmp_path_factory.mktemp("grpo"), session_dir(tmp_path_factory))
    got_run, ref_run = results[case.name], results[case.reference]
    assert all(got_run["layout"][key] == value for key, value in (case.layout or {}).items())
    assert len(got_run["steps"]) == len(ref_run["steps"]) == 3
    fillers = [sum(step) for step in zip(*(record["fillers"] for record in got_run["grpo"]))]
    ref_fillers = ref_run["grpo"][0]["fillers"]
    assert any(fillers) == (name in FILLERS), f"filler tokens per step: {fillers}"
    for step, ((loss, norm, tokens), (ref_loss, ref_norm, ref_tokens)) in enumerate(
        zip(got_run["steps"], ref_run["steps"]), start=1
    ):
        # a filler micro-batch (a rank that keeps no group) runs tokens that train nothing: counted, and exactly known
        tokens, ref_tokens = tokens - fillers[step - 1], ref_tokens - ref_fillers[step - 1]
        assert tokens == ref_tokens, f"step {step}: {tokens} tokens vs {ref_tokens}"
        assert_within(abs(loss - ref_loss), case.tol, f"step {step} loss (absolute): {loss} vs {ref_loss}")
        assert ref_norm > 0, f"step {step} trains nothing"
        assert_within(abs(norm - ref_norm) / ref_norm, case.tol, f"step {step} grad norm: {norm} vs {ref_norm}")
    if got_run["layout"]["dp"] == 2:  # ranks with different media: the same collectives, no hang
        assert _text_only_rank_step(got_run["grpo"][0]["images"], got_run["grpo"][1]["images"]), name
    balanced = "data.dataloader_param.balance" in case.overrides
    if balanced:  # completions moved between ranks by the plan, which the log line shows
        assert all(0 < stats["planned_imbalance"] < 2 for stats in got_run["grpo"][0]["stats"])
        if "training.grpo.dynamic_sampling" not in case.overrides:  # (else a later round's prompts count as moved)
            assert sum(sum(record["moved_prompts"]) for record in got_run["grpo"]) > 0, "no completion changed rank"
        if "training.micro_batch_tokens" in case.overrides:
            budget = case.overrides["training.micro_batch_tokens"]
            assert all(step[2] <= budget for record in got_run["grpo"] for step in record["budget"])
    if "training.micro_batch_tokens" in case.overrides and not balanced:  # counts differ between ranks and steps
        budget = case.overrides["training.micro_batch_tokens"]
        within, run = ([[step[k] for step in record["budget"]] for record in got_run["grpo"]] for k in (0, 1))
        assert run[0] == run[1] and len(set(run[0])) > 1, f"micro-batches run per step and rank: {run}"
        assert any(a != b for a, b in zip(*within)), f"micro-batches within the budget per step and rank: {within}"
        assert all(step[2] <= budget for record in got_run["grpo"] for step in record["budget"])
    got, expected = got_run["grpo"][0]["stats"], ref_run["grpo"][0]["stats"]
    if "training.val_interval" in case.overrides:  # the held-out loss and greedy rewards after every step
        assert got_run["val"].keys() == ref_run["val"].keys() == {1, 2, 3}
        got = [{**stats, **got_run["grpo"][0]["val"][step], "val_loss": got_run["val"][step]}
               for step, stats in enumerate(got, start=1)]
        expected = [{**stats, **ref_run["grpo"][0]["val"][step], "val_loss": ref_run["val"][step]}
                    for step, stats in enumerate(expected, start=1)]
        assert all({"val_loss", "val_reward", "val_rewards/accuracy/mean", "val_rewards/shared_letters/mean"}
                   <= set(stats) for stats in expected)
        assert any(stats["val_rewards/shared_letters/mean"] > 0 for stats in expected), "greedy rewards all 0"
    for step, (ours, ref) in enumerate(zip(got, expected), start=1):
        assert ours.keys() - {"planned_imbalance"} == ref.keys()
        for key in ref:
            if key.startswith("time/"):  # wall-clock seconds of the step's phases, not numerics
                continue
            a, b = ours[key], ref[key]
            relative = abs(a - b) / abs(b) if b else abs(a - b)
            assert_within(min(relative, abs(a - b)), case.tol, f"step {step} {key}: {a} vs {b}")
