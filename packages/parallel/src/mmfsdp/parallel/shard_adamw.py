"""AdamW that updates each DTensor parameter's local shard directly.

`ShardAdamW` is `torch.optim.AdamW` (same constructor, param groups, state-dict layout, checkpoints) whose
`step` calls torch's own functional AdamW (`torch.optim.adam.adam`, what `AdamW.step` calls) on the *local*
tensors of the parameters, gradients and moments, with the group's `foreach` / `fused` settings. AdamW is
elementwise and its per-tensor scalars depend only on that tensor's own `step`, so the update of a shard is the
update DTensor would dispatch to the same kernel: the results are the same bits (tested against `AdamW` on FSDP2).

Why not let DTensor dispatch it: a fused or foreach AdamW over FSDP2's DTensors is one DTensor op over lists of
every parameter, and its first call in a process runs DTensor's sharding propagation for the whole list (fake
tensors for each argument: about 0.3 s a rank on the CPU for the tiny models, more for a real model's hundreds
of parameters), then a cache lookup over the list every step. Every gradient placement equals its parameter's
after FSDP2's reduce-scatter (`Shard` / `_StridedShard`, `Replicate` across HSDP replicas); one that does not (a
`Partial` gradient) is redistributed to the parameter's placements first, which is what DTensor's dispatch does.

The moments are DTensors with the parameter's mesh and placements (their local tensors beside the parameter's),
so `get_state_dict` / `set_state_dict` and DCP see the standard AdamW layout. `SwapAdamW`
(`mmfsdp.parallel.swap_optimizer`) is this optimizer with its moments in host memory.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as functional_adam
from torch.optim.optimizer import _get_scalar_dtype

__all__ = ["ShardAdamW", "MOMENT_KEYS", "local_tensor", "like_param"]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
_ADAM_KEYWORDS = set(inspect.signature(functional_adam).parameters)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor itself)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` wrapped as a DTensor with `param`'s mesh and placements (or `local` itself for a plain tensor)."""
    if isinstance(param, DTensor):
        return DTensor(local, param._spec, requires_grad=False)
    return local


class ShardAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose update runs on the local shards (module docstring)."""

    # -- state -------------------------------------------------------------------------------
    def _moment_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """A zeroed local tensor for one moment of `param` (beside the parameter's shard)."""
        return torch.zeros_like(local_tensor(param), memory_format=torch.preserve_format)

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        if state:
            return
        local = local_tensor(param)
        if group["capturable"] or group["fused"]:
            state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=local.device)
        else:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
        for key in self._moment_keys(group):
            state[key] = like_param(param, self._moment_buffer(param))

    @staticmethod
    def _moment_keys(group: dict[str, Any]) -> tuple[str, ...]:
        return MOMENT_KEYS if group["amsgrad"] else MOMENT_KEYS[:2]

    # -- step --------------------------------------------------------------------------------
    def _adam_kwargs(self, group: dict[str, Any]) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        kwargs = dict(
            amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
            foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
            fused=group["fused"], grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
            has_complex=False, decoupled_weight_decay=group.get("decoupled_weight_decay", True),
        )
        return {key: value for key, value in kwargs.items() if key in _ADAM_KEYWORDS}

    @staticmethod
    def _local_grad(param: torch.Tensor) -> torch.Tensor:
        """`param.grad`'s local shard laid out as the parameter's (redistributed where its placements differ)."""
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad._spec.placements != param._spec.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return local_tensor(grad)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for param in params:
                if param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if torch.is_complex(param):
                    raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
                self._init_state(param, group)
            self._group_step(params, group)
        return loss

    def _group_step(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Update one group's `params` (all with gradients and state) in place."""
        moments = [[local_tensor(self.state[p][key]) for p in params] for key in self._moment_keys(group)]
        self._update(params, moments, self._adam_kwargs(group), group)

    def _update(self, params: list[torch.Tensor], moments: list[list[torch.Tensor]], kwargs: dict[str, Any],
                group: dict[str, Any]) -> None:
        """torch's functional AdamW on the local shards of `params`, their gradients and `moments` (per key)."""
        exp_avgs, exp_avg_sqs = moments[0], moments[1]
        max_exp_avg_sqs = moments[2] if group["amsgrad"] else []
        functional_adam(
            [local_tensor(p) for p in params], [self._local_grad(p) for p in params], exp_avgs, exp_avg_sqs,
            max_exp_avg_sqs, [self.state[p]["step"] for p in params], **kwargs,
        )
