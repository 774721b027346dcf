"""Helpers for end-to-end tests that drive the real app as its command line runs it (`python apps/train CONFIG ...`,
forked with its imports done: `toolrun`), and the paths every end-to-end test names (the repository root, the app, the tiny examples' configs and model directories).

Imported by the tests as `apprun` (the `tests` directory is on pytest's `pythonpath`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mmfsdp.parallel.testing import record_margin
from toolrun import run_tool, start_script

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "train"
EXAMPLES = ROOT / "examples"
TINY = EXAMPLES / "tiny" / "config.yaml"
"""The default run's config: a tiny Mistral3 (its tokenizer and processor in `examples/tiny/assets`)."""
TINY_ASSETS = EXAMPLES / "tiny" / "assets"
QWEN = EXAMPLES / "qwen3vl-tiny" / "config.yaml"
QWEN_ASSETS = EXAMPLES / "qwen3vl-tiny" / "assets"
MOE = EXAMPLES / "qwen3vl-moe-tiny" / "config.yaml"
MOE_ASSETS = EXAMPLES / "qwen3vl-moe-tiny" / "assets"
QWEN3_5 = EXAMPLES / "qwen3_5-tiny" / "config.yaml"
QWEN3_5_ASSETS = EXAMPLES / "qwen3_5-tiny" / "assets"


def close(value: float, reference: float, rel: float = 1e-5, what: str = "") -> bool:
    """`value` within `rel` of `reference`, relative to the reference (the parity tolerance, fp32 on the CPU).

    The relative difference is recorded against `rel` where `MMFSDP_RECORD_MARGINS` is set (`record_margin`)."""
    difference = abs(value - reference)
    record_margin(difference / abs(reference) if reference else (0.0 if difference == 0 else math.inf), rel, what)
    return difference <= rel * abs(reference)


def synthetic_items(tmp: Path, *, num_train: int = 32, num_eval: int = 4) -> dict:
    """An example's synthetic shapes data under `tmp` (`tmp/data`, its tokenised cache `tmp/cache`)."""
    return {
        "data.dataset_param.basic_parameters.dataset_dir": tmp / "data",
        "data.dataset_param.basic_parameters.cache_dir": tmp / "cache",
        "data.dataset_param.synthetic.num_train": num_train,
        "data.dataset_param.synthetic.num_eval": num_eval,
    }


def run_items(out: Path, *, steps: int, micro_batch_size: int = 2, accumulation: int = 1, **extra) -> dict:
    """A short run into `out` that logs every step: its length, micro-batches and output directory."""
    return {
        "training.micro_batch_size": micro_batch_size,
        "training.gradient_accumulation_steps": accumulation,
        "training.train_iters": steps,
        "training.log_interval": 1,
        "training.output_dir": out,
        **extra,
    }


def overrides(items: dict) -> list[str]:
    """`key=value` command-line overrides from a dict."""
    return [f"{k}={v}" for k, v in items.items()]


def command(config: Path, items: dict, nproc: int = 2) -> list[str]:
    """The app's command line: config, overrides, then the launcher's world size."""
    return [sys.executable, str(APP), str(config), *overrides(items), "--nproc-per-node", str(nproc)]


def _script(cmd: list[str]) -> tuple[str, list[str]] | None:
    """`cmd`'s script and arguments where it is `python SCRIPT ARGS...` (the app, an example's script), else None."""
    if len(cmd) > 1 and cmd[0] == sys.executable and not cmd[1].startswith("-"):
        return cmd[1], cmd[2:]
    return None


