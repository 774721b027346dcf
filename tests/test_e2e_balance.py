"""Token-budget micro-batches with data-parallel balance through the real trainer: parity and exact resume.

fp32 on gloo, 5 steps, on variable-length data (rows of 1–2 images of different sizes, 16x16 ones of a single
merged token included, and text-only rows, `tests/mixed_data.py`). On 2 processes every optimizer step takes
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

Each world size is spawned once and runs its trainers in turn.
"""

import json
from pathlib import Path

import pytest

import apprun
from mixed_data import make_mixed_dataset, text_only_share
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
QWEN = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
QWEN_ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
MOE = ROOT / "examples" / "qwen3vl-moe-tiny" / "config.yaml"
ASSETS = {QWEN: QWEN_ASSETS, MOE: ROOT / "examples" / "qwen3vl-moe-tiny" / "assets"}
STEPS = 5
TOL = 1e-5
BUDGET = 240
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _overrides(tmp: Path, name: str, config: Path, **extra) -> list[str]:
    items = {
        "data.dataset_param.dataset_type": "huggingface",
        "data.dataset_param.basic_parameters.dataset": str(tmp / "mixed" / "train.jsonl"),
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "mixed"),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache" / config.parent.name),
        "data.dataset_param.preprocess_parameters.cutoff_len": 160,
        "data.dataloader_param.num_workers": 0,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **({"model.model_name_or_path": str(ASSETS[config]),
            "data.dataset_param.preprocess_parameters.model_name_or_path": str(ASSETS[config])}
           if config in ASSETS else {}),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


BALANCED = {
    "training.micro_batch_size": 1,
    "training.gradient_accumulation_steps": 2,
    "training.micro_batch_tokens": BUDGET,
    "data.dataloader_param.balance": "true",
}
PER_SAMPLE = {"features.loss_cfg.loss_type": "per_sample"}
PER_TOKEN = {"features.loss_cfg.loss_type": "per_token"}
REF = {"training.micro_batch_size": 4}
EP1 = {"parallel.expert_parallel_size": 1}
CHECKPOINTS = {"training.save_interval": 3, "training.log_interval": 1}

# name: (world size, config, overrides, reference)
RUNS = {
    "ref": (1, TINY, REF, None),
    "ref_per_sample": (1, TINY, {**REF, **PER_SAMPLE}, None),
    "qwen_ref": (1, QWEN, {**REF, **PER_TOKEN}, None),
    "moe_ref": (1, MOE, {**REF, **EP1}, None),
    "balanced": (2, TINY, {**BALANCED, **CHECKPOINTS, "training.save": "{tmp}/ckpt/full"}, "ref"),
    "balanced_packed": (2, TINY, {**BALANCED, "data.dataset_param.basic_parameters.packing": "true"}, "ref"),
    "balanced_per_sample": (2, TINY, {**BALANCED, **PER_SAMPLE}, "ref_per_sample"),
    "qwen_balanced": (2, QWEN, {**BALANCED, **PER_TOKEN}, "qwen_ref"),
    "balanced_ulysses2": (
        2, TINY, {**BALANCED, "training.gradient_accumulation_steps": 4, "parallel.ulysses_parallel_size": 2}, "ref"
    ),
    "moe_balanced_ep2": (2, MOE, {**BALANCED, "parallel.expert_parallel_size": 2}, "moe_ref"),
}
CP_RUNS = ("balanced_ulysses2",)
"""Runs of one CP group: both ranks hold the same micro-batches."""


def _train(rank, world_size, tmp, runs):
    from mmfsdp.train.trainer import Trainer

    results = {}
    for name, config, overrides in runs:
        trainer = Trainer(load_config(config, overrides), "cpu")
        loader = trainer.loader
        plans, take = [], loader.next_step

        def next_step(num, take=take):
            batches = take(num)
            plans.append({"count": len(batches), "rows": [int(mb["input_ids"].shape[0]) for mb in batches],
                          "ids": [int(mb["input_ids"].sum()) for mb in batches],
                          "micro_batches": loader.current_step_plan.num_micro_batches if loader.step_mode else None,
                          "plan_ranks": len(loader.current_step_plan.ranks) if loader.step_mode else None})
            return batches

        loader.next_step = next_step
        trainer.train()
        results[name] = {
            "steps": [(r.loss, r.grad_norm) for r in trainer.history],
            "plans": plans,
            "metrics": trainer.balance_meter.scalars(),
        }
        trainer.close()
    return results


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("balance")
    make_mixed_dataset(tmp / "mixed", num_train=40, num_eval=4, seed=11)
    return tmp


@pytest.fixture(scope="module")
def results(tmp):
    out = {}
    for world_size in (1, 2):
        runs = [
            (name, str(config), [item.format(tmp=tmp) for item in _overrides(tmp, name, config, **extra)])
            for name, (world, config, extra, _) in RUNS.items()
            if world == world_size
        ]
        per_rank = run_distributed(_train, world_size, str(tmp), runs, timeout=900)
        for name in per_rank[0]:
            out[name] = {**per_rank[0][name], "per_rank": per_rank}
    return out


def _close(value: float, reference: float) -> bool:
    return abs(value - reference) <= TOL * abs(reference)


@pytest.mark.parametrize("name", [name for name, run in RUNS.items() if run[3] is not None])
def test_budget_and_balance_match_one_process(results, tmp, name):
    assert text_only_share(tmp / "mixed") >= 0.4
    ref = RUNS[name][3]
    got, expected = results[name], results[ref]
    assert len(got["steps"]) == len(expected["steps"]) == STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got["steps"], expected["steps"]), 1):
        assert _close(loss, ref_loss), f"{name}, step {step}: loss {loss} vs {ref_loss} ({ref})"
        assert _close(norm, ref_norm), f"{name}, step {step}: grad norm {norm} vs {ref_norm} ({ref})"
    per_rank = [r[name]["plans"] for r in got["per_rank"]]
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
    metrics = got["metrics"]
    assert metrics["rank_imbalance"] >= 1.0 and 0.0 <= metrics["padding_fraction"] < 1.0
    assert metrics["planned_imbalance"] >= 1.0


def _records(out: Path) -> dict[int, list[tuple]]:
    """Per step, what identifies it: loss, gradient norm, tokens and planned imbalance (of each logged row)."""
    by_step: dict[int, list[tuple]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step.setdefault(r["step"], []).append((r["loss"], r["grad_norm"], r["num_tokens"], r["planned_imbalance"]))
    return by_step


def test_killed_and_restarted_run_continues_on_the_exact_next_sample(results, tmp):
    reference = _records(tmp / "out" / "balanced")
    assert sorted(reference) == list(range(1, STEPS + 1))
    name, out = "killed", tmp / "out" / "killed"
    items = _overrides(tmp, name, TINY, **BALANCED, **CHECKPOINTS,
                       **{"training.save": out / "ckpt", "training.load": out / "ckpt"})
    cmd = apprun.command(TINY, dict(item.split("=", 1) for item in items))
    restart, before = apprun.kill_and_restart(cmd, out, 3, STEPS)
    first = next(line for line in restart.stdout.splitlines() if "step " in line and f"/{STEPS} |" in line)
    assert f"step 4/{STEPS}" in first, f"the restart's first logged step is not 4: {first}"
    for step, rows in _records(out).items():
        assert rows == reference[step], f"step {step}: {rows} vs the uninterrupted run's {reference[step]}"
