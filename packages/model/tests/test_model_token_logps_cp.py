"""The per-token mode of the training forward (online RL, `mmfsdp.model.training_forward` step 8) under context
parallel: each rank computes the values on its shard and all-gathers them (`CPBatch.gather`), so every CP rank
holds the whole batch's log-probabilities, entropies and kept masses, equal to the unsplit forward's; with each rank
backpropagating `1 / cp` of the same loss, the gradients summed over the group (what FSDP2's reduction over
`dp_shard_cp` does) are the unsplit model's. Ulysses 2 (padded rows) and Ring 2 (packed samples), with and without
chunk loss, on 2 gloo ranks, tiny Mistral3 with images, fp32."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmfsdp.model import shift_labels
from mmfsdp.model.testing import model_inputs, rel_diff
from mmfsdp.parallel import MeshPlan, ParallelConfig, build_parallel_dims
from mmfsdp.parallel.testing import assert_within, run_distributed

TOL = 1e-5
TEMPERATURE = 0.7
SUPPRESSED = (0, 3)
CASES = [
    dict(name="ulysses2", ulysses=2, data="padded"),
    dict(name="ulysses2 chunk loss", ulysses=2, chunk=5, data="padded"),
    dict(name="ring2 packed", ring=2, data="packed"),
    dict(name="ring2 packed chunk loss", ring=2, chunk=5, data="packed"),
]


def _cp_parity_module():
    """The CP parity test's tiny model and batches (a sibling file: test modules are loaded by path)."""
    path = Path(__file__).with_name("test_model_cp_parity.py")
    spec = importlib.util.spec_from_file_location("_token_logps_cp_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _setup(case):
    cp = _cp_parity_module()
    config = cp._config()
    model = cp._build(config, cp._initial_state(config), case)
    batch = cp._data(config, case["data"])[0][0]
    targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
    return model, batch, targets, (targets != -100).float()


def _values(model, batch, targets, weights, cp_size: int = 1):
    """The per-token values and the parameters' gradients of `Σ c_t · loss_t / cp` (c: fixed, varied weights)."""
    out = model(**model_inputs(batch), shift_labels=targets, loss_weights=weights, per_token=True,
                temperature=TEMPERATURE, suppress_token_ids=torch.tensor(SUPPRESSED))
    coefficients = torch.linspace(0.5, 1.5, out.loss.numel()).reshape(out.loss.shape)
    (out.loss * coefficients).sum().div(cp_size).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    trained = targets != -100
    return {"loss": out.loss.detach(), "entropy": out.entropy[trained], "kept": out.kept_logmass[trained]}, grads


def _cp_run(rank, world_size, cases):
    results = {}
    for case in cases:
        plan = MeshPlan.from_config(ParallelConfig(ulysses_parallel_size=case.get("ulysses", 1),
                                                   ring_attention_size=case.get("ring", 1)), world_size)
        dims = build_parallel_dims(plan, "cpu")
        model, batch, targets, weights = _setup(case)
        model.enable_context_parallel(dims)
        values, grads = _values(model, batch, targets, weights, dims.cp_size)
        for grad in grads.values():
            dist.all_reduce(grad, group=dims.cp_group)
        results[case["name"]] = {"values": values, "grads": grads}
    return results


@pytest.mark.slow  # 2 spawned ranks, 4 layouts
def test_per_token_values_under_cp_equal_the_unsplit_forward():
    per_rank = run_distributed(_cp_run, 2, CASES, timeout=600)
    for case in CASES:
        expected, expected_grads = _values(*_setup(case))
        for rank, results in enumerate(per_rank):
            got = results[case["name"]]
            for key, value in expected.items():
                assert_within(rel_diff(got["values"][key], value), TOL, f"{case['name']} rank {rank}: {key}")
            assert got["grads"].keys() == expected_grads.keys()
            worst = max(rel_diff(got["grads"][name], grad) for name, grad in expected_grads.items())
            assert_within(worst, TOL, f"{case['name']} rank {rank}: gradients")