def attempt(cmd: list[str], timeout: float = 600, env: dict[str, str] | None = None,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """Run the app to its end (in `env`, default this process's environment), whatever its exit status (a test of
    a run that must fail). `python SCRIPT ...` runs forked from the test ranks' forkserver, its imports done
    (`toolrun.run_tool`: the same process but for the interpreter start); `fresh` starts an interpreter for it."""
    script = None if fresh else _script(cmd)
    if script is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    return run_tool(*script, timeout=timeout, env=env)


def run(cmd: list[str], timeout: float = 600, env: dict[str, str] | None = None,
        fresh: bool = False) -> subprocess.CompletedProcess:
    """`attempt`, and a non-zero exit fails the test with the output's tail."""
    proc = attempt(cmd, timeout, env, fresh)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train_rank(rank: int, world_size: int, config: str, items: list[str]) -> None:
    from mmfsdp.train.config import load_config
    from mmfsdp.train.trainer import Trainer, start_rank

    cfg = load_config(config, items)
    trainer = Trainer(cfg, start_rank(cfg))
    trainer.train()
    trainer.close()


def train_in_process(config: Path, items: dict, nproc: int = 2) -> Path:
    """The run `command(config, items, nproc)` would train, without the app's launcher: the trainer its ranks run
    (`Trainer(load_config(...), start_rank(cfg)).train()`), on `nproc` gloo ranks of `run_distributed`, which fork
    from a process that has imported torch and transformers already (a second instead of the launcher's ~8 s).
    For a reference whose losses a test compares with an app run's: same code and data, so the same losses bitwise.
    Writes `training.output_dir` (metrics.jsonl, and checkpoints where `training.save` asks) and returns it."""
    from mmfsdp.data import prepare_dataset
    from mmfsdp.parallel.testing import run_distributed
    from mmfsdp.train.config import load_config

    prepare_dataset(load_config(config, overrides(items)).data)  # as the launcher does before it starts ranks
    run_distributed(_train_rank, nproc, str(config), overrides(items), timeout=600)
    return Path(items["training.output_dir"])


def first_losses(out: Path) -> dict[int, float]:
    """`losses(out)` of a run that logged each step once: step -> loss."""
    by_step = losses(out)
    assert all(len(values) == 1 for values in by_step.values()), by_step
    return {step: values[0] for step, values in by_step.items()}


def records(out: Path) -> list[dict]:
    """The rows of `out/metrics.jsonl` (a partly written last line, of a killed run, left out)."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def assert_steps_equal(out: Path, reference: dict[int, tuple], keys: tuple[str, ...] | list[str], steps: int) -> None:
    """`out/metrics.jsonl` logs each of steps 1..`steps` once, and each step's values of `keys` equal `reference`'s
    (step → values) bitwise: a resumed run continued as the uninterrupted one."""
    rows = records(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    for row in rows:
        got = tuple(row[k] for k in keys)
        expected = reference[row["step"]]
        assert got == expected, f"step {row['step']}: {dict(zip(keys, got))} vs {dict(zip(keys, expected))}"


def consoles(out: Path) -> list[str]:
    """The app launcher's log files under `out/logs` (its console and every rank's), one per run in the order they
    started: what a run started by `start`, whose console is not kept, printed."""
    return [log.read_text() for log in sorted((out / "logs").glob("train_*.log"))]


def losses(out: Path) -> dict[int, list[float]]:
    """Every logged loss of `out/metrics.jsonl` by step (one per step: a resumed run drops the rows after its
    checkpoint before it logs those steps again)."""
    by_step: dict[int, list[float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], []).append(record["loss"])
    return by_step


def logged_steps(out: Path) -> list[int]:
    """The steps of `out/metrics.jsonl` in the order they were logged."""
    path = out / "metrics.jsonl"
    return [json.loads(l)["step"] for l in path.read_text().splitlines()] if path.exists() else []


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher and every rank at once, as a crashed node would lose them."""
    for victim in descendants(pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(cmd: list[str]):
    """Start `cmd` in a session of its own, its output discarded (`python SCRIPT ...` forked as `run` does); a
    `subprocess.Popen` or its like (`toolrun.start_script`)."""
    script = _script(cmd)
    if script is None:
        return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    return start_script(*script)


def kill_when(proc: subprocess.Popen, ready, what: str, deadline_s: float = 600, poll_s: float = 0.05) -> None:
    """Poll `ready()` until it holds, then SIGKILL the whole run; fail if the run ends first."""
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        if ready():
            break
        if proc.poll() is not None:
            kill_tree(proc.pid)
            pytest.fail(f"the run ended before {what}")
        time.sleep(poll_s)
    else:
        kill_tree(proc.pid)
        pytest.fail(f"no {what} within {deadline_s:.0f} s")
    kill_tree(proc.pid)
    proc.wait()


def kill_after_checkpoint(cmd: list[str], save_dir: Path, iteration: int) -> None:
    """Start the run and SIGKILL it as soon as its tracker points at the step-`iteration` checkpoint."""
    tracker = save_dir / "latest_checkpointed_iteration.txt"
    kill_when(start(cmd), lambda: tracker.is_file() and tracker.read_text().strip() == str(iteration),
              f"its step-{iteration} checkpoint")


def kill_and_restart(cmd: list[str], out: Path, iteration: int, steps: int) -> tuple[subprocess.CompletedProcess, list[int]]:
    """SIGKILL the run of `cmd` (output `out`, checkpoints in `out/ckpt`) once its step-`iteration` checkpoint is
    published, restart the same command to its end and check that it resumed there: the restart says so, does not
    start at step 1, and `metrics.jsonl` then holds each of the steps 1..`steps` once (the rows the killed run logged
    after `iteration` are replaced by the restart's). Returns the restart and the steps logged before the kill."""
    kill_after_checkpoint(cmd, out / "ckpt", iteration)
    before = logged_steps(out)
    assert before[:iteration] == list(range(1, iteration + 1)) and max(before) < steps, before
    restart = run(cmd)
    assert "resumed from" in restart.stdout and f"at step {iteration}" in restart.stdout, restart.stdout[-2000:]
    assert "training starts at step 1" not in restart.stdout, restart.stdout[-2000:]
    after = logged_steps(out)
    assert after == list(range(1, steps + 1)), f"metrics.jsonl holds steps {after} after the restart"
    return restart, before
