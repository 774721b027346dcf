"""AdamW whose moment buffers live in host memory and stream through the device in buckets.

`SwapAdamW` is `torch.optim.AdamW` (same constructor, same param groups, same
state-dict layout) except where `exp_avg` and `exp_avg_sq` are kept: in host
memory, pinned when the parameters live on an accelerator (CUDA or NPU), so
the device holds only one window of buckets of optimizer state instead of
two fp32 copies of every parameter shard. One `step()`:

1. the parameters that have a gradient are cut, in param-group order and at
   tensor boundaries, into `swap_times` buckets of about equal element count;
2. bucket `b + 1`'s moments are copied host → device on a copy stream while
   bucket `b` is updated on the compute stream (events order the two);
3. each bucket is updated by torch's own functional AdamW
   (`torch.optim.adam.adam`, the function `torch.optim.AdamW.step` calls) on
   the parameters' local tensors, with the group's `foreach` / `fused`
   settings: AdamW is elementwise and every per-tensor scalar (bias
   corrections, step sizes) depends only on that tensor's own `step`, so
   bucketing changes no bit of the result;
4. the updated moments go device → host on the copy stream; at most two
   buckets are in flight, and `step()` returns once the last copy is done, so
   between steps (checkpointing, `state_dict()`) the host copies are current.

Without an accelerator (CPU runs) the moments are already on the host: the
buckets are updated in place and nothing is copied. `step` stays where
torch's AdamW keeps it (a CPU scalar; on the device with `fused`).

With FSDP2 the parameters are DTensors; their moments are DTensors with the
same mesh and placements whose local tensors are on the host (as FSDP2's own
CPU offload keeps parameters), so `get_state_dict` / `set_state_dict` and DCP
see the standard AdamW layout and a checkpoint written with `adamw_swap`
loads into `adamw` and back. `load_state_dict` copies loaded moments into the
host buffers instead of letting `torch.optim.Optimizer` move them to the
parameters' device (which would need the full state on the device at once).

Streams and events come from `torch.accelerator` where this torch has it, else
from `torch.cuda` / `torch.npu`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import deque
from typing import Any, Iterator

import torch

from mmfsdp.parallel.shard_adamw import MOMENT_KEYS, ShardAdamW, like_param, local_tensor

__all__ = ["SwapAdamW", "MOMENT_KEYS"]

_MAX_IN_FLIGHT = 2
_local = local_tensor


class _Streams:
    """The compute stream, one copy stream and events of one accelerator."""

    def __init__(self, device: torch.device):
        self.device = device
        accelerator = getattr(torch, "accelerator", None)
        self._generic = (
            accelerator is not None
            and hasattr(accelerator, "set_stream")
            and accelerator.is_available()
            and accelerator.current_accelerator().type == device.type
        )
        self._module = None if self._generic else getattr(torch, device.type)
        self.copy = torch.Stream(device=device) if self._generic else self._module.Stream(device)

    def compute(self):
        return torch.accelerator.current_stream(self.device) if self._generic else self._module.current_stream(self.device)

    def record(self, stream):
        return stream.record_event()

    @contextlib.contextmanager
    def on(self, stream) -> Iterator[None]:
        if not self._generic:
            with self._module.stream(stream):
                yield
            return
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)


class SwapAdamW(ShardAdamW):
    """`ShardAdamW` (AdamW on the local shards) with `exp_avg` / `exp_avg_sq` in (pinned) host memory, updated
    in `swap_times` buckets."""

    def __init__(self, params: Any, *args: Any, swap_times: int = 16, **kwargs: Any):
        if swap_times < 1:
            raise ValueError(f"swap_times must be >= 1, got {swap_times}")
        super().__init__(params, *args, **kwargs)
        self.swap_times = swap_times
        self._streams: dict[torch.device, _Streams] = {}

    # -- state -------------------------------------------------------------------------------
    def _moment_buffer(self, param: torch.Tensor) -> torch.Tensor:
        local = _local(param)
        pin = local.device.type != "cpu"
        return torch.zeros(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like `AdamW`, but keep the moments in this optimizer's host buffers."""
        previous = {param: dict(state) for param, state in self.state.items()}
        moments: dict[Any, dict[str, torch.Tensor]] = {}
        rest: dict[Any, dict[str, Any]] = {}
        for key, entry in state_dict["state"].items():
            moments[key] = {name: value for name, value in entry.items() if name in MOMENT_KEYS}
            rest[key] = {name: value for name, value in entry.items() if name not in MOMENT_KEYS}
        super().load_state_dict({**state_dict, "state": rest})
        saved_ids = itertools.chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = itertools.chain.from_iterable(group["params"] for group in self.param_groups)
        by_id = dict(zip(saved_ids, params))
        with torch.no_grad():
            for key, values in moments.items():
                param = by_id[key]
                for name, value in values.items():
                    old = previous.get(param, {}).get(name)
                    if value is old:
                        self.state[param][name] = old
                        continue
                    buffer = _local(old) if old is not None else self._moment_buffer(param)
                    source = _local(value)
                    if source.shape != buffer.shape:
                        raise ValueError(
                            f"optimizer state {name!r} has local shape {tuple(source.shape)}, "
                            f"the parameter's shard is {tuple(buffer.shape)}"
                        )
                    buffer.copy_(source)
                    self.state[param][name] = like_param(param, buffer)

    # -- step --------------------------------------------------------------------------------
    def _buckets(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        total = sum(_local(p).numel() for p in params)
        target = max(1, math.ceil(total / self.swap_times))
        buckets: list[list[torch.Tensor]] = [[]]
        filled = 0
        for param in params:
            if filled >= target:
                buckets.append([])
                filled = 0
            buckets[-1].append(param)
            filled += _local(param).numel()
        return buckets

    def _group_step(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        keys = self._moment_keys(group)
        kwargs = self._adam_kwargs(group)
        device = _local(params[0]).device
        if device.type == "cpu":
            for bucket in self._buckets(params):
                self._update(bucket, [[_local(self.state[p][k]) for p in bucket] for k in keys], kwargs, group)
        else:
            self._streamed_step(params, keys, kwargs, group, device)

    def _streamed_step(self, params, keys, kwargs, group, device: torch.device) -> None:
        if device not in self._streams:
            self._streams[device] = _Streams(device)
        streams = self._streams[device]
        compute = streams.compute()
        buckets = self._buckets(params)
        host = [[[_local(self.state[p][k]) for p in bucket] for k in keys] for bucket in buckets]
        in_flight: deque = deque()

        def to_device(index: int):
            while len(in_flight) >= _MAX_IN_FLIGHT:
                in_flight.popleft().synchronize()  # bounds the device memory the window holds
            with streams.on(streams.copy):
                moments = [[tensor.to(device, non_blocking=True) for tensor in per_key] for per_key in host[index]]
                ready = streams.record(streams.copy)
            for tensor in itertools.chain.from_iterable(moments):
                tensor.record_stream(compute)
            return moments, ready

        pending = to_device(0)
        for index, bucket in enumerate(buckets):
            moments, ready = pending
            if index + 1 < len(buckets):
                pending = to_device(index + 1)
            compute.wait_event(ready)
            self._update(bucket, moments, kwargs, group)
            updated = streams.record(compute)
            streams.copy.wait_event(updated)
            with streams.on(streams.copy):
                for per_key_host, per_key_device in zip(host[index], moments):
                    for target, source in zip(per_key_host, per_key_device):
                        target.copy_(source, non_blocking=True)
                in_flight.append(streams.record(streams.copy))
            del moments
        while in_flight:
            in_flight.popleft().synchronize()
