"""Chunk loss: loss and every gradient equal the plain HF forward + cross-entropy (fp32, rel ≤ 1e-5)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmfsdp.model import compute_loss_weights, get_model_entry, shift_labels
from mmfsdp.model.testing import assert_close, model_inputs, model_pair, rel_diff
from mmfsdp.parallel.testing import assert_within
from mmfsdp.model.families.mistral3.testing import tiny_batch

TOL = 1e-5


def _batch(config, **kwargs):
    batch = tiny_batch(config, batch_size=2, seq_len=24, image_sizes=((32, 32), (32, 48)), lengths=(24, 19), **kwargs)
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets], loss_type="per_sample")
    return batch, targets, weights


def _reference(model, batch, targets, weights):
    """The plain HF computation: full logits, per-token cross-entropy in fp32, weighted sum."""
    logits = model(**model_inputs(batch)).logits
    per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    loss = (per_token * weights.flatten()).sum()
    loss.backward()
    return loss.detach()


def _ours(model, batch, targets, weights):
    loss = model(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss
    loss.backward()
    return loss.detach()


def _assert_same_grads(ours, reference, tol=TOL):
    ref_params = dict(reference.named_parameters())
    checked = 0
    for name, param in ours.named_parameters():
        ref = ref_params[name]
        if ref.grad is None:
            assert param.grad is None, name
            continue
        assert param.grad is not None, name
        assert_close(param.grad, ref.grad, tol, f"grad {name}")
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 16, 4096])
def test_loss_and_all_gradients_match_plain_hf(tiny_config, chunk_size):
    ours, reference = model_pair(tiny_config)
    ours.set_chunk_loss(chunk_size)
    batch, targets, weights = _batch(tiny_config)
    num_trained = int((targets != -100).sum())
    assert num_trained % 5 != 0 and 24 % 5 != 0  # chunk 5 divides neither the sequence nor the trained tokens
    expected = _reference(reference, batch, targets, weights)
    loss = _ours(ours, batch, targets, weights)
    assert loss.dtype == torch.float32
    assert_close(loss, expected, TOL, "loss")
    _assert_same_grads(ours, reference)


def test_frozen_lm_head(tiny_config):
    ours, reference = model_pair(tiny_config)
    ours.set_chunk_loss(7)
    for model in (ours, reference):
        model.lm_head.requires_grad_(False)
    batch, targets, weights = _batch(tiny_config)
    expected = _reference(reference, batch, targets, weights)
    assert_close(_ours(ours, batch, targets, weights), expected, TOL, "loss")
    assert ours.lm_head.weight.grad is None
    _assert_same_grads(ours, reference)


def test_tied_lm_head(tiny_config):
    config = get_model_entry("mistral3").testkit.tiny_config(tie_word_embeddings=True)
    ours, reference = model_pair(config)
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    ours.set_chunk_loss(7)
    batch, targets, weights = _batch(config)
    expected = _reference(reference, batch, targets, weights)
    assert_close(_ours(ours, batch, targets, weights), expected, TOL, "loss")
    _assert_same_grads(ours, reference)


def test_no_trained_token_gives_zero_loss_and_gradients(tiny_config):
    ours, _ = model_pair(tiny_config)
    ours.set_chunk_loss(4)
    batch, targets, _ = _batch(tiny_config)
    targets = torch.full_like(targets, -100)
    (weights,) = compute_loss_weights([targets], loss_type="default")
    loss = _ours(ours, batch, targets, weights)
    assert loss.item() == 0.0
    grads = [p.grad for p in ours.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)


def test_plain_forward_is_the_hf_forward(tiny_config):
    ours, reference = model_pair(tiny_config)
    ours.set_chunk_loss(4)  # only the training forward (with loss_weights) uses it
    batch, _, _ = _batch(tiny_config)
    mine = ours(**model_inputs(batch), labels=batch["labels"])
    theirs = reference(**model_inputs(batch), labels=batch["labels"])
    assert torch.equal(mine.logits, theirs.logits)
    assert torch.equal(mine.loss, theirs.loss)


class _LogitsRows(TorchDispatchMode):
    """Records the most rows any op output with a last dimension of `vocab` had (weight-shaped ones aside)."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.vocab = vocab
        self.weight_numel = vocab * hidden
        self.max_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dim() >= 2
                and tensor.shape[-1] == self.vocab
                and tensor.numel() != self.weight_numel
            ):
                self.max_rows = max(self.max_rows, tensor.numel() // self.vocab)
        return out


def test_full_logits_are_never_materialised(tiny_config):
    ours, _ = model_pair(tiny_config)
    batch, targets, weights = _batch(tiny_config)
    vocab, hidden = tiny_config.text_config.vocab_size, tiny_config.text_config.hidden_size
    ours.set_chunk_loss(5)
    with _LogitsRows(vocab, hidden) as chunked:
        _ours(ours, batch, targets, weights)
    ours.zero_grad()
    ours.set_chunk_loss(None)
    with _LogitsRows(vocab, hidden) as plain:
        _ours(ours, batch, targets, weights)
    assert plain.max_rows == targets.numel()  # the probe sees the plain path's [B·S, V] logits
    assert chunked.max_rows == 5


def test_bf16_parameters_compute_the_loss_in_fp32(tiny_config):
    ours, reference = model_pair(tiny_config)
    batch, targets, weights = _batch(tiny_config)
    expected = _reference(reference, batch, targets, weights)
    ours.to(torch.bfloat16)
    ours.set_chunk_loss(5)
    inputs = {**batch, "pixel_values": batch["pixel_values"].to(torch.bfloat16)}
    chunked = _ours(ours, inputs, targets, weights)
    chunked_grads = {n: p.grad.float() for n, p in ours.named_parameters()}
    ours.zero_grad()
    ours.set_chunk_loss(None)
    plain = _ours(ours, inputs, targets, weights)
    plain_grads = {n: p.grad.float() for n, p in ours.named_parameters()}
    assert chunked.dtype == torch.float32
    # Both run the same bf16 model; the chunked one must be as close to the fp32 result as the plain bf16 HF path.
    assert abs(chunked - expected) <= 1.5 * abs(plain - expected) + 1e-6
    for name, ref in reference.named_parameters():
        assert_within(rel_diff(chunked_grads[name], ref.grad), 1.5 * rel_diff(plain_grads[name], ref.grad), f"bf16 grad {name}")
