import pytest
import torch
from torch import nn

from mmfsdp.config import ConfigError
from mmfsdp.parallel import apply_activation_checkpointing, is_checkpointed


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(8, 4)
        self.forward_calls = 0

    def forward(self, x, *, gate=None):
        self.forward_calls += 1
        h = self.fc2(self.drop(torch.relu(self.fc1(x))))
        return x + (h if gate is None else h * gate)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(4, 1)

    def forward(self, x, gate):
        for layer in self.layers:
            x = layer(x, gate=gate)
        return self.out(x).sum()


def _grads(model, x, gate):
    torch.manual_seed(7)  # the same dropout masks in both runs
    model(x, gate).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, gate.grad.clone()


def test_parallel_checkpointing_keeps_gradients_and_names():
    torch.manual_seed(0)
    plain = Stack()
    checkpointed = Stack()
    checkpointed.load_state_dict(plain.state_dict())
    keys = list(checkpointed.state_dict())
    assert apply_activation_checkpointing(checkpointed, ["layers.{0-1}"]) == ["layers.0", "layers.1"]
    assert list(checkpointed.state_dict()) == keys
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [is_checkpointed(layer) for layer in checkpointed.layers] == [True, True, False]

    x = torch.randn(5, 4)
    expected, expected_gate = _grads(plain, x, torch.full((4,), 0.5, requires_grad=True))
    actual, actual_gate = _grads(checkpointed, x, torch.full((4,), 0.5, requires_grad=True))
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(actual[name], grad), name
    assert torch.equal(actual_gate, expected_gate)
    # the checkpointed layers ran their forward again during backward
    assert [layer.forward_calls for layer in checkpointed.layers] == [2, 2, 1]


def test_parallel_checkpointing_skips_recompute_without_grad_and_is_idempotent():
    model = Stack()
    apply_activation_checkpointing(model, ["layers.{*}"])
    apply_activation_checkpointing(model, ["layers.{*}"])
    with torch.no_grad():
        model(torch.randn(2, 4), None)
    assert [layer.forward_calls for layer in model.layers] == [1, 1, 1]
    model(torch.randn(2, 4), None).backward()
    assert [layer.forward_calls for layer in model.layers] == [3, 3, 3]


def test_parallel_checkpointing_unmatched_pattern_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        apply_activation_checkpointing(Stack(), ["layer.{*}"])
    assert err.value.key == "parallel.recompute_plan.apply_modules[0]"
    assert "layers.{*}" in err.value.message
