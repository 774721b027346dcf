"""Context parallel in the qwen3_vl training forward: loss and gradients equal the single-process run.

The tiny Qwen3-VL (DeepStack on both vision layers, M-RoPE) is parallelised by its
entry (`parallelize`: FSDP2 over `dp_shard_cp`, with recompute where asked), and
runs one training step as the trainer does it (weights on the full sequence,
backward on `loss × world_size`, reported loss summed over all ranks) with
Ulysses 2 and Ring 2 (2 ranks) and Ring 2 × Ulysses 2 (4 ranks), on padded rows
with images of different sizes and on packed rows (`cu_seq_lens`), with and
without chunk loss. Loss and every gradient must equal the one-process run
(relative difference ≤ 1e-5), and so must a plain evaluation forward of the
CP-enabled model. Some cases run vision data parallel (`mmfsdp.model.vision_dp`): the 3 images are
shared out among the CP ranks (at CP 4 one rank has none and encodes the placeholder).
One spawn per world size runs all of its cases.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from mmfsdp.model import compute_loss_weights, get_model_entry, shift_labels
from mmfsdp.model.families.qwen3_vl.model import Qwen3VLForConditionalGenerationFSDP
from mmfsdp.model.testing import model_inputs, rel_diff
from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_batch, qwen3_vl_sample
from mmfsdp.parallel import MeshPlan, ParallelConfig, build_parallel_dims
from mmfsdp.parallel.testing import record_margin, run_distributed

TOL = 1e-5


def _config():
    # three decoder layers: a deepstack feature added after the last layer reaches only its own (untrained) position
    return get_model_entry("qwen3_vl").testkit.tiny_config(text_config={"num_hidden_layers": 3})


def _batch(config, kind: str) -> dict:
    """Samples of 24 (two images), 16 (one image) and 8 (text) tokens: every length a multiple of 2·2·2."""
    a = qwen3_vl_sample(config, 24, [(4, 4), (4, 6)], seed=1)
    b = qwen3_vl_sample(config, 16, [(2, 2)], prompt_len=3, seed=2)
    c = qwen3_vl_sample(config, 8, prompt_len=1, seed=3)
    if kind == "packed":
        return qwen3_vl_batch([[a, b], [c]], seq_len=40, packing=True)
    return qwen3_vl_batch([[a], [b]], seq_len=24)


def _build(config, case):
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGenerationFSDP._from_config(copy.deepcopy(config), attn_implementation="mmfsdp_sdpa")
    model.set_chunk_loss(case.get("chunk"))
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _step(model, batch, *, group=None, world_size=1):
    targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
    (weights,) = compute_loss_weights([targets], cu_seq_lens=[batch.get("cu_seq_lens")], loss_type="per_sample", group=group)
    out = model(**model_inputs(batch), shift_labels=targets, loss_weights=weights)
    (out.loss * world_size).backward()
    loss = out.loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(loss)
    grads = {name: _full(p.grad) for name, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
    return loss, grads, logits


def _cases(world_size: int) -> list[dict]:
    if world_size == 2:
        return [
            dict(name="ulysses2 vision dp", ulysses=2, vision_dp=True, data="padded"),
            dict(name="ring2", ring=2, data="padded"),
            dict(name="ulysses2 packed chunk loss", ulysses=2, chunk=7, data="packed"),
            dict(name="ring2 packed recompute vision dp", ring=2, recompute=True, vision_dp=True, data="packed"),
        ]
    return [
        dict(name="ring2 x ulysses2 vision dp", ring=2, ulysses=2, vision_dp=True, data="padded"),
        dict(name="ring2 x ulysses2 packed chunk loss recompute", ring=2, ulysses=2, chunk=7, recompute=True, data="packed"),
    ]


def _cp_runs(rank, world_size, cases):
    entry = get_model_entry("qwen3_vl")
    config = _config()
    results = {}
    for case in cases:
        parallel_cfg = ParallelConfig(
            ulysses_parallel_size=case.get("ulysses", 1), ring_attention_size=case.get("ring", 1), recompute=case.get("recompute", False)
        )
        dims = build_parallel_dims(MeshPlan.from_config(parallel_cfg, world_size), "cpu")
        assert dims.cp_size == world_size and dims.dp_size == 1
        model = _build(config, case)
        entry.parallelize(model, parallel_cfg, dims)
        model.enable_context_parallel(dims, vision_dp=case.get("vision_dp", False))
        loss, grads, logits = _step(model, _batch(config, case["data"]), group=dims.dp_group, world_size=world_size)
        encoded = list(model._vision_dp.encoded) if case.get("vision_dp") else []
        mine = {"grads": grads if rank == 0 else {}, "encoded": encoded}
        results[case["name"]] = {"loss": loss, "logits": logits, **mine}
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_qwen3vl_cp_training_equals_one_process(world_size):
    cases = _cases(world_size)
    per_rank = run_distributed(_cp_runs, world_size, cases, timeout=600)
    failures = []
    for case in cases:
        config = _config()
        expected_loss, expected_grads, expected_logits = _step(_build(config, case), _batch(config, case["data"]))
        got = per_rank[0][case["name"]]
        assert got["grads"].keys() == expected_grads.keys()
        diffs = {
            "loss": rel_diff(got["loss"], expected_loss),
            "gradient": max(rel_diff(got["grads"][n], g) for n, g in expected_grads.items()),
            "evaluation logits (last rank)": rel_diff(per_rank[-1][case["name"]]["logits"], expected_logits),
        }
        for what, diff in diffs.items():
            record_margin(diff, TOL, f"{case['name']}: {what}")
        if max(diffs.values()) > TOL:
            failures.append(f"{case['name']}: " + ", ".join(f"{what} rel diff {d:.3g}" for what, d in diffs.items()))
        assert all(g.abs().max() > 0 for n, g in expected_grads.items() if "deepstack_merger_list" in n), "every deepstack merger trains"
        if case.get("vision_dp"):
            # one get_image_features call (the training forward); the evaluation forward runs without vision DP
            encoded = [result[case["name"]]["encoded"] for result in per_rank]
            assert all(len(calls) == 1 for calls in encoded), encoded
            assert all(calls[0][1] == 3 for calls in encoded), encoded
            mine = [calls[0][0] for calls in encoded]
            assert sum(mine) == 3 and max(mine) < 3 and (world_size < 4 or min(mine) == 0), encoded
    assert not failures, "\n".join(failures)
