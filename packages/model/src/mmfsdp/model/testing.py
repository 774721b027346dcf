"""Helpers for tests and examples: model pairs, relative differences, checkpoint round trips.

`read_safetensors(dir)`, `assert_bit_exact(a, b)` and `mm_convert(*argv)` are the checkpoint
round-trip tests' helpers (`mm-convert GenericDCPConverter ...`, returning its exit code).

`model_pair(config)` builds our wrapper (the registered family whose
`config_class` the config is) and the plain HF model with the same random
weights, `perturb(models)` adds the same noise to each (a policy moved away from its reference, a stand-in for an
optimizer step), `to_dtype(batch, dtype)` casts a batch's floating-point tensors; `model_inputs(batch)` is every
key of a batch but the labels; `rel_diff(a, b)` is the tensor-wise relative difference the
parity tests bound (max |a − b| / max |b|); `assert_close(actual, expected, tol, what)` bounds it and records the
measured value against its bound where `MMFSDP_RECORD_MARGINS` names a file (`mmfsdp.parallel.testing.record_margin`;
`tools/tolerance_margins.py` reads them: how close each test comes to its tolerance on this machine).

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
from mmfsdp.parallel.testing import assert_within

__all__ = [
    "model_pair",
    "perturb",
    "to_dtype",
    "rel_diff",
    "assert_close",
    "model_inputs",
    "read_safetensors",
    "assert_bit_exact",
    "mm_convert",
]


def perturb(models: list[nn.Module], seed: int = 3, scale: float = 0.2) -> None:
    """The same noise, scale · N(0, 1) (drawn in fp32), added to every parameter of each model (same names)."""
    generator = torch.Generator().manual_seed(seed)
    named = [dict(model.named_parameters()) for model in models]
    with torch.no_grad():
        for name, param in named[0].items():
            noise = scale * torch.randn(param.shape, generator=generator)
            for params in named:
                params[name].add_(noise.to(params[name].dtype))


def to_dtype(batch: dict, dtype: torch.dtype) -> dict:
    """The batch with its floating-point tensors (pixel inputs) in `dtype`."""
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual − expected| / max |expected| (a tensor-wise relative difference, in float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return (actual - expected).abs().max().item() / (scale if scale > 0 else 1.0) if actual.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> float:
    """Assert `rel_diff(actual, expected) <= tol` (the message names `what` and both numbers); return the difference.

    Where `MMFSDP_RECORD_MARGINS` is set, the measurement is appended there with the running test's id, so that
    the margin between what a test measures and its bound is seen on every machine before it runs out."""
    return assert_within(rel_diff(actual, expected), tol, what)


def read_safetensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of a HF safetensors directory (one file or shards + index), by key."""
    from mmfsdp.ckpt import SafetensorsDir

    weights = SafetensorsDir(directory)
    return {key: weights.read(key).clone() for key in weights.tensors}


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers: NaNs (uninitialised weights of a random init may hold some) compare
    equal to themselves, as bits do."""
    if tensor.dtype == torch.bool or not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    return tensor.contiguous().view(_BITS[tensor.element_size()])


def assert_bit_exact(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, and per key the same dtype, shape and bits."""
    assert actual.keys() == expected.keys()
    for key in expected:
        a, b = actual[key], expected[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), key


def mm_convert(*argv) -> int:
    """`mm-convert GenericDCPConverter *argv` in this process; its exit code."""
    from mmfsdp.ckpt.cli import main

    return main(["GenericDCPConverter", *map(str, argv)])


def model_pair(
    config: PretrainedConfig, *, attn: str = "mmfsdp_sdpa", hf_attn: str = "sdpa", seed: int = 0,
    same_kernels: bool = False,
) -> tuple[nn.Module, nn.Module]:
    """Our wrapper (attention `attn`) and the plain HF model (attention `hf_attn`) with the same random weights.

    With `same_kernels`, the HF model runs our attention `attn` and the family's vision code path too
    (`FamilyTestKit.same_kernels`): for tests that compare something else than the model's forward (a loss, a
    stage against its reference implementation), whose tolerance should not measure two kernels' rounding.
    Each model gets its own copy of `config` (HF keeps the attention choice on the config object).
    """
    (entry,) = [entry for entry in map(get_model_entry, registered_model_ids()) if type(config) is entry.config_class]
    reference_class = entry.model_class.__bases__[-1]  # (TrainingForwardMixin, the HF class)
    torch.manual_seed(seed)
    reference = reference_class._from_config(copy.deepcopy(config), attn_implementation=attn if same_kernels else hf_attn)
    if same_kernels:
        entry.testkit.same_kernels(reference)
    ours = entry.model_class._from_config(copy.deepcopy(config), attn_implementation=attn)
    ours.load_state_dict(reference.state_dict())
    return ours, reference
