"""Reward functions of the GRPO tests, loaded from this file as a user's reward file (`mmfsdp.data.rewards`):
`tests/grpo_rewards.py:shared_letters` for the end-to-end runs (a random tiny model's completions score differently
within a group, so the advantages and the gradients are not zero; the registered `accuracy` and `format` are 0 for
all of them), `fixed_reward` and `fixed_bonus` for the comparison with TRL (given values)."""


def shared_letters(completion: str, ground_truth, prompt) -> float:
    """The share of the completion's characters that occur in the ground truth."""
    truth = str(ground_truth)
    return sum(ch in truth for ch in completion) / max(len(completion), 1)


def fixed_reward(completion: str, ground_truth, prompt, table: dict) -> float:
    """The reward `table` gives the completion (the TRL comparison's fixed rewards, tests/test_grpo_trl_model.py)."""
    return table[completion]


def fixed_bonus(completion: str, ground_truth, prompt, table: dict) -> float:
    """A second fixed reward function (its own name: its own `rewards/<name>/*` statistics)."""
    return table[completion]


def image_letters(completion: str, ground_truth, prompt) -> float:
    """`shared_letters` on a prompt with an image, 0 on a text-only one: the groups of text-only prompts have equal
    rewards (the dynamic-sampling runs of tests/test_e2e_grpo.py drop them and resample)."""
    return shared_letters(completion, ground_truth, prompt) if "<image>" in str(prompt) else 0.0
