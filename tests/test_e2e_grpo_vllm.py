"""GRPO with `training.grpo.rollout.engine: vllm` through the app, against the same run with the hf engine.

The tiny Qwen3-VL (fp32, CPU), synthetic shapes as prompts (image and text-only rows), 3 steps:

- at temperature 0 (greedy generation, log-probs of the raw logits) the vllm run, on 2 FSDP2 processes (rank 1's
  prompts and weight shards reach the server through rank 0), completes rank 0's prompts as the one-process hf
  run does at every step (`completions.jsonl`, rank 0's), the engine's log-probs of both ranks' completions equal
  the trainer's within 1e-4, and with the vision tower frozen (both runs) the later syncs leave it out
  (`rollout/sync_mb`); a prompt's generations are all the same, so the advantages and losses are 0
  and the steps do not move the weights: the equality of engines on weights that change is
  `tests/test_vllm_rollout.py`'s, after 0, 1 and 5 optimizer steps), the losses agree within 1e-5 and the log-prob
  difference engine vs trainer is logged every step;
- the server killed (SIGKILL) mid-run: the run exits non-zero with one `rollout.engine vllm` error line within
  60 s, no server process is left, and the last checkpoint is whole (its tracker names a checkpoint that opens).
  That run samples (temperature 1, so the weights move) with `rollout.sync_interval: 2`: step 1 syncs and its
  engine log-probs equal the trainer's, step 2 does not sync (`time/sync_s` 0, `rollout/weights_lag` 1) and its
  completions come from step 1's weights, whose log-probs differ from the updated policy's by far more.

Marked `vllm` and `slow`: it needs the vLLM environment (`uv run python tools/vllm_env/setup.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from apprun import QWEN, QWEN_ASSETS, ROOT, command, descendants, records, run, run_items, synthetic_items
from test_vllm_env import _vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
REWARDS = f"[accuracy, '{ROOT / 'tests' / 'grpo_rewards.py'}:shared_letters']"


def _items(tmp: Path, out: Path, engine: str, steps: int = 3, **extra) -> dict:
    return {
        **synthetic_items(tmp, num_train=16, num_eval=4),
        **run_items(out, steps=steps, micro_batch_size=2, accumulation=1),
        "model.model_name_or_path": QWEN_ASSETS,
        "data.dataset_param.preprocess_parameters.model_name_or_path": QWEN_ASSETS,
        "training.stage": "grpo",
        "training.lr": 1.0e-2,
        "training.grpo.num_generations": 2,
        "training.grpo.max_completion_length": 6,
        "training.grpo.temperature": 0,
        "training.grpo.reward_funcs": REWARDS,
        "training.grpo.log_completions_interval": 1,
        "training.grpo.rollout.engine": engine,
        "training.grpo.rollout.vllm.python": _vllm_python(),
        "training.grpo.rollout.vllm.request_timeout_s": 120,
        **extra,
    }


def _completions(out: Path) -> dict[int, list]:
    by_step: dict[int, list] = {}
    for line in (out / "completions.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append((row["prompt_index"], row.get("completion")))
    return {step: sorted(rows, key=repr) for step, rows in by_step.items()}


def _servers(pid: int) -> list[int]:
    found = []
    for p in descendants(pid)[1:]:
        try:
            if b"vllm_server.py" in Path(f"/proc/{p}/cmdline").read_bytes():
                found.append(p)
        except OSError:
            pass
    return found


def test_vllm_engine_run_equals_hf_engine_run(tmp_path):
    # the vllm run on 2 FSDP2 processes (rank 1's prompts and weights reach the server through rank 0), the hf run
    # on one, the same 2 prompts a step; the vision tower frozen in both: the vllm run's later syncs leave it out
    outs, layouts = {}, {"hf": (1, 2), "vllm": (2, 1)}
    for engine, (nproc, micro) in layouts.items():
        outs[engine] = tmp_path / engine
        items = _items(tmp_path, outs[engine], engine, **{"training.micro_batch_size": micro,
                                                          "model.freeze": "[model.visual]"})
        run(command(QWEN, items, nproc=nproc), timeout=900)
    completions = {engine: _completions(out) for engine, out in outs.items()}
    assert sorted(completions["hf"]) == sorted(completions["vllm"]) == [1, 2, 3]
    for step, rows in completions["vllm"].items():  # rank 0's prompts (completions.jsonl): the same completions
        assert rows and all(row in completions["hf"][step] for row in rows), (step, rows, completions["hf"][step])
    for rows in completions["hf"].values():  # greedy: a prompt's two generations are the same
        by_prompt = {}
        for prompt, completion in rows:
            by_prompt.setdefault(prompt, set()).add(completion)
        assert all(len(texts) == 1 for texts in by_prompt.values()), rows
    hf, vllm = ({r["step"]: r for r in records(outs[e]) if "loss" in r} for e in ("hf", "vllm"))
    assert sorted(vllm) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(vllm[step]["loss"] - hf[step]["loss"]) <= 1e-5 * max(1.0, abs(hf[step]["loss"])), (step, hf, vllm)
        print(f"step {step}: loss hf {hf[step]['loss']:.8f} vllm {vllm[step]['loss']:.8f}; logprob diff mean "
              f"{vllm[step]['rollout/logprob_diff_mean']:.2e} max {vllm[step]['rollout/logprob_diff_max']:.2e}; "
              f"sync {vllm[step]['time/sync_s']:.3f} s {vllm[step]['rollout/sync_mb']:.3f} MB "
              f"{vllm[step]['rollout/sync_gbps']:.3f} GB/s")
        assert vllm[step]["rollout/logprob_diff_max"] <= 1e-4  # both ranks' completions (a max over ranks)
    assert vllm[1]["rollout/sync_mb"] > vllm[2]["rollout/sync_mb"] == vllm[3]["rollout/sync_mb"] > 0


def test_server_killed_mid_run_stops_the_run(tmp_path):
    from mmfsdp.ckpt.dcp_io import read_dcp_metadata
    from mmfsdp.ckpt.layout import resolve_checkpoint

    out = tmp_path / "run"
    items = _items(tmp_path, out, "vllm", steps=40, **{"training.save": out / "ckpt", "training.save_interval": 1,
                                                       "training.grpo.temperature": 1.0,
                                                       "training.grpo.rollout.sync_interval": 2})
    proc = subprocess.Popen(command(QWEN, items, nproc=1), cwd=ROOT, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tracker = out / "ckpt" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 900
    while not (tracker.is_file() and int(tracker.read_text().strip() or 0) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
        time.sleep(0.2)
    servers = _servers(proc.pid)
    assert len(servers) == 1, servers
    os.kill(servers[0], signal.SIGKILL)
    killed = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the run did not stop within 60 s of the server's death")
    print(f"stopped {time.monotonic() - killed:.1f} s after the kill")
    assert proc.returncode != 0
    assert "error: rollout.engine vllm:" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not [p for p in _servers(proc.pid)], "a server outlived its run"
    path, iteration = resolve_checkpoint(out / "ckpt")
    assert iteration >= 2 and read_dcp_metadata(path).state_dict_metadata
    logged = {r["step"]: r for r in records(out) if "loss" in r}
    assert [logged[s]["rollout/weights_lag"] for s in (1, 2)] == [0, 1]
    assert logged[1]["time/sync_s"] > 0 and logged[2]["time/sync_s"] == 0
    assert logged[1]["rollout/sync_mb"] > 3 and logged[2]["rollout/sync_mb"] == 0  # the tiny model: 3.4 MB
    assert logged[1]["rollout/logprob_diff_max"] <= 1e-4 < 1e-2 < logged[2]["rollout/logprob_diff_max"], logged
