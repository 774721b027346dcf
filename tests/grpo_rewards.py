"""A reward function of the GRPO end-to-end tests, loaded from this file as `tests/grpo_rewards.py:shared_letters`
(a user's reward file, `mmfsdp.data.rewards`): a random tiny model's completions score differently within a group,
so the advantages and the gradients are not zero (the registered `accuracy` and `format` are 0 for all of them)."""


def shared_letters(completion: str, ground_truth, prompt) -> float:
    """The share of the completion's characters that occur in the ground truth."""
    truth = str(ground_truth)
    return sum(ch in truth for ch in completion) / max(len(completion), 1)
