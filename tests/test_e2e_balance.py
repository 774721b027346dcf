"""Token-budget micro-batches with data-parallel balance through the real trainer: parity and exact resume.

fp32 on gloo, 5 steps, on variable-length data (rows of 1–2 images of different sizes, 16x16 ones of a single
merged token included, and text-only rows: `parity.py`'s `mixed`, the dataset of `test_e2e_text_only_parity.py`,
whose 1-process fixed-batch run of tiny Mistral3 is this file's `ref` too). On 2 processes every optimizer step takes
the same 4 samples as the 1-process run (`dp × micro_batch_size × gradient_accumulation_steps`), but
`training.micro_batch_tokens` and `data.dataloader_param.balance` decide which rank runs which sample in how
many micro-batches (the same number on both ranks, asserted per step). The loss and gradient norm of every
step must equal the 1-process fixed-batch run's (relative difference <= 1e-5):

- tiny Mistral3: budget + balance, loss `default`; the same packed (one packed row per micro-batch);
  budget + balance with `per_sample`; budget + balance under Ulysses 2 (one CP group of 2 ranks, DP 1: the
  plan is over the one DP rank, and both CP ranks must run the same micro-batches, asserted);
- tiny Qwen3-VL (DeepStack, M-RoPE): budget + balance with `per_token`;
- tiny Qwen3-VL-MoE: budget + balance with expert parallel 2 (router aux loss on).

Resume through the app: the 2-process budget + balance run is SIGKILLed (launcher and ranks) once its step-3
checkpoint is published and restarted with the same command; the restart must say it resumed at step 3, log
steps 4–5 once (its first logged step is 4), and every step's loss, gradient norm, token count and planned
imbalance must equal the uninterrupted in-process run's bitwise (the same samples, in the same micro-batches).

The cases are a table run by `tests/parity.py` (each world size spawned once).
"""

import json
from pathlib import Path

import pytest

import apprun
from apprun import MOE, MOE_ASSETS, QWEN, TINY
from mixed_data import text_only_share
from parity import QWEN_SETTINGS, STEPS, Case, Probe, assert_matches, dataset_dir, resolve, run_cases, session_dir

BUDGET = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


class StepPlans(Probe):
    """Per step of this rank: how many micro-batches it ran (and the plan's number), their rows, a fingerprint of
    their tokens and how many ranks the plan is over; and the balance meter's scalars at the end."""

    name = "plans"

    def attach(self, trainer) -> None:
        loader = trainer.loader
        self.plans, take = [], loader.next_step

        def next_step(num):
            batches = take(num)
            self.plans.append({
                "count": len(batches), "rows": [int(mb["input_ids"].shape[0]) for mb in batches],
                "ids": [int(mb["input_ids"].sum()) for mb in batches],
                "micro_batches": loader.current_step_plan.num_micro_batches if loader.step_mode else None,
                "plan_ranks": len(loader.current_step_plan.ranks) if loader.step_mode else None,
            })
            return batches

        loader.next_step = next_step

    def result(self, trainer) -> dict:
        return {"steps": self.plans, "metrics": trainer.balance_meter.scalars()}


