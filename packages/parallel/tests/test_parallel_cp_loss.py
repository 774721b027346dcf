"""A tiny causal LM split over CP ranks gives the unsplit loss and, summed over ranks, the unsplit gradients.

The model is embedding → attention (context parallel) → MLP → head, with a
token-weighted cross-entropy normalised by the global count of trained
tokens. Each rank computes the loss sum of its shard, `cp_loss_reduce` sums
it over the CP group, every rank calls backward, and the parameter gradients
summed over the ranks (what FSDP2's reduce-scatter does) must equal the
single-process gradients. One case also checkpoints the attention layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mmfsdp.parallel.cp import CPLayout, context_parallel_attention, cp_loss_reduce, split_for_cp
from mmfsdp.parallel.testing import assert_within, run_distributed

TOLERANCE = 1e-5
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 16, 16, 2, 1, 8


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.q = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.kv = torch.nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 32), torch.nn.SiLU(), torch.nn.Linear(32, HIDDEN))
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def attention(self, h, attend):
        B, S, _ = h.shape
        q = self.q(h).view(B, S, HEADS, HEAD_DIM)
        k, v = self.kv(h).view(B, S, 2, KV_HEADS, HEAD_DIM).unbind(2)
        return self.o(attend(q, k, v).reshape(B, S, -1))

    def forward(self, input_ids, attend, recompute=False):
        h = self.embed(input_ids)
        h = h + (checkpoint(self.attention, h, attend, use_reentrant=False) if recompute else self.attention(h, attend))
        h = h + self.mlp(h)
        return self.head(h)


def _loss_sum(logits, shift_labels, loss_weights):
    ce = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels.flatten(), ignore_index=-100, reduction="none")
    return (ce * loss_weights.flatten()).sum()


def _reference_attend(lengths):
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = (sample[:, None] == sample[None, :]) & torch.ones(len(sample), len(sample), dtype=torch.bool).tril()

    def attend(q, k, v):
        groups = HEADS // KV_HEADS
        k, v = (t.repeat_interleave(groups, 2) for t in (k, v))
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)

    return attend


def _run(rank, world_size, ring, ulysses, lengths, recompute):
    cp_group = dist.group.WORLD
    ring_group = cp_group if ring > 1 else None
    ulysses_group = cp_group if ulysses > 1 else None
    torch.manual_seed(0)
    model = _TinyLM()
    seq_len = sum(lengths)
    input_ids = torch.randint(0, VOCAB, (1, seq_len))
    labels = torch.randint(0, VOCAB, (1, seq_len))
    labels[:, ::5] = -100
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    labels[:, starts[1:] - 1] = -100  # the last token of a sample predicts nothing of the next one
    trained = (labels != -100).sum()
    loss_weights = (labels != -100).float() / trained

    logits = model(input_ids, _reference_attend(lengths))
    expected_loss = _loss_sum(logits, labels, loss_weights)
    expected_grads = torch.autograd.grad(expected_loss, list(model.parameters()))

    cu_seq_lens = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0)
    ring_rank, ulysses_rank = divmod(rank, ulysses)
    layout = CPLayout.create(
        seq_len, cu_seq_lens, ring_size=ring, ring_rank=ring_rank, ulysses_size=ulysses, ulysses_rank=ulysses_rank
    )

    def attend(q, k, v):
        return context_parallel_attention(q, k, v, layout, ring_group=ring_group, ulysses_group=ulysses_group)

    local_ids, local_labels, local_weights = (split_for_cp(t, layout) for t in (input_ids, labels, loss_weights))
    loss = cp_loss_reduce(_loss_sum(model(local_ids, attend, recompute), local_labels, local_weights), cp_group)
    loss.backward()
    errors = {"loss": abs(loss.item() - expected_loss.item()) / abs(expected_loss.item())}
    for (name, param), expected in zip(model.named_parameters(), expected_grads):
        grad = param.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        errors[name] = ((grad - expected).norm() / expected.norm()).item()
    return errors


CASES = {"ring2": (2, 1, [12, 4, 16], False), "ulysses2-checkpointed": (1, 2, [10, 6, 16], True)}


def _run_cases(rank, world_size):
    return {name: _run(rank, world_size, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def errors():
    return run_distributed(_run_cases, 2, timeout=180)


@pytest.mark.parametrize("name", list(CASES))
def test_cp_loss_and_gradients_equal_the_unsplit_model(errors, name):
    for rank, per_rank in enumerate(errors):
        for what, error in per_rank[name].items():
            assert_within(error, TOLERANCE, f"{name} rank {rank} {what}")
