"""Peak memory per rank of one forward+backward of a decoder stack under context parallel, CP = 1, 2, 4.

    uv run python tools/bench/cp_memory.py                       # ring, 8k tokens
    uv run python tools/bench/cp_memory.py --mode hybrid --seq-len 32768 --layers 1
    uv run python tools/bench/cp_memory.py --smoke                # the smallest run (CI): CP 1 and 2, 256 tokens

Each CP size is a fresh set of gloo ranks on the CPU (`run_distributed`). Every
rank builds the same small decoder stack (RMSNorm → attention through
`context_parallel_attention` → RMSNorm → SwiGLU MLP, residuals, fp32), takes
its `S / CP` tokens, runs one forward and backward, and reports

- `peak`: the rise of its resident set over the step (VmHWM after, with the
  high-water mark reset just before, minus VmRSS before). glibc is told to
  serve every allocation above 64 KiB with mmap, so freed tensors leave the
  resident set and the high-water mark tracks live memory;
- `saved`: the bytes of the tensors autograd saves for backward (unique
  storages, parameters excluded), i.e. activation memory at the end of forward;
- `tensor`: the most tensor bytes alive at once during the step beyond those it
  starts with (parameters, inputs), counted by `mmfsdp.parallel.tensor_memory.
  TensorMemory` (the CPU stand-in for an accelerator's `max_memory_allocated`,
  as `lora_memory.py` uses) in a second, identical step after the measured one
  (the counter's own objects would add to the resident set): the same in every
  run, where `peak` moves by a few MiB from run to run and also holds what the
  process, not the step's tensors, adds to its resident set.

`--mode` picks how CP ranks are used: `ring` (ring = CP), `ulysses`
(Ulysses = CP) or `hybrid` (Ulysses 2 inside, ring = CP / 2 across). A table
goes to stdout; the last line is one JSON object with `mem_ratio_cp<N>` (per-rank
peak over the CP = 1 peak, worst rank), `saved_ratio_cp<N>` and `tensor_ratio_cp<N>`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _smoke import parse_args

from mmfsdp.parallel.cp import CPLayout, context_parallel_attention, cp_loss_reduce, split_for_cp
from mmfsdp.parallel.tensor_memory import TensorMemory
from mmfsdp.parallel.testing import run_distributed


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1 = torch.nn.RMSNorm(hidden)
        self.q = torch.nn.Linear(hidden, hidden, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(hidden)
        self.gate_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h, attend):
        B, S, _ = h.shape
        x = self.norm1(h)
        q = self.q(x).view(B, S, self.heads, self.head_dim)
        k, v = self.kv(x).view(B, S, 2, self.kv_heads, self.head_dim).unbind(2)
        h = h + self.o(attend(q, k, v).reshape(B, S, -1))
        gate, up = self.gate_up(self.norm2(h)).chunk(2, -1)
        return h + self.down(F.silu(gate) * up)


def ring_ulysses_sizes(mode: str, cp: int) -> tuple[int, int]:
    """(ring, ulysses) for `cp` ranks."""
    if cp == 1:
        return 1, 1
    if mode == "ring":
        return cp, 1
    if mode == "ulysses":
        return 1, cp
    return cp // 2, 2


def cp_layout_and_groups(rank: int, world_size: int, mode: str, seq_len: int):
    """This rank's `CPLayout` of one `seq_len` sample and its (ring, Ulysses) groups: Ulysses ranks adjacent."""
    ring, ulysses = ring_ulysses_sizes(mode, world_size)
    ring_group = ulysses_group = None
    for r in range(ring):
        group = dist.new_group(list(range(r * ulysses, (r + 1) * ulysses)))
        ulysses_group = group if r == rank // ulysses else ulysses_group
    for u in range(ulysses):
        group = dist.new_group(list(range(u, world_size, ulysses)))
        ring_group = group if u == rank % ulysses else ring_group
    ring_rank, ulysses_rank = divmod(rank, ulysses)
    layout = CPLayout.create(
        seq_len, ring_size=ring, ring_rank=ring_rank, ulysses_size=ulysses, ulysses_rank=ulysses_rank
    )
    return layout, ring_group, ulysses_group


def local_inputs(layout: CPLayout, hidden: int, seed: int = 0) -> torch.Tensor:
    """This rank's `[1, S / CP, hidden]` inputs, drawn per position (seeded by it and `seed`): the full sequence
    never exists on one rank, and every CP size sees the same sequence."""
    positions = split_for_cp(torch.arange(layout.seq_len), layout, dim=0)
    rows = [torch.randn(hidden, generator=torch.Generator().manual_seed(seed + int(p))) for p in positions]
    return torch.stack(rows).unsqueeze(0).requires_grad_()