BALANCED = {
    "training.micro_batch_size": 1,
    "training.gradient_accumulation_steps": 2,
    "training.micro_batch_tokens": BUDGET,
    "data.dataloader_param.balance": "true",
}
PER_SAMPLE = {"features.loss_cfg.loss_type": "per_sample"}
PER_TOKEN = {"features.loss_cfg.loss_type": "per_token"}
REF = {"training.micro_batch_size": 4}
MOE_SETTINGS = {
    "model.model_name_or_path": str(MOE_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(MOE_ASSETS),
    "parallel.expert_parallel_size": 1,
}
CHECKPOINTS = {"training.save_interval": 3, "training.log_interval": 1}
CASES = {
    case.name: case
    for case in [
        Case("ref", 1, TINY, REF),  # test_e2e_text_only_parity.py's `ref_mbs4`
        Case("ref_per_sample", 1, TINY, {**REF, **PER_SAMPLE}),
        Case("qwen_ref", 1, QWEN, {**QWEN_SETTINGS, **REF, **PER_TOKEN}),
        Case("moe_ref", 1, MOE, {**MOE_SETTINGS, **REF}),
        Case("balanced", 2, TINY, {**BALANCED, **CHECKPOINTS, "training.save": "{tmp}/ckpt/full"}, "ref",
             probes=(StepPlans,)),
        Case("balanced_packed", 2, TINY, {**BALANCED, "data.dataset_param.basic_parameters.packing": "true"}, "ref",
             probes=(StepPlans,)),
        Case("balanced_per_sample", 2, TINY, {**BALANCED, **PER_SAMPLE}, "ref_per_sample", probes=(StepPlans,)),
        Case("qwen_balanced", 2, QWEN, {**QWEN_SETTINGS, **BALANCED, **PER_TOKEN}, "qwen_ref", probes=(StepPlans,)),
        Case("balanced_ulysses2", 2, TINY, {
            **BALANCED, "training.gradient_accumulation_steps": 4, "parallel.ulysses_parallel_size": 2,
        }, "ref", probes=(StepPlans,)),
        Case("moe_balanced_ep2", 2, MOE, {**MOE_SETTINGS, **BALANCED, "parallel.expert_parallel_size": 2}, "moe_ref",
             probes=(StepPlans,)),
    ]
}
CP_RUNS = ("balanced_ulysses2",)
"""Runs of one CP group: both ranks hold the same micro-batches."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return session_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("balance")


@pytest.fixture(scope="module")
def results(tmp, shared):
    return run_cases(list(CASES.values()), tmp, shared)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.reference is not None])
def test_budget_and_balance_match_one_process(results, shared, name):
    assert text_only_share(dataset_dir(shared, "mixed")) >= 0.4
    assert_matches(results, CASES[name])
    per_rank = [plans["steps"] for plans in results[name]["plans"]]
    # the same number of forward/backward passes on both ranks, step by step, and the plan's number
    assert [[p["count"] for p in plans] for plans in per_rank] == [[p["micro_batches"] for p in per_rank[0]]] * 2
    # the plan is over the DP ranks: under Ulysses 2 on 2 processes one DP rank, whose micro-batches both CP ranks run
    dp = 1 if name in CP_RUNS else 2
    assert {p["plan_ranks"] for plans in per_rank for p in plans} == {dp}
    if name in CP_RUNS:
        assert per_rank[0] == per_rank[1], "the CP ranks of one group run the same micro-batches"
    else:
        assert [p["ids"] for p in per_rank[0]] != [p["ids"] for p in per_rank[1]], "DP ranks run different samples"
    # the budget really splits the samples of a rank's step differently from step to step
    counts = [p["count"] for p in per_rank[0]]
    assert len(set(counts)) > 1 or set(counts) != {2}, counts
    metrics = results[name]["plans"][0]["metrics"]
    assert metrics["rank_imbalance"] >= 1.0 and 0.0 <= metrics["padding_fraction"] < 1.0
    assert metrics["planned_imbalance"] >= 1.0


def _records(out: Path) -> dict[int, list[tuple]]:
    """Per step, what identifies it: loss, gradient norm, tokens and planned imbalance (of each logged row)."""
    by_step: dict[int, list[tuple]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step.setdefault(r["step"], []).append((r["loss"], r["grad_norm"], r["num_tokens"], r["planned_imbalance"]))
    return by_step


def test_killed_and_restarted_run_continues_on_the_exact_next_sample(results, tmp, shared):
    reference = _records(tmp / "out" / "balanced")
    assert sorted(reference) == list(range(1, STEPS + 1))
    out = tmp / "out" / "killed"
    resume = {"training.save": out / "ckpt", "training.load": out / "ckpt"}
    killed = Case("killed", 2, TINY, {**BALANCED, **CHECKPOINTS, **resume})
    cmd = apprun.command(TINY, dict(item.split("=", 1) for item in resolve(killed, tmp, shared)["overrides"]))
    restart, before = apprun.kill_and_restart(cmd, out, 3, STEPS)
    first = next(line for line in restart.stdout.splitlines() if "step " in line and f"/{STEPS} |" in line)
    assert f"step 4/{STEPS}" in first, f"the restart's first logged step is not 4: {first}"
    for step, rows in _records(out).items():
        assert rows == reference[step], f"step {step}: {rows} vs the uninterrupted run's {reference[step]}"
