"""Reward functions for online RL, keyed by the names users write in YAML, and the set a run scores with.

A reward function takes one completion, its ground truth and its prompt, and returns a number:
`fn(completion: str, ground_truth, prompt, **options) -> float`. Registered ones (`register_reward`):

- `accuracy`  1 when the completion's answer (`<answer>...</answer>`, then `\\boxed{}`, else the whole text) equals
              the ground truth's: normalised exact match, the same number ("0.5" == "1/2" == "\\frac{1}{2}") or the
              same expression by sympy (`mmfsdp.data.answers`); else 0
- `format`    1 when the whole completion matches `pattern` (a regex, `re.DOTALL`; default: a `<think>...</think>`
              block, then `<answer>...</answer>`); else 0
- `iou`       the IoU of the completion's first box (Qwen-VL grounding: `(x1,y1),(x2,y2)`, inside
              `<|box_start|>...<|box_end|>` or not, or JSON `"bbox_2d": [...]`) with the ground-truth box (four numbers,
              a `bbox_2d` dict, or text in those formats); 0 without a box
- `choice`    1 when the completion's multiple-choice letter is the ground truth's; else 0

A user function is named `path/to/file.py:function` and loaded from that file (relative paths from the working
directory). Each spec (`RewardSpec`: `name`, `weight`, `timeout_s`, `options`, the function's keyword arguments)
is checked when `build_rewards` builds the `RewardSet`: an unknown name, a bad option or a file that does not load
is a `ConfigError` under the spec's key (`rewards[1].name: ...`).

`RewardSet.score(completions, ground_truths, prompts)` returns the weighted total `[N]` (float32), each function's
rewards `[F, N]` and this call's counters. A call that raises, returns something that is not a finite number, or
runs past its function's `timeout_s` scores 0 and is counted per function (`errors`, `timeouts`; the last error's
message is kept for the log); the run goes on.

Timeouts: every call runs in a worker process (`num_workers` of them, started with `fork` on first use, as
PyTorch's DataLoader workers are, so that functions loaded from files need no pickling and a worker starts in
milliseconds). The parent sends one call at a time to an idle worker and waits on all busy workers' pipes until the
earliest deadline; a worker past its deadline is killed (SIGKILL) and reaped at once, and a fresh one is forked
when next needed. This bounds anything — a regex that backtracks forever, sympy raising a tower of powers, C code
that never checks for signals, a function that ignores exceptions — which `signal.alarm` in the main thread would
not, and it works from any thread. Nothing outlives the set: `close()` (or leaving its `with` block, or its garbage
collection) stops the workers, and a worker whose parent dies exits when its pipe closes.
Arguments travel to the workers by pickling: prompts should be text (or small), not decoded images.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import multiprocessing
import numbers
import os
import re
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mmfsdp.config import ConfigError, Registry
from mmfsdp.data.answers import answers_equal, box_iou, extract_answer, extract_choice, parse_box

__all__ = [
    "RewardFn",
    "RewardSpec",
    "RewardSet",
    "build_rewards",
    "register_reward",
    "reward_names",
    "DEFAULT_FORMAT_PATTERN",
]

RewardFn = Callable[..., float]
"""`fn(completion: str, ground_truth: Any, prompt: Any, **options) -> float`."""

_REWARDS: Registry[RewardFn] = Registry("reward function", "rewards")

DEFAULT_FORMAT_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"
"""`format`'s default: a think block, then an answer block, nothing else."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register a reward function under `name` (the name users write in YAML)."""

    def register(fn: RewardFn) -> RewardFn:
        return _REWARDS.register(name, fn)

    return register


def reward_names() -> list[str]:
    return _REWARDS.names()


@register_reward("accuracy")
def accuracy(completion: str, ground_truth: Any, prompt: Any = None) -> float:
    truth = extract_answer(str(ground_truth))
    return float(answers_equal(extract_answer(completion), truth))


@register_reward("format")
def format_reward(completion: str, ground_truth: Any = None, prompt: Any = None, *,
                  pattern: str = DEFAULT_FORMAT_PATTERN) -> float:
    return float(re.fullmatch(pattern, completion, re.DOTALL) is not None)


@register_reward("iou")
def iou(completion: str, ground_truth: Any, prompt: Any = None) -> float:
    truth = parse_box(ground_truth)
    if truth is None:
        raise ValueError(f"ground truth {ground_truth!r} is not a box")
    box = parse_box(extract_answer(completion)) or parse_box(completion)
    return box_iou(box, truth) if box is not None else 0.0


