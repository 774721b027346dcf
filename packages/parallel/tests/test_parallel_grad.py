import pytest
import torch

from mmfsdp.parallel import clip_grad_norm
from mmfsdp.parallel.testing import assert_within


def _params(seed: int):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(3, 4), (5,), (2, 2, 2)]]
    for param in params[:2]:
        param.grad = torch.randn(param.shape, generator=generator)
    return params  # the last one has no gradient


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
@pytest.mark.parametrize("foreach", [None, False])
def test_parallel_clip_grad_norm_plain_tensors_match_torch(max_norm, foreach):
    ours, theirs = _params(0), _params(0)
    total = clip_grad_norm(ours, max_norm, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
    assert isinstance(total, torch.Tensor) and total.dim() == 0
    assert_within(abs(total.item() - expected.item()) / expected.item(), 1e-6, "total norm")
    for a, b in zip(ours[:2], theirs[:2]):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_parallel_clip_grad_norm_zero_max_norm_only_measures():
    params = _params(1)
    before = [p.grad.clone() for p in params[:2]]
    total = clip_grad_norm(params, 0.0)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]))
    assert_within(abs(total.item() - expected.item()) / expected.item(), 1e-6, "total norm")
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before))


def test_parallel_clip_grad_norm_without_grads_is_zero():
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
