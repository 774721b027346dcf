"""`FamilyTestKit`: what tests need of a family — a tiny config and synthetic batches for it.

It is a facet of the family's spec (`ModelEntry.testkit`), apart from the declaration and never used in training.
The family contract test (`tests/test_e2e_family_contract.py`) runs over every registered family through it, so a
family that registers a kit gets that coverage; the base has none and says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

__all__ = ["FamilyTestKit"]


class FamilyTestKit:
    """Tiny configs and batches of one family for tests and examples; this base has none."""

    def tiny_config(self, **overrides: Any) -> PretrainedConfig:
        """A config of the family's HF config class, about 0.1-1M parameters (fp32, untied `lm_head`); keywords
        override its fields (`text_config` / `vision_config`: dicts merged into the tiny sub-configs)."""
        raise NotImplementedError(f"{type(self).__name__} has no tiny_config")

    def test_batch(self, config: PretrainedConfig, *, images: bool, seed: int = 0) -> dict[str, torch.Tensor]:
        """A collated batch for the tiny `config`: rows of different lengths with right padding and `labels`;
        with `images`, images of different sizes in some rows and none in others; without, no vision input."""
        raise NotImplementedError(f"{type(self).__name__} has no test_batch")

    def same_kernels(self, reference: nn.Module) -> None:
        """Make a plain HF model of the family run the code path our wrapper runs where the two differ only in how
        they compute the same maths (which attention calls a vision tower makes), so that a comparison with our
        wrapper measures what it means to (a loss, a stage), not kernel rounding (`testing.model_pair`'s
        `same_kernels`). Nothing by default: the family's HF model already runs our path."""

    def packed_test_batch(self, config: PretrainedConfig, *, seed: int = 0) -> dict[str, torch.Tensor]:
        """One packed row for the tiny `config`: samples of different lengths (text only, and with images of
        different sizes), `labels`, `cu_seq_lens` and `max_length`; every sample length a multiple of 4 (Ring 2)
        and none of 64 (the Gated DeltaNet's chunk). For families that declare packing."""
        raise NotImplementedError(f"{type(self).__name__} has no packed_test_batch")
