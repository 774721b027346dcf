"""Token-budget micro-batches with data-parallel balance through the real trainer: parity and exact resume.

fp32 on gloo, 5 steps, on variable-length data (rows of 1–2 images of different sizes and text-only rows,
`tests/mixed_data.py`). On 2 processes every optimizer step takes the same 4 samples as the 1-process run
(`dp × micro_batch_size × gradient_accumulation_steps`), but `training.micro_batch_tokens` and
`data.dataloader_param.balance` decide which rank runs which sample in how many micro-batches (the same
number on both ranks, asserted per step). The loss and gradient norm of every step must equal the
1-process fixed-batch run's (relative difference <= 1e-5):

- tiny Mistral3: budget + balance, loss `default`; the same packed (one packed row per micro-batch);
  budget + balance with `per_sample`;
- tiny Qwen3-VL (DeepStack, M-RoPE): budget + balance with `per_token`.

Resume: a 2-process budget + balance run that dies right after its checkpoint of step 3 (an exception, in
process) and is started again with the same config resumes at step 3 (asserted: the trainer's step and the
loader's position) and gives steps 4–5 bitwise equal to the run that never stopped.

Each world size is spawned once and runs its trainers in turn.
"""

from pathlib import Path

import pytest

from mixed_data import make_mixed_dataset, text_only_share
from mmfsdp.data.synthetic import VARLEN_IMAGE_SIZES
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
QWEN = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
QWEN_ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
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
        **({"model.model_name_or_path": str(QWEN_ASSETS),
            "data.dataset_param.preprocess_parameters.model_name_or_path": str(QWEN_ASSETS)} if config == QWEN else {}),
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

# name: (world size, config, overrides, reference)
RUNS = {
    "ref": (1, TINY, REF, None),
    "ref_per_sample": (1, TINY, {**REF, **PER_SAMPLE}, None),
    "qwen_ref": (1, QWEN, {**REF, **PER_TOKEN}, None),
    "balanced": (2, TINY, {**BALANCED, "training.save": "{tmp}/ckpt/full"}, "ref"),
    "balanced_packed": (2, TINY, {**BALANCED, "data.dataset_param.basic_parameters.packing": "true"}, "ref"),
    "balanced_per_sample": (2, TINY, {**BALANCED, **PER_SAMPLE}, "ref_per_sample"),
    "qwen_balanced": (2, QWEN, {**BALANCED, **PER_TOKEN}, "qwen_ref"),
    "stopped": (2, TINY, {**BALANCED, "training.save_interval": 3, "training.save": "{tmp}/ckpt/resume"}, None),
    "resumed": (2, TINY, {**BALANCED, "training.save_interval": 3, "training.save": "{tmp}/ckpt/resume"}, None),
}


class _Killed(Exception):
    """Raised right after the checkpoint of step 3: the run dies there, as a killed one would."""


def _train(rank, world_size, tmp, runs):
    from mmfsdp.train.trainer import Trainer

    results = {}
    for name, config, overrides in runs:
        trainer = Trainer(load_config(config, overrides), "cpu")
        loader = trainer.loader
        start = {"step": trainer.step, "loader": dict(loader.state_dict())}
        plans, take = [], loader.next_step

        def next_step(num, take=take):
            batches = take(num)
            plans.append({"count": len(batches), "rows": [int(mb["input_ids"].shape[0]) for mb in batches],
                          "micro_batches": loader.current_step_plan.num_micro_batches if loader.step_mode else None})
            return batches

        loader.next_step = next_step
        if name == "stopped":
            checkpointer = trainer.checkpointer
            save = checkpointer.save

            def save_then_die(step, *, last=False, save=save, checkpointer=checkpointer):
                due = checkpointer.due(step, last=last)
                save(step, last=last)
                if due:
                    raise _Killed

            checkpointer.save = save_then_die
        try:
            trainer.train()
        except _Killed:
            pass
        results[name] = {
            "start": start,
            "steps": [(r.loss, r.grad_norm) for r in trainer.history],
            "plans": plans,
            "metrics": trainer.balance_meter.scalars(),
        }
        trainer.close()
    return results


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("balance")
    # no 16x16 image: a micro-batch whose only image is one merged token fails inside HF's Mistral3
    # (`get_image_features` squeezes the one-token feature to a vector), in any layout
    sizes = tuple(size for size in VARLEN_IMAGE_SIZES if size != (16, 16))
    make_mixed_dataset(tmp / "mixed", num_train=40, num_eval=4, seed=11, image_sizes=sizes)
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
    # the budget really splits the 2 samples of a rank's step differently from step to step
    counts = [p["count"] for p in per_rank[0]]
    assert len(set(counts)) > 1 or set(counts) != {2}, counts
    metrics = got["metrics"]
    assert metrics["rank_imbalance"] >= 1.0 and 0.0 <= metrics["padding_fraction"] < 1.0
    assert metrics["planned_imbalance"] >= 1.0


def test_resume_continues_on_the_exact_next_sample(results):
    stopped, resumed, full = results["stopped"], results["resumed"], results["balanced"]
    assert stopped["start"]["step"] == 0 and len(stopped["steps"]) == 3
    assert resumed["start"]["step"] == 3, "the second run must resume from the checkpoint of step 3"
    assert resumed["start"]["loader"]["step_in_epoch"] == 3
    assert len(resumed["steps"]) == 2
    assert stopped["steps"] == full["steps"][:3]
    assert resumed["steps"] == full["steps"][3:], "steps 4-5 after the resume equal the uninterrupted run's bitwise"
