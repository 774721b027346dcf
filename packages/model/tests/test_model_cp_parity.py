"""Context parallel in the mistral3 training forward: 5 AdamW steps equal the CP = 1 run.

The tiny Mistral3 with two images of different sizes per batch is trained for
5 steps as the trainer does it (loss weights on the full sequence, backward on
`loss × world_size`, reported loss summed over all ranks), sharded with FSDP2
over `dp_shard_cp`, with Ulysses 2 and Ring 2 (2 ranks) and Ring 2 × Ulysses 2
(4 ranks); with and without chunk loss, with packing (`cu_seq_lens`), gradient
accumulation, activation checkpointing and GQA with fewer KV heads than the
Ulysses size. Per-step losses, the first step's gradients and the final
parameters must equal the single-process CP = 1 run of the same model
(relative difference <= 1e-5), and so must a plain evaluation forward of the
trained, CP-enabled model (the non-CP path of the CP attention).
Cases named "vision dp" share the images out among the CP ranks (`mmfsdp.model.vision_dp`; with two
images at CP 4, two ranks encode the placeholder). One spawn per world size runs all of its cases.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from mmfsdp.model import compute_loss_weights, get_model_entry, shift_labels
from mmfsdp.model.families.mistral3.model import Mistral3ForConditionalGenerationFSDP
from mmfsdp.model.testing import model_inputs, rel_diff
from mmfsdp.model.families.mistral3.testing import image_token_count, tiny_batch
from mmfsdp.parallel import (
    FSDPPlanConfig, MeshPlan, ParallelConfig, ShardAdamW, apply_activation_checkpointing, apply_fsdp, build_parallel_dims,
)
from mmfsdp.parallel.testing import record_margin, run_distributed

TOL = 1e-5
ADAM_EPS = 1e-4
"""AdamW divides each element's step by sqrt(v) + eps. With the default 1e-8, an element whose gradient is
~1e-4 of its tensor's largest takes a full-size step whose direction is set by fp32 rounding at the 1e-3
relative level, so the parameters would compare rounding noise (CP reorders sums), not context parallel:
measured 3e-5 .. 9e-4 relative after 5 steps while the losses agree to 2e-7 and the gradients to 1e-6.
eps = 1e-4 keeps the step adaptive for the gradients that matter and linear in the tiny ones."""
STEPS = 5
SEQ_LEN = 32  # a multiple of 2 · ring · ulysses = 8
IMAGES = ((32, 32), (32, 48))  # 4 and 6 image tokens
PAD_ID = 0


def _config(kv_heads: int = 2):
    return get_model_entry("mistral3").testkit.tiny_config(text_config={"num_key_value_heads": kv_heads})


def _initial_state(config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Mistral3ForConditionalGenerationFSDP._from_config(copy.deepcopy(config), attn_implementation="mmfsdp_sdpa").state_dict()


def _padded_batches(config, micro_batches: int) -> list[list[dict]]:
    """Per step, right-padded rows of SEQ_LEN tokens with one image each."""
    return [
        [tiny_batch(config, seq_len=SEQ_LEN, image_sizes=IMAGES, lengths=(SEQ_LEN, 27 - 2 * m), seed=10 * step + m) for m in range(micro_batches)]
        for step in range(STEPS)
    ]


def _packed_batch(config, rows, seed: int) -> dict:
    """Rows of packed samples `(length, image or None, trailing pad)`; every sample length a multiple of 8.

    The trailing pad is the collator's per-sample padding: pad tokens, labels -100, attention_mask 0.
    """
    generator = torch.Generator().manual_seed(seed)
    batch_size = len(rows)
    input_ids = torch.randint(config.image_token_index + 1, config.text_config.vocab_size, (batch_size, SEQ_LEN), generator=generator)
    labels = input_ids.clone()
    attention_mask = torch.ones_like(input_ids)
    position_ids = torch.zeros_like(input_ids)
    segments, images = [], []
    for b, row in enumerate(rows):
        start = 0
        for length, image, pad in row:
            end = start + length
            position_ids[b, start:end] = torch.arange(length)
            labels[b, start : start + 2] = -100  # a short prompt
            if image is not None:
                count = image_token_count(config, *image)
                input_ids[b, start + 1 : start + 1 + count] = config.image_token_index
                labels[b, start + 1 : start + 1 + count] = -100
                images.append(image)
            if pad:
                input_ids[b, end - pad : end] = PAD_ID
                labels[b, end - pad : end] = -100
                attention_mask[b, end - pad : end] = 0
            segments.append(length)
            start = end
        assert start == SEQ_LEN
    side = max(max(image) for image in images)
    pixel_values = torch.zeros(len(images), config.vision_config.num_channels, side, side)
    for i, (height, width) in enumerate(images):
        pixel_values[i, :, :height, :width] = torch.randn(config.vision_config.num_channels, height, width, generator=generator)
    cu_seq_lens = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu_seq_lens[1:] = torch.tensor(segments).cumsum(0)
    return {
        "input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "position_ids": position_ids,
        "pixel_values": pixel_values, "image_sizes": torch.tensor([list(image) for image in images]),
        "cu_seq_lens": cu_seq_lens, "max_length": max(segments),
    }


def _packed_batches(config) -> list[list[dict]]:
    """Per step one micro-batch of two packed rows: [16 (image), 8, 8 (padded)] and [8, 24 (image)]."""
    rows = [[(16, IMAGES[0], 0), (8, None, 0), (8, None, 3)], [(8, None, 1), (24, IMAGES[1], 0)]]
    return [[_packed_batch(config, rows, seed=100 + step)] for step in range(STEPS)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


@torch.no_grad()
def _eval_logits(model, steps) -> torch.Tensor:
    """A plain (non-training) forward of the first batch: the same full logits on every rank, CP or not."""
    return model(**model_inputs(steps[0][0])).logits


def _train(model, steps, *, loss_type, group=None, world_size=1):
    """The trainer's step: weights over the dp group, backward on loss × world size, loss summed over all ranks.

    Returns the per-step losses and the gradients of the first step.
    """
    optimizer = ShardAdamW(model.parameters(), lr=1e-3, eps=ADAM_EPS, foreach=True)  # the trainer's AdamW
    losses, first_grads = [], None
    for micro_batches in steps:
        targets = [shift_labels(mb["labels"], mb.get("cu_seq_lens")) for mb in micro_batches]
        weights = compute_loss_weights(targets, loss_type=loss_type, cu_seq_lens=[mb.get("cu_seq_lens") for mb in micro_batches], group=group)
        total = torch.zeros(())
        for mb, target, weight in zip(micro_batches, targets, weights):
            out = model(**model_inputs(mb), shift_labels=target, loss_weights=weight)
            (out.loss * world_size).backward()
            total += out.loss.detach()
        if world_size > 1:
            dist.all_reduce(total)
        if first_grads is None:
            first_grads = {name: _full(p.grad) for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return torch.stack(losses), first_grads


def _cases(world_size: int) -> list[dict]:
    if world_size == 2:
        return [
            dict(name="ulysses2", ulysses=2, data="padded_accum"),
            dict(name="ulysses2 chunk loss vision dp", ulysses=2, chunk=7, vision_dp=True, data="padded"),
            dict(name="ulysses2 packed", ulysses=2, data="packed", loss_type="per_sample"),
            dict(name="ulysses2 1 kv head (repeated)", ulysses=2, kv_heads=1, data="padded"),
            dict(name="ring2", ring=2, data="padded_accum"),
            dict(name="ring2 chunk loss recompute", ring=2, chunk=7, recompute=True, data="padded"),
            dict(name="ring2 packed vision dp", ring=2, vision_dp=True, data="packed", loss_type="per_sample"),
        ]
    return [
        dict(name="ring2 x ulysses2 vision dp", ring=2, ulysses=2, vision_dp=True, data="padded_accum"),
        dict(name="ring2 x ulysses2 chunk loss", ring=2, ulysses=2, chunk=7, data="padded"),
        dict(name="ring2 x ulysses2 packed chunk loss recompute", ring=2, ulysses=2, chunk=7, recompute=True, data="packed", loss_type="per_sample"),
    ]


def _data(config, kind: str):
    if kind == "packed":
        return _packed_batches(config)
    return _padded_batches(config, 2 if kind == "padded_accum" else 1)


def _build(config, state, case):
    model = Mistral3ForConditionalGenerationFSDP._from_config(copy.deepcopy(config), attn_implementation="mmfsdp_sdpa")
    model.load_state_dict(state)
    model.set_chunk_loss(case.get("chunk"))
    return model


def _reference(case):
    """Single process, CP = 1, no FSDP."""
    config = _config(case.get("kv_heads", 2))
    model = _build(config, _initial_state(config), case)
    data = _data(config, case["data"])
    losses, grads = _train(model, data, loss_type=case.get("loss_type", "default"))
    return losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()}, _eval_logits(model, data)


def _cp_runs(rank, world_size, cases):
    entry = get_model_entry("mistral3")
    results = {}
    for case in cases:
        config = _config(case.get("kv_heads", 2))
        plan = MeshPlan.from_config(ParallelConfig(ulysses_parallel_size=case.get("ulysses", 1), ring_attention_size=case.get("ring", 1)), world_size)
        dims = build_parallel_dims(plan, "cpu")
        assert dims.cp_size == world_size and dims.dp_size == 1
        model = _build(config, _initial_state(config), case)
        if case.get("recompute"):
            apply_activation_checkpointing(model, list(entry.recompute_modules))
        apply_fsdp(model, FSDPPlanConfig(), dims.fsdp_mesh, list(entry.fsdp_modules))
        model.enable_context_parallel(dims, vision_dp=case.get("vision_dp", False))
        data = _data(config, case["data"])
        losses, grads = _train(model, data, loss_type=case.get("loss_type", "default"), group=dims.dp_group, world_size=world_size)
        params = {name: p.full_tensor() for name, p in model.named_parameters()}
        logits = _eval_logits(model, data)
        mine = {"grads": grads, "params": params} if rank == 0 else {"grads": {}, "params": {}}
        encoded = list(model._vision_dp.encoded) if case.get("vision_dp") else []
        results[case["name"]] = {"losses": losses, "logits": logits, "encoded": encoded, **mine}
    return results


@pytest.mark.slow  # 2 and 4 spawned ranks, several CP layouts each
@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_training_equals_cp1(world_size):
    cases = _cases(world_size)
    per_rank = run_distributed(_cp_runs, world_size, cases, timeout=600)
    results, results_last = per_rank[0], per_rank[-1]
    failures = []
    for case in cases:
        expected_losses, expected_grads, expected_params, expected_logits = _reference(case)
        got = results[case["name"]]
        assert got["params"].keys() == expected_params.keys() == got["grads"].keys()
        diffs = {
            "loss": rel_diff(got["losses"], expected_losses),
            "evaluation logits (last rank)": rel_diff(results_last[case["name"]]["logits"], expected_logits),
            "step-1 gradient": max(rel_diff(got["grads"][n], g) for n, g in expected_grads.items()),
            "final parameter": max(rel_diff(got["params"][n], p) for n, p in expected_params.items()),
        }
        for what, diff in diffs.items():
            record_margin(diff, TOL, f"{case['name']}: {what}")
        if max(diffs.values()) > TOL:
            failures.append(f"{case['name']}: " + ", ".join(f"{what} rel diff {d:.3g}" for what, d in diffs.items()))
        if case.get("vision_dp"):
            # every training micro-batch has two images: one per rank, none on the others at CP 4
            per_call = list(zip(*(result[case["name"]]["encoded"] for result in per_rank)))
            assert per_call and all(sorted(m for m, _ in call)[-2:] == [1, 1] for call in per_call), per_call
            assert all(sum(m for m, _ in call) == 2 and {n for _, n in call} == {2} for call in per_call), per_call
        moved = max(rel_diff(got["params"][n], p) for n, p in _initial_state(_config(case.get("kv_heads", 2))).items())
        assert moved > 1e-3, f"{case['name']}: parameters did not train"
    assert not failures, "\n".join(failures)