@register_reward("choice")
def choice(completion: str, ground_truth: Any, prompt: Any = None) -> float:
    truth = extract_choice(str(ground_truth))
    if truth is None:
        raise ValueError(f"ground truth {ground_truth!r} names no choice letter")
    return float(extract_choice(completion) == truth)


@dataclass(kw_only=True, slots=True)
class RewardSpec:
    """One reward function of a run, as written in YAML."""

    name: str
    """A registered reward function, or `path/to/file.py:function`."""
    weight: float = 1.0
    """Its weight in the total reward."""
    timeout_s: float = 10.0
    """Bound on one call; a call past it scores 0 and counts as a timeout."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the function (`format`: `pattern`)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("name", f"must name a reward function, got {self.name!r}")
        if not isinstance(self.weight, numbers.Real) or not math.isfinite(self.weight):
            raise ConfigError("weight", f"must be a finite number, got {self.weight!r}")
        if not isinstance(self.timeout_s, numbers.Real) or not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be a positive number of seconds, got {self.timeout_s!r}")
        if not isinstance(self.options, dict):
            raise ConfigError("options", f"must be a mapping of keyword arguments, got {self.options!r}")


def _load_user_function(name: str, key: str) -> RewardFn:
    path, _, function = name.rpartition(":")
    if not Path(path).is_file():
        raise ConfigError(key, f"{name!r}: no file {path!r} (from {Path.cwd()})")
    spec = importlib.util.spec_from_file_location(f"mmfsdp_user_reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ConfigError(key, f"{name!r}: importing {path} failed: {type(error).__name__}: {error}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(key, f"{name!r}: {path} has no function {function!r}")
    return fn


def _check_options(fn: RewardFn, spec: RewardSpec, key: str) -> None:
    parameters = inspect.signature(fn).parameters
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in parameters.values()):
        raise ConfigError(f"{key}.name", f"{spec.name!r} must take (completion, ground_truth, prompt, **options)")
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    known = {p.name for p in parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    for option in spec.options:
        if not takes_any and (option not in known or option in {p.name for p in positional[:3]}):
            raise ConfigError(f"{key}.options.{option}", f"{spec.name!r} has no option {option!r}")
    if fn is format_reward and "pattern" in spec.options:
        try:
            re.compile(spec.options["pattern"])
        except (re.error, TypeError) as error:
            raise ConfigError(f"{key}.options.pattern", f"not a regular expression: {error}") from None


def build_rewards(specs: Sequence[RewardSpec | dict | str], *, key: str = "rewards", num_workers: int = 1) -> RewardSet:
    """The `RewardSet` of `specs` (each a `RewardSpec`, its YAML mapping or just a name), checked (module
    docstring); `key` is their YAML key path, for errors."""
    if not specs:
        raise ConfigError(key, f"no reward function given; name one or more of {', '.join(reward_names())}")
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    built, functions = [], []
    for index, spec in enumerate(specs):
        at = f"{key}[{index}]"
        if isinstance(spec, str):
            spec = {"name": spec}
        if isinstance(spec, dict):
            unknown = set(spec) - set(RewardSpec.__dataclass_fields__)
            if unknown:
                expected = ", ".join(RewardSpec.__dataclass_fields__)
                raise ConfigError(f"{at}.{sorted(unknown)[0]}", f"unknown key; expected one of {expected}")
            try:
                spec = RewardSpec(**spec)
            except ConfigError as error:
                raise error.under(at) from None
            except TypeError:
                raise ConfigError(f"{at}.name", "missing") from None
        if ":" in spec.name and spec.name.rpartition(":")[0].endswith(".py"):
            fn = _load_user_function(spec.name, f"{at}.name")
        else:
            fn = _REWARDS.get(spec.name, key=f"{at}.name")
        _check_options(fn, spec, at)
        built.append(spec)
        functions.append(fn)
    return RewardSet(built, functions, num_workers=num_workers)


# -- the workers ------------------------------------------------------------------------------------------------------


def _run(conn, parent_pid: int, functions: list[RewardFn], options: list[dict]) -> None:
    """A worker: (function index, completion, ground truth, prompt) in, ("ok", value) or ("error", message) out.
    It exits when told (None), when its pipe closes, or when its parent is gone (a pipe end inherited by a sibling
    worker would keep the pipe open)."""
    while True:
        try:
            while not conn.poll(1.0):
                if os.getppid() != parent_pid:
                    return
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, completion, ground_truth, prompt = task
        try:
            value = functions[index](completion, ground_truth, prompt, **options[index])
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"returned {value!r}, not a finite number")
            reply = ("ok", float(value))
        except BaseException as error:  # whatever user code raises is its error, counted by the parent
            reply = ("error", f"{type(error).__name__}: {error}")
        conn.send(reply)


class _Worker:
    def __init__(self, context, functions, options):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_run, args=(child, os.getpid(), functions, options), daemon=True)
        self.process.start()
        child.close()
        self.task: tuple[int, int] | None = None
        """(function, completion) of the call in flight."""
        self.deadline = math.inf

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    while workers:
        workers.pop().stop()


class RewardSet:
    """The reward functions of a run with their weights, scoring completions in worker processes (module
    docstring). Use it in a `with` block or `close()` it."""

    def __init__(self, specs: list[RewardSpec], functions: list[RewardFn], *, num_workers: int = 1):
        self.specs = specs
        self.names = [spec.name for spec in specs]
        self.weights = torch.tensor([float(spec.weight) for spec in specs], dtype=torch.float32)
        self.totals = {name: {"errors": 0, "timeouts": 0} for name in self.names}
        """Counters since the set was built, per function."""
        self.last_errors: dict[str, str] = {}
        """The last error message of each function that had one."""
        self._functions = functions
        self._num_workers = num_workers
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes (a later `score` starts new ones)."""
        _stop_all(self._workers)

    def _start_worker(self) -> _Worker:
        context = multiprocessing.get_context("fork")
        worker = _Worker(context, self._functions, [spec.options for spec in self.specs])
        self._workers.append(worker)
        return worker

    def score(
        self, completions: Sequence[str], ground_truths: Sequence[Any], prompts: Sequence[Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, dict[str, int]]]:
        """The weighted total `[N]`, each function's rewards `[F, N]` (float32) and this call's counters
        `{name: {"errors": e, "timeouts": t}}` of `N` completions."""
        if len(ground_truths) != len(completions) or (prompts is not None and len(prompts) != len(completions)):
            raise ValueError(
                f"{len(completions)} completions, {len(ground_truths)} ground truths"
                + ("" if prompts is None else f", {len(prompts)} prompts")
                + ": one of each per completion"
            )
        prompts = [None] * len(completions) if prompts is None else prompts
        rewards = torch.zeros(len(self.specs), len(completions), dtype=torch.float32)
        counters = {name: {"errors": 0, "timeouts": 0} for name in self.names}
        pending = [(f, n) for f in range(len(self.specs)) for n in range(len(completions))][::-1]
        while pending or any(worker.task for worker in self._workers):
            idle = [worker for worker in self._workers if worker.task is None]
            while pending and (idle or len(self._workers) < self._num_workers):
                worker = idle.pop() if idle else self._start_worker()
                f, n = pending.pop()
                try:
                    worker.conn.send((f, completions[n], ground_truths[n], prompts[n]))
                except (BrokenPipeError, OSError):  # an idle worker died (killed from outside): use a fresh one
                    pending.append((f, n))
                    worker.kill()
                    self._workers.remove(worker)
                    continue
                worker.task, worker.deadline = (f, n), time.monotonic() + self.specs[f].timeout_s
            busy = [worker for worker in self._workers if worker.task]
            earliest = min(worker.deadline for worker in busy)
            ready = set(wait([worker.conn for worker in busy], timeout=max(earliest - time.monotonic(), 0.0)))
            now = time.monotonic()
            for worker in busy:
                f, n = worker.task
                name = self.names[f]
                if worker.conn in ready:
                    try:
                        status, value = worker.conn.recv()
                    except (EOFError, OSError):  # the worker died (os._exit, a crash in C code)
                        status, value = "error", f"the worker process died (exit code {worker.process.exitcode})"
                        worker.kill()
                        self._workers.remove(worker)
                    if status == "ok":
                        rewards[f, n] = value
                    else:
                        counters[name]["errors"] += 1
                        self.last_errors[name] = value
                    worker.task, worker.deadline = None, math.inf
                elif now >= worker.deadline:
                    counters[name]["timeouts"] += 1
                    self.last_errors[name] = f"timed out after {self.specs[f].timeout_s:g} s"
                    worker.kill()
                    self._workers.remove(worker)
        for name, counts in counters.items():
            for kind, count in counts.items():
                self.totals[name][kind] += count
        return (self.weights[:, None] * rewards).sum(dim=0), rewards, counters
