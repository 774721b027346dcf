"""Reward functions (`mmfsdp.data.rewards`, `mmfsdp.data.answers`): the registered ones on hand-made completions,
user functions from files, weights, and calls that raise, return junk or never return (scored 0 and counted; no
worker process left behind)."""

from __future__ import annotations

import multiprocessing
import os
import textwrap
import time

import pytest
import torch
from mmfsdp.config import ConfigError
from mmfsdp.data.answers import answers_equal, extract_answer, extract_choice, parse_box
from mmfsdp.data.rewards import build_rewards


@pytest.mark.parametrize(
    ("answer", "truth"),
    [
        ("0.5", "1/2"),
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac12", "0.50"),
        ("$-\\frac{3}{4}$", "-0.75"),
        ("1,000", "1000"),
        ("\\text{Paris}.", "paris"),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
        ("2x + 1", "1 + 2x"),
        ("x^{2}-1", "(x-1)(x+1)"),
        ("2\\pi", "\\pi \\cdot 2"),
        ("\\sqrt[3]{8}", "2"),
        ("\\left(3\\right)", "3"),
    ],
)
def test_equivalent_answers(answer, truth):
    assert answers_equal(answer, truth) and answers_equal(truth, answer)


@pytest.mark.parametrize(
    ("answer", "truth"),
    [("3", "4"), ("0.333", "1/3"), ("x+1", "x+2"), ("", "0"), ("\\frac{1}{0}", "1"), ("1,2", "12")],
)
def test_different_answers(answer, truth):
    assert not answers_equal(answer, truth)


def test_untrusted_text_never_reaches_eval():
    """A completion is untrusted: anything outside the whitelist is compared as a string only."""
    marker = "__import__('os').system('touch /tmp/mmfsdp_reward_pwned')"
    assert not answers_equal(marker, "0")
    assert not answers_equal("x.__class__", "x")
    assert not os.path.exists("/tmp/mmfsdp_reward_pwned")


def test_answer_extraction():
    assert extract_answer("<think>2+2</think> <answer> so \\boxed{\\frac{1}{2}} </answer>") == "\\frac{1}{2}"
    assert extract_answer("first \\boxed{1}, then \\boxed{{a}+{b}}") == "{a}+{b}"
    assert extract_answer("<answer>1</answer><answer> 2 </answer>") == "2"
    assert extract_answer(" just 42 ") == "just 42"


@pytest.mark.parametrize(
    ("text", "letter"),
    [
        ("B", "B"), ("(C) because", "C"), ("B. cats", "B"), ("The answer is D.", "D"), ("Answer: E", "E"),
        ("I think (A) is right", "A"), ("<think>A or B?</think><answer>B</answer>", "B"), ("A or B", None),
        ("no idea", None), ("\\boxed{C}", "C"),
    ],
)
def test_choice_letters(text, letter):
    assert extract_choice(text) == letter


def test_box_formats():
    box = (10.0, 20.0, 30.0, 40.0)
    assert parse_box("<|object_ref_start|>cat<|object_ref_end|><|box_start|>(10,20),(30,40)<|box_end|>") == box
    assert parse_box("at (10, 20), (30, 40)") == box
    assert parse_box('```json\n[{"bbox_2d": [10, 20, 30, 40], "label": "cat"}]\n```') == box
    assert parse_box([{"bbox_2d": [10, 20, 30, 40]}]) == box
    assert parse_box([10, 20, 30, 40]) == box
    assert parse_box("no box") is None and parse_box([1, 2, 3]) is None


def test_registered_rewards():
    completions = [
        "<think>half</think><answer>\\frac{1}{2}</answer>",
        "<answer>0.4</answer>",
        "it is \\boxed{1/2}",
        "<think>x</think>\n<answer>(B)</answer>",
        "it is 1/2",
        '<answer>[{"bbox_2d": [0, 0, 10, 10]}]</answer>',
        "<|box_start|>(5,0),(15,10)<|box_end|>",
    ]
    truths = ["0.5", "0.5", "0.5", "B", "0.5", [0, 0, 10, 10], "(0,0),(10,10)"]
    with build_rewards(["accuracy", "format"]) as rewards:
        total, per_function, counters = rewards.score(completions[:5], truths[:5])
    # "(B)" is the expression B; free text without an answer tag or box is compared whole
    assert per_function.tolist() == [[1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0, 0.0]]
    assert total.tolist() == [2.0, 0.0, 1.0, 2.0, 0.0]
    assert counters == {"accuracy": {"errors": 0, "timeouts": 0}, "format": {"errors": 0, "timeouts": 0}}
    with build_rewards([{"name": "choice"}]) as rewards:
        assert rewards.score(completions[3:4], ["(B) cats"])[0].tolist() == [1.0]
    with build_rewards(["iou"]) as rewards:
        total, _, counters = rewards.score(completions[5:], truths[5:])
    assert torch.allclose(total, torch.tensor([1.0, 1 / 3]))


def test_format_pattern_option():
    spec = {"name": "format", "options": {"pattern": r"\d+"}, "weight": 0.5}
    with build_rewards([spec]) as rewards:
        assert rewards.score(["123", "12a"], [None, None])[0].tolist() == [0.5, 0.0]


