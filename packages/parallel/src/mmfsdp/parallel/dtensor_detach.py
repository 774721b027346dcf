"""DTensor `detach` without sharding propagation, for the spans that wrap every parameter of a model in a DTensor.

`nn.Parameter(dtensor)` detaches its argument, and DTensor answers an op whose input (shape, stride, placements)
the process has not met before with its full sharding propagation: the op's strategies expanded over the mesh and
the op run on fake tensors for the output's metadata, about 5 ms on the 2-core CI machine. `fully_shard` wraps each
parameter so (`FSDPParam._init_sharded_param`), once per parameter shape in every process: 300 parameters of 150
shapes took 0.85 s of the 0.9 s `fully_shard` took, and the test suite's ranks spent ~27 CPU-seconds there.

Yet `detach` decides nothing: its output is the input's local tensor detached, with the input's spec (the same
shape, stride, placements and mesh). Inside `dtensor_detach_without_propagation()`, DTensor's dispatcher returns
that directly, through its table of custom op handlers (the hook torch itself uses for `convolution`,
`is_same_size`, `as_strided`, ...); on leaving, the table is as it was. The same 300 parameters: 0.05 s. Values,
specs and autograd are unchanged (`packages/parallel/tests/test_parallel_dtensor_detach.py` compares a model sharded
with and without it).
On a torch without the table it does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

__all__ = ["dtensor_detach_without_propagation"]

_DETACH = torch.ops.aten.detach.default


def _detach(op_call, args, kwargs):
    tensor = args[0]
    return DTensor(tensor._local_tensor.detach(), tensor._spec, requires_grad=False)


@contextlib.contextmanager
def dtensor_detach_without_propagation() -> Iterator[None]:
    """DTensor's `detach` answered from its input's spec while inside (see the module's docstring)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if not isinstance(handlers, dict) or _DETACH in handlers:  # no table, or someone else's handler: leave it
        yield
        return
    handlers[_DETACH] = _detach
    try:
        yield
    finally:
        handlers.pop(_DETACH, None)
