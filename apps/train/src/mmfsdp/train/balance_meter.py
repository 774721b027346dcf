"""Rank imbalance and padding of each step, for the log line and `metrics.jsonl`.

Every rank times its forward and backward passes of the step (`observe`) and counts the tokens its rows hold
and the ones that are padding. On a logging step `scalars` gathers these three numbers from every rank in
one small all-gather (nothing is exchanged on the other steps) and returns

- `rank_imbalance`: max / mean over ranks of the measured forward + backward seconds. FSDP2's gathers make a
  fast rank wait for a slow one inside the passes, so the measured ratio understates the compute imbalance;
- `planned_imbalance`: max / mean of the ranks' costs in the step plan (`mmfsdp.data.balance`, token budget or
  balance only): the cost model's view, the same on every rank, no collective;
- `padding_fraction`: padding tokens / row tokens of the whole step (all ranks, all micro-batches).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist


class BalanceMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._values = (0.0, 0, 0)
        self._planned: float | None = None

    def observe(self, micro_batches: Sequence[dict[str, Any]], compute_s: float, plan: Any = None) -> None:
        """This rank's step: its micro-batches, the seconds of their passes, the step plan (or None)."""
        row_tokens = sum(int(mb["attention_mask"].numel()) for mb in micro_batches)
        real_tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
        self._values = (compute_s, row_tokens, real_tokens)
        self._planned = plan.imbalance if plan is not None else None

    def scalars(self) -> dict[str, float]:
        """The last observed step's numbers over all ranks (a collective: every rank calls it on the same steps)."""
        local = torch.tensor(self._values, dtype=torch.float64, device=self.device)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            gathered = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            table = torch.stack(gathered)
        else:
            table = local[None]
        table = table.cpu()
        times, rows, real = table[:, 0], table[:, 1].sum(), table[:, 2].sum()
        out = {
            "rank_imbalance": float(times.max() / times.mean()) if float(times.mean()) > 0 else 1.0,
            "padding_fraction": float((rows - real) / rows) if float(rows) > 0 else 0.0,
        }
        if self._planned is not None:
            out["planned_imbalance"] = self._planned
        return out