USER_FUNCTIONS = textwrap.dedent(
    """
    import re
    import time

    def length(completion, ground_truth, prompt, scale=1.0):
        return scale * len(completion)

    def picky(completion, ground_truth, prompt):
        if completion == "bad":
            raise RuntimeError("cannot score this")
        return 1.0

    def junk(completion, ground_truth, prompt):
        return "high"

    def forever(completion, ground_truth, prompt):
        while True:
            try:
                time.sleep(60)
            except BaseException:  # ignores even the KeyboardInterrupt a signal-based timeout would raise
                pass

    def backtracking(completion, ground_truth, prompt):
        # C code that never checks for signals: catastrophic backtracking
        return float(re.match(r"(a+)+$", "a" * 40 + "b") is not None)

    def prompt_echo(completion, ground_truth, prompt):
        return float(prompt == ground_truth)
    """
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FUNCTIONS)
    return str(path)


def test_user_functions_with_weights(user_file):
    specs = [
        {"name": f"{user_file}:length", "weight": 2.0, "options": {"scale": 0.5}},
        {"name": f"{user_file}:prompt_echo", "weight": -1.0},
    ]
    with build_rewards(specs, num_workers=2) as rewards:
        total, per_function, _ = rewards.score(["ab", "abcd", "x"], ["p", "q", "r"], prompts=["p", "p", "r"])
    assert per_function.tolist() == [[1.0, 2.0, 0.5], [1.0, 0.0, 1.0]]
    assert total.tolist() == [1.0, 4.0, 0.0]


def _children() -> set[int]:
    return {child.pid for child in multiprocessing.active_children()}


def test_errors_and_timeouts_score_zero_and_are_counted(user_file):
    before = _children()
    specs = [
        {"name": f"{user_file}:picky"},
        {"name": f"{user_file}:junk"},
        {"name": f"{user_file}:forever", "timeout_s": 0.3},
        {"name": f"{user_file}:backtracking", "timeout_s": 0.3},
        "format",
    ]
    rewards = build_rewards(specs, num_workers=2)
    start = time.monotonic()
    total, per_function, counters = rewards.score(["ok", "bad"], [None, None])
    elapsed = time.monotonic() - start
    assert per_function[0].tolist() == [1.0, 0.0] and per_function[1:4].abs().sum() == 0
    assert counters[f"{user_file}:picky"] == {"errors": 1, "timeouts": 0}
    assert counters[f"{user_file}:junk"] == {"errors": 2, "timeouts": 0}
    assert counters[f"{user_file}:forever"] == {"errors": 0, "timeouts": 2}
    assert counters[f"{user_file}:backtracking"] == {"errors": 0, "timeouts": 2}
    assert counters["format"] == {"errors": 0, "timeouts": 0}
    assert "RuntimeError: cannot score this" in rewards.last_errors[f"{user_file}:picky"]
    assert "not a finite number" in rewards.last_errors[f"{user_file}:junk"]
    assert elapsed < 10, f"four timeouts of 0.3 s over two workers took {elapsed:.1f} s"
    assert len(_children() - before) <= 2, "killed workers are reaped; at most num_workers are alive"
    # the set goes on scoring, and counts across calls
    total, _, _ = rewards.score(["fine"], [None])
    assert total.tolist() == [1.0]
    assert rewards.totals[f"{user_file}:forever"] == {"errors": 0, "timeouts": 3}
    rewards.close()
    assert _children() - before == set(), "close() leaves no worker behind"


def test_bad_specs_are_config_errors(user_file, tmp_path):
    cases = [
        ([], "rewards: no reward function given"),
        (["acuracy"], "rewards[0].name: unknown reward function 'acuracy' (did you mean 'accuracy'?)"),
        ([{"name": "format", "wieght": 1}], "rewards[0].wieght: unknown key"),
        ([{"name": "format", "weight": "high"}], "rewards[0].weight: must be a finite number"),
        ([{"name": "format", "timeout_s": 0}], "rewards[0].timeout_s: must be a positive number"),
        ([{"name": "format", "options": {"pattern": "("}}], "rewards[0].options.pattern: not a regular expression"),
        ([{"name": "accuracy", "options": {"tolerance": 1}}], "rewards[0].options.tolerance: 'accuracy' has no"),
        (["format", f"{tmp_path}/missing.py:f"], "rewards[1].name: "),
        ([f"{user_file}:nothing"], "has no function 'nothing'"),
        ([{"weight": 1.0}], "rewards[0].name: missing"),
    ]
    for specs, message in cases:
        with pytest.raises(ConfigError) as raised:
            build_rewards(specs)
        assert message in str(raised.value), (specs, str(raised.value))
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such thing')\n")
    with pytest.raises(ConfigError, match="importing .* failed: ImportError: no such thing"):
        build_rewards([f"{broken}:f"])


def test_score_refuses_mismatched_lengths():
    with build_rewards(["format"]) as rewards, pytest.raises(ValueError, match="one of each per completion"):
        rewards.score(["a", "b"], [None])
