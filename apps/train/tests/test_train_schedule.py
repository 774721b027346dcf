import math

import pytest

from mmfsdp.train.schedule import lr_at


def test_warmup_then_cosine_to_lr_min():
    kw = dict(lr=1.0, lr_min=0.1, total_steps=10, warmup_ratio=0.2)
    values = [lr_at(s, style="cosine", **kw) for s in range(10)]
    assert values[:2] == [0.5, 1.0]
    assert values[2] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[2:], values[3:]))
    mid = lr_at(2 + 7 / 2, style="cosine", **kw)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_linear_and_constant():
    kw = dict(lr=2.0, lr_min=0.0, total_steps=5, warmup_ratio=0.0)
    assert [lr_at(s, style="linear", **kw) for s in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    assert {lr_at(s, style="constant", **kw) for s in range(5)} == {2.0}
