"""Helpers for tests and examples: model pairs, relative differences, checkpoint round trips.

`read_safetensors(dir)`, `assert_bit_exact(a, b)` and `mm_convert(*argv)` are the checkpoint
round-trip tests' helpers (`mm-convert GenericDCPConverter ...`, returning its exit code).

`model_pair(config)` builds our wrapper (the registered family whose
`config_class` the config is) and the plain HF model with the same random
weights; `model_inputs(batch)` is every key of a batch but the labels; `rel_diff(a, b)` is the tensor-wise relative difference the
parity tests bound (max |a − b| / max |b|).

A family's own synthetic batches live with the family (`mmfsdp.model.families.<model_id>.testing`) and reach
generic tests through its spec's test kit (`entry.testkit.tiny_config` / `entry.testkit.test_batch`).
"""

from __future__ import annotations

import copy
import torch
from torch import nn
from transformers import PretrainedConfig

from mmfsdp.model.registry import registered_model_ids
from mmfsdp.model.spec import get_model_entry
from mmfsdp.model.training_forward import model_inputs

__all__ = [
    "model_pair",
    "rel_diff",
    "model_inputs",
    "read_safetensors",
    "assert_bit_exact",
    "mm_convert",
]


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected| (a tensor-wise relative difference, in float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0) if actual.numel() else 0.0


def read_safetensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a HF safetensors directory (one file or shards + index), by key."""
    from mmfsdp.ckpt import SafetensorsDir

    weights = SafetensorsDir(directory)
    return {key: weights.read(key).clone() for key in weights.tensors}


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, and per key the same dtype, shape and bits."""
    assert actual.keys() == expected.keys()
    for key in expected:
        a, b = actual[key], expected[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key


def mm_convert(*argv) -> int:
    """`mm-convert GenericDCPConverter *argv` in this process; its exit code."""
    from mmfsdp.ckpt.cli import main

    return main(["GenericDCPConverter", *map(str, argv)])


def model_pair(
    config: PretrainedConfig, *, attn: str = "mmfsdp_sdpa", hf_attn: str = "sdpa", seed: int = 0
) -> tuple[nn.Module, nn.Module]:
    """Our wrapper (attention `attn`) and the plain HF model (attention `hf_attn`) with the same random weights.

    Each model gets its own copy of `config` (HF keeps the attention choice on the config object).
    """
    (ours_class,) = [
        entry.model_class for entry in map(get_model_entry, registered_model_ids()) if type(config) is entry.config_class
    ]
    reference_class = ours_class.__bases__[-1]  # (TrainingForwardMixin, the HF class)
    torch.manual_seed(seed)
    reference = reference_class._from_config(copy.deepcopy(config), attn_implementation=hf_attn)
    ours = ours_class._from_config(copy.deepcopy(config), attn_implementation=attn)
    ours.load_state_dict(reference.state_dict())
    return ours, reference
