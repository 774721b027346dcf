"""DPO kill-and-resume through the real app: a 2-process qwen3vl-tiny DPO run SIGKILLed after its step-3 checkpoint
and restarted with the same command continues bitwise — per-step loss, gradient norm, tokens and every
preference statistic equal the uninterrupted run's — with the frozen FSDP2 reference (rebuilt from the initial
weights on restart) and with the precomputed reference (read back from `ref_logps.safetensors`, not recomputed).
The restart proves it resumed: it says so, its first logged step is 4, and metrics.jsonl holds each step once.
"""

import json
from pathlib import Path

import pytest

import apprun
from mmfsdp.model.preference import PAIR_STATS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STEPS = 6


def _items(data: Path, out: Path, **extra) -> dict:
    return {
        **apprun.synthetic_items(data, num_train=48, num_eval=4),
        **apprun.run_items(out, steps=STEPS, micro_batch_size=2, accumulation=2),
        "data.dataset_param.dataset_type": "synthetic_shapes_pairs",
        "data.dataset_param.attr.ranking": "true",
        "data.dataset_param.preprocess_parameters.cutoff_len": 96,
        "training.stage": "dpo",
        "training.lr": 2.0e-4,
        "training.save_interval": 3,
        "training.save": out / "ckpt",
        "training.load": out / "ckpt",
        **extra,
    }


def _rows(out: Path) -> dict[int, tuple]:
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["step"]] = (r["loss"], r["grad_norm"], r["num_tokens"], *(r[key] for key in PAIR_STATS))
    return rows


@pytest.mark.parametrize("precompute", [False, True], ids=["frozen_reference", "precomputed_reference"])
def test_dpo_kill_and_restart_continues_bitwise(tmp_path, precompute):
    extra = {"training.dpo.precompute_ref_logps": "true"} if precompute else {}
    reference_out = tmp_path / "reference"
    apprun.train_in_process(apprun.QWEN, _items(tmp_path, reference_out, **extra))
    reference = _rows(reference_out)
    assert sorted(reference) == list(range(1, STEPS + 1))
    out = tmp_path / "killed"
    cmd = apprun.command(apprun.QWEN, _items(tmp_path, out, **extra))
    restart, _ = apprun.kill_and_restart(cmd, out, 3, STEPS)
    first = next(line for line in restart.stdout.splitlines() if f"/{STEPS} |" in line)
    assert f"step 4/{STEPS}" in first, f"the restart's first logged step is not 4: {first}"
    if precompute:
        assert "reference log-probabilities from" in restart.stdout, restart.stdout[-2000:]
        assert "precomputing the reference" not in restart.stdout, restart.stdout[-2000:]
    rows = _rows(out)
    for step in range(1, STEPS + 1):
        assert rows[step] == reference[step], f"step {step}: {rows[step]} vs the uninterrupted run's {reference[step]}"
    assert reference[STEPS][0] < reference[1][0], "the run should learn"
