"""Per-sequence sums (preference training): `.loss[k] = Σ_{t in k} w_t · CE_t`, plain and chunked, equal the plain HF
logits' log-probabilities summed per sequence, values and every gradient under a non-linear consumer (fp32, ≤ 1e-5)."""

import pytest
import torch
import torch.nn.functional as F

from mmfsdp.model import shift_labels
from mmfsdp.model.chunk_loss import chunked_linear_sequence_cross_entropy
from mmfsdp.model.families.mistral3.testing import tiny_batch
from mmfsdp.model.loss import sample_ids, segment_sum, sequence_cross_entropy
from mmfsdp.model.testing import assert_close, model_inputs, model_pair

TOL = 1e-5


def _consumer(sums: torch.Tensor) -> torch.Tensor:
    """A preference-like, non-linear function of the sums (so per-sequence gradient scales differ)."""
    return -F.logsigmoid(0.3 * (sums[0::2] - sums[1::2])).sum() + 0.01 * (sums * sums).sum()


def test_sample_ids_rows_and_packed_segments():
    assert sample_ids((2, 3)).tolist() == [[0, 0, 0], [1, 1, 1]]
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    assert sample_ids((1, 6), cu).tolist() == [[0, 0, 1, 2, 2, 2]]
    assert segment_sum(torch.arange(6.0), torch.tensor([0, 0, -1, 2, 2, 1]), 3).tolist() == [1.0, 5.0, 7.0]


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_sequence_sums_equal_logits_path(chunk_size, bias):
    gen = torch.Generator().manual_seed(0)
    T, H, V, K = 23, 8, 11, 6
    hidden = torch.randn(T, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    b = torch.randn(V, generator=gen, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[[0, 5, 9]] = -100
    ids = torch.randint(0, K, (T,), generator=gen)
    ids[[3, 4]] = -1
    weights = torch.rand(T, generator=gen)
    weights[7] = 0.0
    ref = sequence_cross_entropy(F.linear(hidden, weight, b), targets, weights, ids, K)
    ref_grads = torch.autograd.grad(_consumer(ref), [hidden, weight] + ([b] if bias else []))
    ours = chunked_linear_sequence_cross_entropy(hidden, weight, b, targets, weights, ids, K, chunk_size)
    grads = torch.autograd.grad(_consumer(ours), [hidden, weight] + ([b] if bias else []))
    assert_close(ours, ref, TOL, "log-probabilities")
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, TOL, "gradient")
    # the sums are the negated log-probabilities of the trained tokens with weight 1
    ones = chunked_linear_sequence_cross_entropy(hidden, weight, b, targets, torch.ones(T), ids, K, chunk_size)
    logp = torch.log_softmax(F.linear(hidden, weight, b), -1)
    keep = (targets != -100) & (ids >= 0)
    logps = torch.zeros(K).index_add(0, ids[keep], logp[keep.nonzero().squeeze(1), targets[keep]])
    assert_close(-ones, logps, TOL, "log-probabilities")


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_training_forward_sequence_sums_match_plain_hf(tiny_config, chunk_size):
    ours, reference = model_pair(tiny_config)
    ours.set_chunk_loss(chunk_size)
    batch = tiny_batch(tiny_config, batch_size=2, seq_len=24, image_sizes=((32, 32), (32, 48)), lengths=(24, 19))
    targets = shift_labels(batch["labels"])
    weights = (targets != -100).float()
    ids = sample_ids(targets.shape)
    out = ours(**model_inputs(batch), shift_labels=targets, loss_weights=weights, sequence_ids=ids, num_sequences=2).loss
    assert out.shape == (2,) and out.dtype == torch.float32
    _consumer(out).backward()
    ref = sequence_cross_entropy(reference(**model_inputs(batch)).logits, targets, weights, ids, 2)
    _consumer(ref).backward()
    assert_close(out.detach(), ref.detach(), TOL, "loss")
    ref_params = dict(reference.named_parameters())
    checked = 0
    for name, param in ours.named_parameters():
        if ref_params[name].grad is None:
            assert param.grad is None, name
            continue
        assert_close(param.grad, ref_params[name].grad, TOL, f"grad {name}")
        checked += 1
    assert checked > 0