class SavedTensorBytes(torch.autograd.graph.saved_tensors_hooks):
    """Inside `with`: counts the bytes of the unique storages autograd saves for backward (`nbytes`), the storages
    of `parameters` aside — the activation memory at the end of a forward."""

    def __init__(self, parameters):
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self._saved: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self._saved[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> Self:
        super().__enter__()
        return self

    @property
    def nbytes(self) -> int:
        return sum(self._saved.values())


def proc_status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _measure(rank, world_size, mode, seq_len, hidden, heads, kv_heads, intermediate, layers):
    layout, ring_group, ulysses_group = cp_layout_and_groups(rank, world_size, mode, seq_len)

    torch.manual_seed(0)
    model = torch.nn.ModuleList(_Block(hidden, heads, kv_heads, intermediate) for _ in range(layers))
    h = local_inputs(layout, hidden)

    def attend(q, k, v):
        return context_parallel_attention(q, k, v, layout, ring_group=ring_group, ulysses_group=ulysses_group)

    def step() -> tuple[torch.Tensor, int]:
        """One forward and backward; the loss and the bytes autograd saved."""
        with SavedTensorBytes(model.parameters()) as saved:
            x = h
            for block in model:
                x = block(x, attend)
            loss = cp_loss_reduce(x.float().pow(2).sum() / (seq_len * hidden), dist.group.WORLD)
        loss.backward()
        return loss, saved.nbytes

    dist.barrier()
    rss_before = proc_status_kb("VmRSS")
    reset_peak_rss()
    start = time.perf_counter()
    loss, saved_bytes = step()
    seconds = time.perf_counter() - start
    peak_kb = proc_status_kb("VmHWM") - rss_before
    dist.barrier()
    # the same step again, its tensors counted (after the RSS measure: the counter's own objects stay out of it)
    model.zero_grad(set_to_none=True)
    h.grad = None
    with TensorMemory("cpu") as tensors:
        tensors.hold([*model.parameters(), h])
        held = tensors.current
        again, _ = step()
    assert again.item() == loss.item()
    return {"peak_mib": peak_kb / 1024, "saved_mib": saved_bytes / 2**20, "tensor_mib": (tensors.peak - held) / 2**20,
            "seconds": seconds, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ring", "ulysses", "hybrid"], default="ring")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cp-sizes", default="1,2,4", help="comma-separated; must start with 1")
    args = parse_args(parser, seq_len=256, hidden=64, intermediate=128, layers=1, cp_sizes="1,2")
    cp_sizes = [int(x) for x in args.cp_sizes.split(",")]
    if cp_sizes[0] != 1:
        parser.error("--cp-sizes must start with 1 (the baseline)")
    # every allocation above 64 KiB is its own mapping, returned to the OS when freed (inherited by the ranks)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)

    rows = {}
    print(f"mode={args.mode} seq_len={args.seq_len} hidden={args.hidden} heads={args.heads} kv_heads={args.kv_heads} "
          f"intermediate={args.intermediate} layers={args.layers}")
    print(f"{'cp':>3} {'ring':>4} {'uly':>4} {'peak MiB/rank':>14} {'saved MiB/rank':>15} {'tensor MiB/rank':>16} "
          f"{'seconds':>8} {'loss':>12}")
    for cp in cp_sizes:
        ring, ulysses = ring_ulysses_sizes(args.mode, cp)
        per_rank = run_distributed(
            _measure, cp, args.mode, args.seq_len, args.hidden, args.heads, args.kv_heads, args.intermediate,
            args.layers, timeout=1800,
        )
        worst = {key: max(r[key] for r in per_rank) for key in ("peak_mib", "saved_mib", "tensor_mib", "seconds")}
        rows[cp] = worst
        print(f"{cp:>3} {ring:>4} {ulysses:>4} {worst['peak_mib']:>14.1f} {worst['saved_mib']:>15.1f} "
              f"{worst['tensor_mib']:>16.1f} {worst['seconds']:>8.1f} {per_rank[0]['loss']:>12.6f}")
    base = rows[1]
    result = {}
    for cp in cp_sizes[1:]:
        result[f"mem_ratio_cp{cp}"] = round(rows[cp]["peak_mib"] / base["peak_mib"], 4)
        result[f"saved_ratio_cp{cp}"] = round(rows[cp]["saved_mib"] / base["saved_mib"], 4)
        result[f"tensor_ratio_cp{cp}"] = round(rows[cp]["tensor_mib"] / base["tensor_mib"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
