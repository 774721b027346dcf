"""Benchmark one MoE layer's forward+backward: mmfsdp's expert dispatch vs. HF's own Qwen3-VL-MoE experts loop.

One HF `Qwen3VLMoeTextSparseMoeBlock` (router + fused experts) is built from a
tiny `Qwen3VLMoeTextConfig` with random weights. Every variant runs the same
router on the same `--tokens` hidden states and differs only in the experts:

    hf       the module's own forward (experts_implementation "eager": a loop over the experts that were hit)
    grouped  mmfsdp.parallel.experts_forward(..., implementation="grouped")   (torch grouped GEMM)
    loop     mmfsdp.parallel.experts_forward(..., implementation="loop")      (loop over local experts)

with EP 1 (no process group) in this process, on the same weights. Outputs and
all gradients (input, router, experts) are checked against `hf` first. Time: the
variants run alternately, `--repeats` rounds after that check (the warm-up; a round
times a variant's step as the mean over at least 50 ms of steps, so a step shorter
than the CPU clock's tick is not read as 0), and each
reports its fastest round (least disturbed by other load) and its median, in
wall-clock time and, on the CPU, in this process's CPU time; `speedup_vs_hf` is
`hf` over the faster of ours in CPU time on the CPU (steadier on a shared
machine) and in wall time elsewhere; `speedup_vs_hf_wall` is always wall time.

Memory under EP: four gloo ranks on the CPU build the experts module, call
`shard_experts` with EP 2 (two groups) and EP 4, and report the bytes their
expert parameters' storages hold over the unsharded bytes (worst rank).

    uv run python tools/bench/moe_dispatch.py                   # CPU: 64 experts, top-8, 4096 tokens, 256/128
    uv run python tools/bench/moe_dispatch.py --device cuda --dtype bf16 --experts 128 --tokens 16384 \
        --hidden 2048 --intermediate 768                        # Qwen3-VL-30B-A3B's layer on a GPU
    uv run python tools/bench/moe_dispatch.py --smoke           # the smallest run (CI): 8 experts, 64 tokens

Progress goes to stderr; the last line on stdout is one JSON object with
`speedup_vs_hf` (target >= 2 on the CPU), `expert_param_bytes_per_rank_ratio`
(`{"ep2": …, "ep4": …}`, target <= 0.55 / 0.3) and `gpu_command`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _smoke import parse_args

from mmfsdp.parallel.dtypes import DTYPES
from mmfsdp.parallel.expert_parallel import experts_forward, grouped_mm_supported, shard_experts
from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

_DTYPES = {name: DTYPES[name] for name in ("fp32", "bf16")}
RANK_MODULES = ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",)
"""What every rank imports, once in the process the ranks fork from (`preload_for_ranks`)."""
GPU_COMMAND = (
    "uv run python tools/bench/moe_dispatch.py --device cuda --dtype bf16 --experts 128 --top-k 8 "
    "--tokens 16384 --hidden 2048 --intermediate 768"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64, help="experts in the layer (Qwen3-VL-30B-A3B: 128)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (Qwen3-VL-30B-A3B: 8)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the batch")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (Qwen3-VL-30B-A3B: 2048)")
    parser.add_argument(
        "--intermediate", type=int, default=128, help="expert intermediate size (Qwen3-VL-30B-A3B: 768)"
    )
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="dtype of weights and hidden states")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (each runs every variant)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _moe_config(args: argparse.Namespace):
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextConfig

    return Qwen3VLMoeTextConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        experts_implementation="eager",
    )


def _moe_block(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextSparseMoeBlock

    torch.manual_seed(0)
    block = Qwen3VLMoeTextSparseMoeBlock(_moe_config(args))
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.02)
    return block.to(device, dtype)


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


class _Variants:
    """One forward+backward step of each variant on the same block, input and output cotangent."""

    def __init__(self, args: argparse.Namespace):
        self.device = torch.device(args.device)
        dtype = _DTYPES[args.dtype]
        self.block = _moe_block(args, self.device, dtype)
        generator = torch.Generator().manual_seed(1)
        self.hidden = torch.randn(1, args.tokens, args.hidden, generator=generator).to(self.device, dtype)
        self.cotangent = torch.randn(1, args.tokens, args.hidden, generator=generator).to(self.device, dtype)
        self.names = ["hf", "loop"]
        if grouped_mm_supported(self.device, dtype):
            self.names.insert(1, "grouped")

    def _forward(self, name: str, hidden: torch.Tensor) -> torch.Tensor:
        if name == "hf":
            return self.block(hidden)
        flat = hidden.view(-1, hidden.shape[-1])
        _, weight, idx = self.block.gate(flat)
        return experts_forward(self.block.experts, flat, idx, weight, implementation=name).view_as(hidden)

    def step(self, name: str) -> list[torch.Tensor]:
        """Output and gradients (input, then each parameter); clears the parameters' gradients after."""
        hidden = self.hidden.clone().requires_grad_()
        out = self._forward(name, hidden)
        out.backward(self.cotangent)
        values = [out.detach(), hidden.grad] + [param.grad for param in self.block.parameters()]
        self.block.zero_grad(set_to_none=True)
        return values

    def time(self, name: str, min_seconds: float = 0.05) -> tuple[float, float]:
        """Wall-clock and this process's CPU seconds of one step: the mean over as many steps as take `min_seconds`
        of wall time (at least one), so a step shorter than the CPU clock's tick (a few ms on some kernels) is not
        read as 0 CPU seconds."""
        steps = 0
        _synchronize(self.device)
        start, start_cpu = time.perf_counter(), time.process_time()
        while steps == 0 or time.perf_counter() - start < min_seconds:
            self.step(name)
            _synchronize(self.device)
            steps += 1
        return (time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps


def _check_equal(variants: _Variants) -> dict[str, float]:
    """Largest relative difference of output and gradients from HF's, per variant; raises if above tolerance."""
    tolerance = 1e-5 if variants.hidden.dtype == torch.float32 else 2e-2
    reference = variants.step("hf")
    errors = {}
    for name in variants.names[1:]:
        worst = 0.0
        for ours, theirs in zip(variants.step(name), reference):
            worst = max(worst, ((ours.float() - theirs.float()).norm() / theirs.float().norm().clamp_min(1e-30)).item())
        if worst > tolerance:
            raise AssertionError(
                f"{name}: output or gradient differs from HF's by {worst:.2e} (relative) > {tolerance}"
            )
        errors[name] = worst
    return errors


def _expert_bytes(module: torch.nn.Module) -> int:
    return sum(module.get_parameter(name).untyped_storage().nbytes() for name in ("gate_up_proj", "down_proj"))


def _sharded_bytes_ratio(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, float]:
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextExperts

    groups = {f"ep{world_size}": dist.group.WORLD}
    for members in ([0, 1], [2, 3]):
        group = dist.new_group(members)
        if rank in members:
            groups["ep2"] = group
    ratios = {}
    for key in ("ep2", "ep4"):
        module = Qwen3VLMoeTextExperts(_moe_config(args))
        full = _expert_bytes(module)
        ratios[key] = _expert_bytes(shard_experts(module, groups[key])) / full
    return ratios


def main(argv: list[str] | None = None) -> None:
    args = parse_args(_parser(), argv, experts=8, top_k=2, tokens=64, hidden=32, intermediate=16, repeats=1)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = _Variants(args)
    _log(
        f"{args.experts} experts, top-{args.top_k}, {args.tokens} tokens, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, {args.dtype} on {args.device}; variants {variants.names}"
    )
    errors = _check_equal(variants)  # also the warm-up of every variant
    _log(f"outputs and gradients equal to HF's (largest relative difference {errors})")
    seconds = {name: [] for name in variants.names}
    cpu_seconds = {name: [] for name in variants.names}
    for round_index in range(args.repeats):
        for name in variants.names:
            wall, cpu = variants.time(name)
            seconds[name].append(wall)
            cpu_seconds[name].append(cpu)
        _log(
            f"round {round_index + 1}/{args.repeats} (wall / CPU): "
            + ", ".join(f"{n} {seconds[n][-1]:.3f}s / {cpu_seconds[n][-1]:.3f}s" for n in variants.names)
        )
    best = {name: min(values) for name, values in seconds.items()}
    best_cpu = {name: min(values) for name, values in cpu_seconds.items()}
    ours = min(best[name] for name in variants.names[1:])
    ours_cpu = min(best_cpu[name] for name in variants.names[1:])
    # on a shared CPU the process's CPU time is the steadier measure (while its clock saw every variant run); on an
    # accelerator only wall time means anything
    by_cpu = variants.device.type == "cpu" and min(best_cpu.values()) > 0
    speedup = best_cpu["hf"] / ours_cpu if by_cpu else best["hf"] / ours

    _log("sharding the experts on 4 gloo ranks (EP 2 and EP 4)")
    preload_for_ranks(*RANK_MODULES)
    per_rank = run_distributed(_sharded_bytes_ratio, 4, args, timeout=600)
    bytes_ratio = {key: max(ratios[key] for ratios in per_rank) for key in ("ep2", "ep4")}

    result = {
        "experts": args.experts,
        "top_k": args.top_k,
        "tokens": args.tokens,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "dtype": args.dtype,
        "device": args.device,
        "threads": torch.get_num_threads(),
        **{f"{name}_s": round(value, 4) for name, value in best.items()},
        **{f"{name}_median_s": round(statistics.median(seconds[name]), 4) for name in variants.names},
        **(
            {f"{name}_cpu_s": round(value, 4) for name, value in best_cpu.items()}
            if variants.device.type == "cpu"
            else {}
        ),
        "speedup_vs_hf": round(speedup, 3),
        "speedup_vs_hf_wall": round(best["hf"] / ours, 3),
        "max_relative_diff_vs_hf": errors,
        "expert_param_bytes_per_rank_ratio": bytes_ratio,
        "gpu_command": GPU_COMMAND,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
