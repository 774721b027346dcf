"""The training forward's per-token mode (online RL, `mmfsdp.model.training_forward` step 8): minus `.loss` is each
completion token's log-probability under `softmax(logits / T)` over the whole vocabulary, TRL's
`selective_log_softmax(logits / T)` on plain HF logits, and `.entropy` the distribution's entropy; the gradients
are plain HF's. Given the tokens the rollout never samples, `.kept_logmass` is the log of the other tokens' mass:
the token's log-probability minus it is its log-probability under the sampler's distribution, the one the
rollout's sampling log-probabilities are of (`warp_logits` with the same suppression). With chunk loss the same
values come from the hidden states chunk by chunk (`chunked_linear_token_cross_entropy`; the tokens that do not
train hold 0)."""

import pytest
import torch

from mmfsdp.model import shift_labels
from mmfsdp.model.families.mistral3.testing import tiny_batch
from mmfsdp.model.rollout import SamplingParams, sample_tokens
from mmfsdp.model.testing import assert_close, model_inputs, model_pair

TOL = 1e-5


@pytest.mark.parametrize("chunk_size", [None, 5], ids=["logits", "chunk_loss"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_per_token_logps_match_plain_hf(tiny_config, temperature, chunk_size):
    ours, reference = model_pair(tiny_config)
    ours.set_chunk_loss(chunk_size)
    batch = tiny_batch(tiny_config, batch_size=2, seq_len=24, image_sizes=((32, 32), (32, 48)), lengths=(24, 19))
    targets = shift_labels(batch["labels"])
    weights = (targets != -100).float()
    suppressed = torch.tensor([0, 3])
    targets = torch.where(torch.isin(targets, suppressed), -100, targets)
    out = ours(**model_inputs(batch), shift_labels=targets, loss_weights=weights, per_token=True,
               temperature=temperature, suppress_token_ids=suppressed)
    assert out.loss.shape == targets.shape and out.entropy.shape == targets.shape
    logits = reference(**model_inputs(batch)).logits.float()
    logps_V = (logits / temperature).log_softmax(-1)
    want = torch.where(targets != -100, logps_V.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1), 0.0)
    assert_close(-out.loss.detach(), want.detach(), TOL, "log-probabilities")
    entropy = -(logps_V.exp() * logps_V).sum(-1)
    trained = targets != -100
    if chunk_size is None:
        assert_close(out.entropy, entropy.detach(), TOL, "entropy")
    else:  # only the trained tokens get logits
        assert_close(out.entropy[trained], entropy[trained].detach(), TOL, "entropy")
        assert not out.entropy[~trained].any() and not out.loss[~trained].any()
    sampler_V = (logits.index_fill(-1, suppressed, float("-inf")) / temperature).log_softmax(-1)
    sampled = sampler_V.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    assert_close((-out.loss - out.kept_logmass)[trained], sampled[trained].detach(), TOL, "sampler log-probabilities")
    (out.loss * torch.linspace(0.5, 1.5, out.loss.numel()).reshape(out.loss.shape)).sum().backward()
    (-want * torch.linspace(0.5, 1.5, want.numel()).reshape(want.shape)).sum().backward()
    ref_params = dict(reference.named_parameters())
    checked = 0
    for name, param in ours.named_parameters():
        if param.grad is not None and ref_params[name].grad is not None:
            assert_close(param.grad, ref_params[name].grad, TOL, f"grad {name}")
            checked += 1
    assert checked > 0


def test_sampling_never_draws_a_suppressed_token_and_its_logps_exclude_them():
    logits = torch.zeros(64, 5)
    logits[:, 2] = 4.0
    sampling = SamplingParams(max_new_tokens=1, temperature=1.0, suppress_token_ids=(2, 4))
    tokens, logps = sample_tokens(logits, sampling, torch.arange(64), 0)
    assert not torch.isin(tokens, torch.tensor([2, 4])).any()
    assert torch.allclose(logps, torch.full((64,), -torch.log(torch.tensor(3.0))))
