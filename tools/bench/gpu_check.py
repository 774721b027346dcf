"""The GPU check: what a lent CUDA device must show, in one command of at most 8 minutes, one JSON line last.

    uv run python tools/bench/gpu_check.py                  # one CUDA device, ~5-8 min; --budget-s 450 by default
    uv run python tools/bench/gpu_check.py --cpu            # the same code paths at tiny sizes on the CPU (~1 min)

On a lent machine that reaches no package index (its own python3 with torch and transformers, no uv cache),
build and fetch the wheels here, carry them, install them there (docs/benchmarks.md, "GPU", has the commands):
the six workspace packages (`uv build --wheel --all-packages`: installed, not on PYTHONPATH, since the model
families are found through their entry points) and the data path's `datasets`, `dill` and `multiprocess`.

Every run goes through the trainer itself (`mmfsdp.train.trainer.Trainer` in this process, on a one-rank process
group with the device's backend: NCCL on CUDA, gloo on the CPU, as `mmfsdp.parallel.init_process_group` picks it)
and reads its own metrics (`Trainer.history`, `<output_dir>/metrics.jsonl`: step time, tokens/s, TFLOP/s, MFU,
peak memory; every step logs, so every step is timed with the device synchronised). Sections, in the order they run:

- `attention`: the backend `resolve_attention_backend` picks for `model.attn_implementation: sdpa`, and which torch
  SDPA kernel really ran: one training step of the qwen3vl-tiny example under `torch.profiler` (the `aten::_scaled_
  dot_product_*` ops and, on CUDA, the attention kernels' names), padding-free (the packed varlen path, the
  default) and padded; then one step with SDPA restricted to the flash kernel (`torch.nn.attention.sdpa_kernel`)
  to say whether the fast kernel can run every attention call of a step. In the device's training dtype (bf16 on
  CUDA: flash needs 16-bit inputs; fp32 on the CPU). Also whether `attn_implementation: flash_attention_2` (the
  flash-attn package) is available there, and if not why.
- `moe_experts`: one MoE layer's experts (`mmfsdp.parallel.expert_parallel.experts_forward`, EP 1) forward +
  backward on the same routed tokens: the path `auto` takes (grouped GEMM or the loop fallback), the grouped and
  loop times (median of repeats after a warm-up) and their outputs and gradients compared.
- `bf16_parity`: the three tiny examples (tiny Mistral3, qwen3vl-tiny, qwen3vl-moe-tiny at EP 1) trained in fp32
  and with bf16 compute (`parallel.fsdp_plan.param_dtype: bf16`, fp32 master weights and gradient reduction: the
  recipes' mixed precision) on the same device, data and seed. Tolerance: every step's loss within a relative
  `BF16_RTOL` = 2e-2 of fp32's. Why: bf16 keeps 8 mantissa bits (a relative rounding of 2^-9 ≈ 2e-3 per value);
  a loss is a mean over hundreds of tokens, so its own rounding is smaller, but the weights of the two runs drift
  apart step by step (bf16 activations and gradients, an fp32 AdamW update), so the gap grows with the steps;
  on the CPU the GPU run's 20 steps of 8 rows (`--cpu --gpu-sizes`) measured at most 3.6e-3 (tiny Mistral3; 1.2e-3
  qwen3vl-tiny, 3.0e-3 MoE; 2026-12-05), so 2e-2 leaves room for a GPU's other kernels, while a real bug (a wrong
  cast, a lost scale, a dropped mask) moves the loss by far more. Each example's losses of both runs are in the
  JSON, so a larger drift shows where it starts.
- `large_model`: a random-init Qwen3-VL of ~1.6 B parameters (text: hidden 2048, 20 layers, MLP 6144, 16 heads /
  8 KV heads of 128, vocabulary 151,936, untied; the qwen3vl-tiny vision tower projecting to 2048; its
  `config.json` from transformers' `Qwen3VLConfig`, the qwen3vl-tiny tokenizer and processor beside it) trained
  with bf16 compute, chunk loss (`features.enable_chunk_loss`) and recompute (`parallel.recompute`) on text rows of
  exactly 4,096 and 8,192 tokens (one per micro-batch: long answers cut at `cutoff_len`), through the trainer's data
  path. Reports the trainer's own tokens/s, TFLOP/s, MFU (and HFU) and peak memory, medians over the steps after
  the warm-up.
- `memory_plan`: for each `large_model` run, the measured peak (`torch.cuda.max_memory_allocated` of a step, the
  trainer's `peak_mem_gb`; on the CPU `TensorMemory`, as `tests/test_e2e_memory_measured.py`) over the estimate of
  `mmfsdp.train.memory.memory_plan` (the function `apps/train --check` prints) for the same config and 1 rank.
- `compile`: the qwen3vl-tiny example eager vs `features.compile: true` (inductor: triton kernels on CUDA; on the
  CPU `aot_eager` by default, `--compile-backend` to change): per-step losses within the section's tolerance
  (`BF16_RTOL` on CUDA, where it runs in bf16; 1e-4 in fp32 on the CPU) and the ratio of the median step times
  after the warm-up (eager / compiled: above 1 is a speed-up; the first compiled steps are the warm-up), and the
  graphs dynamo compiled (`graphs_compiled`: a handful; many more would be recompilation for new lengths).

- `gated_deltanet`: fla's Gated DeltaNet kernel (`model.gdn_kernel: fla`) against our torch operator
  (`chunk_gated_delta_rule_packed`) on one packed row of 16,384 tokens in 8 samples, forward + backward: outputs
  and input gradients compared (`GDN_FLA_RTOL`) and the median times; once with all heads (packed) and once with
  half of them, what a Ulysses-2 rank runs after its all-to-all (the ring runs the torch operator). Then the host
  round trips of one packed training micro-batch of each tiny family on the device
  (`mmfsdp.model.host_sync_probe.probe_training_step`, device tensors only: 0 in the layers). Where fla cannot run
  (the CPU, fla not installed) the section is skipped with the reason.

Each section is guarded: an exception becomes `{"status": "error", "error": "..."}` in its entry and the next
section runs. Once `--budget-s` seconds are spent the remaining sections are `{"status": "skipped", "reason":
...}`. Progress goes to stderr (the trainer's log too, at WARNING unless `--verbose`); the last line on stdout is
one JSON object: `mode`, `device`, versions, `elapsed_s`, and one key per section with its `status`, `seconds`
and numbers. Paste it into docs/benchmarks.md ("GPU").

`--cpu` runs every section on the CPU at tiny sizes (MMFSDP_DEVICE=cpu): the large model shrinks to ~5 M
parameters (hidden 256, 4 layers, vocabulary 4096) at 256 and 512 tokens, the MoE layer to 16 experts, 3-6 steps
of 2 rows in fp32; it checks the code paths, not the numbers (CI runs it: tests/test_tools_gpu_check.py).
`--cpu --gpu-sizes` keeps those two small but runs everything else as on the GPU (20 steps of 8 rows, bf16
compute): the GPU run's configurations, checked without a GPU in 5-10 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "tiny_mistral3": ROOT / "examples" / "tiny",
    "qwen3vl_tiny": ROOT / "examples" / "qwen3vl-tiny",
    "qwen3vl_moe_tiny": ROOT / "examples" / "qwen3vl-moe-tiny",
}
SECTIONS = ("attention", "moe_experts", "bf16_parity", "large_model", "memory_plan", "compile", "gated_deltanet")
BF16_RTOL = 2e-2
"""Relative per-step loss tolerance of a bf16-compute run against fp32 (module docstring)."""
FP32_COMPILE_RTOL = 1e-4
"""Compiled vs eager in fp32 (the CPU mode): the same maths in another order."""
MOE_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
GDN_FLA_RTOL = 1e-2
"""fla's Triton kernel against our torch operator, fp32 inputs: its dots may run in TF32 (10 mantissa bits)."""
GPU_RESERVE_S = {"large_model": 100.0, "large_model_run": 80.0, "compile": 120.0}
"""Seconds a part needs at least on a GPU (a 1.6 B model's CPU init and transfer; inductor's first compile): it
is skipped rather than started when less of the budget is left, so the whole run stays within about 8 minutes."""


def _log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _error_text(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"


def _rel(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def _tidy(value: Any) -> Any:
    """Floats to 5 significant digits for the JSON line (the numbers vary more than that between runs)."""
    if isinstance(value, float):
        return float(f"{value:.5g}")
    if isinstance(value, dict):
        return {key: _tidy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_tidy(item) for item in value]
    return value


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class Sizes:
    """What one mode runs: the GPU sizes, or the CPU's tiny ones (`--gpu-sizes` on the CPU: the GPU's steps,
    micro-batches and bf16 with the large model and the MoE layer still at the CPU's sizes)."""

    def __init__(self, cpu: bool, args: argparse.Namespace):
        self.cpu = cpu
        small = cpu and not args.gpu_sizes
        self.parity_steps = args.steps or (3 if small else 20)
        self.micro_batch = 2 if small else 8
        self.compile_steps = args.steps or (4 if small else 20)
        self.compile_warmup = 2 if small else 5
        self.compile_backend = args.compile_backend or ("aot_eager" if cpu else "inductor")
        self.compute_dtype = "fp32" if small else "bf16"
        self.num_train = self.micro_batch * max(self.parity_steps, self.compile_warmup + self.compile_steps, 2)
        """Rows of every example's synthetic data: one set per example serves every section (data generated with
        other settings is an error, never reused)."""
        self.large_seq = (256, 512) if cpu else (4096, 8192)
        self.large_warmup, self.large_steps = (2, 2) if cpu else (2, 4)
        self.large_text = (
            dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, mrope=[16, 8, 8])
            if cpu else
            dict(hidden_size=2048, num_hidden_layers=20, intermediate_size=6144, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, mrope=[24, 20, 20])
        )
        self.chunk_size = 128 if cpu else 1024
        self.moe = (dict(experts=16, top_k=2, tokens=1024, hidden=128, intermediate=64, repeats=3)
                    if cpu else dict(experts=128, top_k=8, tokens=16384, hidden=2048, intermediate=768, repeats=10))
        self.moe["dtype"] = self.compute_dtype
        self.gdn = dict(tokens=16384, samples=8, key_heads=16, value_heads=32, head_dim=128, repeats=5)


# ---------------------------------------------------------------------------------------------- trainer runs


class Runs:
    """Trainer runs of one process: configs from the examples with overrides, data prepared once per example."""

    def __init__(self, work: Path, device_type: str, num_train: int):
        self.work = work
        self.device_type = device_type
        self.num_train = num_train

    def overrides(self, example: str, name: str, *, steps: int, micro_batch: int,
                  extra: dict | None = None) -> list[str]:
        assets = EXAMPLES[example] / "assets"
        items = {
            "model.model_name_or_path": assets,
            "data.dataset_param.preprocess_parameters.model_name_or_path": assets,
            "data.dataset_param.basic_parameters.dataset_dir": self.work / "data" / example,
            "data.dataset_param.basic_parameters.cache_dir": self.work / "cache" / example,
            "data.dataset_param.synthetic.num_train": self.num_train,
            "data.dataset_param.synthetic.num_eval": 4,
            "training.micro_batch_size": micro_batch,
            "training.train_iters": steps,
            "training.lr_warmup_ratio": 0.0,
            "training.log_interval": 1,
            "training.output_dir": self.work / "out" / f"{example}_{name}",
            "parallel.expert_parallel_size": 1,
            **(extra or {}),
        }
        if example != "qwen3vl_moe_tiny":
            items.pop("parallel.expert_parallel_size")
        return [f"{key}={value}" for key, value in items.items()]

    def config(self, example: str, overrides: list[str]):
        from mmfsdp.data import prepare_dataset
        from mmfsdp.train.config import load_config

        cfg = load_config(EXAMPLES[example] / "config.yaml", overrides)
        prepare_dataset(cfg.data)
        return cfg

    def train(self, cfg, *, around_step: Callable | None = None, memory: bool = False) -> dict[str, Any]:
        """Build a trainer for `cfg`, train it to the end; its steps (loss, grad norm, tokens) and metrics records.

        `around_step(trainer)`: a context manager factory entered around each `train_step` (profiling, kernel
        restrictions). `memory`: on the CPU, count live tensors with `TensorMemory` (the device's peak elsewhere)."""
        import torch

        from mmfsdp.train.trainer import Trainer

        torch._dynamo.reset()
        trainer = Trainer(cfg, self.device_type)
        try:
            if around_step is not None:
                step = trainer.train_step

                def wrapped():
                    with around_step(trainer):
                        return step()

                trainer.train_step = wrapped
            tensor_peak = None
            if memory and self.device_type == "cpu":
                from mmfsdp.parallel.tensor_memory import TensorMemory, state_tensors

                with TensorMemory("cpu") as counter:
                    counter.hold(state_tensors(trainer.model, trainer.optimizer))
                    trainer.train()
                tensor_peak = counter.peak
            else:
                trainer.train()
            trainer.close()
            records = [json.loads(line) for line in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
            return {
                "losses": [r.loss for r in trainer.history],
                "grad_norms": [r.grad_norm for r in trainer.history],
                "tokens": [r.num_tokens for r in trainer.history],
                "records": records,
                "tensor_peak_bytes": tensor_peak,
                "num_params": sum(p.numel() for p in trainer.model.parameters()),
            }
        finally:
            del trainer
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _compare_losses(losses: list[float], reference: list[float], rtol: float) -> dict[str, Any]:
    rel = [_rel(a, b) for a, b in zip(losses, reference)]
    worst = max(range(len(rel)), key=rel.__getitem__) if rel else None
    return {
        "steps": len(rel),
        "max_rel_diff": max(rel) if rel else None,
        "worst_step": None if worst is None else worst + 1,
        "rtol": rtol,
        "within_tolerance": bool(rel) and len(losses) == len(reference) and max(rel) <= rtol,
    }


# ---------------------------------------------------------------------------------------------- sections


_SDPA_OPS = ("aten::_scaled_dot_product", "aten::_efficient_attention", "aten::_flash_attention",
             "aten::_cudnn_attention")
_KERNEL_MARKS = ("flash", "fmha", "attention", "attn", "sdpa")
_KERNEL_KINDS = (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "mem_efficient"), ("math", "math"))


def _sdpa_profiler(ctx: "Context", seen: dict[str, dict[str, int]], *, device_kernels: bool) -> Callable:
    """A context manager factory for `Runs.train(around_step=...)`: profiles the second step (the first one
    warms up) and counts into `seen` the SDPA aten ops (`sdpa_ops`, they name the kernel torch chose) and the
    other profiler events whose names look like attention (`attention_events`: the device kernels with
    `device_kernels` on CUDA; autograd nodes on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device_kernels and ctx.device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    seen.setdefault("sdpa_ops", {})
    seen.setdefault("attention_events", {})

    @contextlib.contextmanager
    def profiled():
        with profile(activities=activities) as prof:
            yield
        for event in prof.key_averages():
            name = event.key
            if name.startswith(_SDPA_OPS):
                seen["sdpa_ops"][name] = seen["sdpa_ops"].get(name, 0) + event.count
            elif not name.startswith("aten::") and any(mark in name.lower() for mark in _KERNEL_MARKS):
                seen["attention_events"][name[:120]] = seen["attention_events"].get(name[:120], 0) + event.count

    return lambda trainer: profiled() if trainer.step == 1 else contextlib.nullcontext()


def _kernels_used(ops: dict[str, int]) -> list[str]:
    """The SDPA kernels the aten ops name (`flash`, `mem_efficient`, `cudnn`, `math`)."""
    names = " ".join(ops)
    return [kind for mark, kind in _KERNEL_KINDS if mark in names] or ["none seen"]


def section_attention(ctx: "Context") -> dict[str, Any]:
    import torch

    from mmfsdp.model.attention import resolve_attention_backend

    backend = resolve_attention_backend("sdpa", ctx.device_type)
    out: dict[str, Any] = {"attn_implementation": "sdpa", "hf_attention_function": backend.hf_name,
                           "dtype": ctx.sizes.compute_dtype}
    dtype = {"parallel.fsdp_plan.param_dtype": ctx.sizes.compute_dtype}
    for layout, padding_free in (("packed_varlen", "true"), ("padded", "false")):
        seen: dict[str, dict[str, int]] = {}
        cfg = ctx.runs.config("qwen3vl_tiny", ctx.runs.overrides(
            "qwen3vl_tiny", f"attention_{layout}", steps=2, micro_batch=ctx.sizes.micro_batch,
            extra={**dtype, "data.dataloader_param.padding_free": padding_free}))
        ctx.runs.train(cfg, around_step=_sdpa_profiler(ctx, seen, device_kernels=True))
        out[layout] = {**seen, "kernels_used": _kernels_used(seen["sdpa_ops"])}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        cfg = ctx.runs.config("qwen3vl_tiny", ctx.runs.overrides(
            "qwen3vl_tiny", "attention_flash_only", steps=1, micro_batch=ctx.sizes.micro_batch, extra=dtype))
        ctx.runs.train(cfg, around_step=lambda trainer: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
        flash_only: dict[str, Any] = {
            "status": "ok", "note": "every SDPA call of a packed training step ran with only the flash kernel"}
    except Exception as err:  # a restriction some call cannot meet raises "No available kernel"
        flash_only = {"status": "error", "error": _error_text(err)}
    out["flash_only_step"] = flash_only
    out["torch_flash_sdp_enabled"] = bool(torch.backends.cuda.flash_sdp_enabled())
    try:  # the other fast path: `attn_implementation: flash_attention_2` (the flash-attn package), not run here
        out["flash_attention_2"] = {"available": True,
                                    "hf_attention_function": resolve_attention_backend("flash_attention_2",
                                                                                       ctx.device_type).hf_name}
    except Exception as err:
        out["flash_attention_2"] = {"available": False, "reason": _error_text(err)}
    return out


def section_moe_experts(ctx: "Context") -> dict[str, Any]:
    import torch
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextConfig,
        Qwen3VLMoeTextSparseMoeBlock,
    )

    from mmfsdp.parallel.dtypes import DTYPES
    from mmfsdp.parallel.expert_parallel import _grouped_mm_fits, experts_forward, grouped_mm_supported

    m = ctx.sizes.moe
    device, dtype = ctx.device, DTYPES[m["dtype"]]
    torch.manual_seed(0)
    block = Qwen3VLMoeTextSparseMoeBlock(Qwen3VLMoeTextConfig(
        hidden_size=m["hidden"], moe_intermediate_size=m["intermediate"], num_experts=m["experts"],
        num_experts_per_tok=m["top_k"], experts_implementation="eager"))
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.02)
    block = block.to(device, dtype)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(m["tokens"], m["hidden"], generator=generator).to(device, dtype)
    cotangent = torch.randn(m["tokens"], m["hidden"], generator=generator).to(device, dtype)
    with torch.no_grad():
        _, weight, idx = block.gate(hidden)
    experts = block.experts
    supported = grouped_mm_supported(device, dtype)
    fits = _grouped_mm_fits(hidden, experts.gate_up_proj, experts.down_proj)
    out: dict[str, Any] = {
        **m, "grouped_mm_supported": supported, "grouped_mm_fits": fits,
        "auto_path": "grouped" if supported and fits else "loop",
    }

    def step(implementation: str):
        x = hidden.detach().requires_grad_()
        experts.zero_grad(set_to_none=True)
        y = experts_forward(experts, x, idx, weight, implementation=implementation)
        y.backward(cotangent)
        return y.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad

    names = ["loop"] + (["grouped"] if supported else [])
    results = {name: step(name) for name in names}  # warm-up, and the values compared
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(m["repeats"]):
        for name in names:
            ctx.synchronize()
            started = time.perf_counter()
            step(name)
            ctx.synchronize()
            times[name].append(time.perf_counter() - started)
    out["ms"] = {name: round(1000 * statistics.median(t), 3) for name, t in times.items()}
    if supported:
        rtol = MOE_RTOL[m["dtype"]]
        diffs = [((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
                 for a, b in zip(results["grouped"], results["loop"])]
        out["max_rel_diff"] = dict(zip(("output", "grad_input", "grad_gate_up", "grad_down"), diffs))
        out["rtol"] = rtol
        out["equal_within_tolerance"] = max(diffs) <= rtol
        out["loop_over_grouped_time"] = round(out["ms"]["loop"] / out["ms"]["grouped"], 3)
    else:
        out["note"] = "grouped GEMM not available for this device and dtype: the loop fallback runs"
    return out


class SectionSkipped(Exception):
    """A section that cannot run here: recorded as `{"status": "skipped", "reason": ...}`."""


def section_gated_deltanet(ctx: "Context") -> dict[str, Any]:
    import torch

    from mmfsdp.model.gated_deltanet import (
        SegmentPlan,
        _fla_chunk,
        _fla_gated_delta_rule,
        chunk_gated_delta_rule_packed,
        resolve_gdn_kernel,
    )
    from mmfsdp.model.host_sync_probe import probe_training_step

    runs, why = resolve_gdn_kernel("fla", ctx.device.type)
    if runs != "fla" or _fla_chunk() is None:
        raise SectionSkipped(f"fla's Gated DeltaNet kernel cannot run here: {why}")
    g = ctx.sizes.gdn
    out: dict[str, Any] = {**g}
    generator = torch.Generator().manual_seed(0)
    layouts = {"packed": g["value_heads"], "ulysses2_local_heads": g["value_heads"] // 2}
    for name, value_heads in layouts.items():
        key_heads = value_heads * g["key_heads"] // g["value_heads"]
        T, d = g["tokens"], g["head_dim"]
        length = T // g["samples"]
        plan = SegmentPlan([i * length for i in range(g["samples"])], [length] * g["samples"], 1, ctx.device)
        inputs = [
            torch.randn(T, key_heads, d, generator=generator), torch.randn(T, key_heads, d, generator=generator),
            torch.randn(T, value_heads, d, generator=generator), -torch.rand(T, value_heads, generator=generator) * 0.5,
            torch.rand(T, value_heads, generator=generator),
        ]
        inputs = [x.to(ctx.device).requires_grad_() for x in inputs]
        cotangent = torch.randn(T, value_heads, d, generator=generator).to(ctx.device)

        def step(kernel: str):
            for x in inputs:
                x.grad = None
            if kernel == "fla":
                y, _ = _fla_gated_delta_rule(*inputs, plan.cu_seqlens, None)
            else:
                y, _ = chunk_gated_delta_rule_packed(*inputs, plan.starts, plan.lens, plan=plan)
            (y * cotangent).sum().backward()
            return [y.detach(), *(x.grad for x in inputs)]

        results = {kernel: step(kernel) for kernel in ("fla", "torch")}
        diffs = [((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()
                 for a, b in zip(results["fla"], results["torch"])]
        times: dict[str, list[float]] = {"fla": [], "torch": []}
        for _ in range(g["repeats"]):
            for kernel in times:
                ctx.synchronize()
                started = time.perf_counter()
                step(kernel)
                ctx.synchronize()
                times[kernel].append(time.perf_counter() - started)
        ms = {kernel: round(1000 * statistics.median(t), 3) for kernel, t in times.items()}
        out[name] = {
            "value_heads": value_heads, "ms": ms, "torch_over_fla_time": round(ms["torch"] / ms["fla"], 3),
            "max_rel_diff": dict(zip(("output", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta"), diffs)),
            "within_tolerance": max(diffs) <= GDN_FLA_RTOL,
        }
    out["ring"] = "the ring chains each chunk's state transition through the torch operator: fla does not run there"
    counts = {}
    for model_id in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):
        counter = probe_training_step(model_id, device=ctx.device, device_only=True)
        counts[model_id] = {"total": counter.total, "in_layers": sum(counter.in_layers.values()),
                            "report": counter.report()}
    out["host_syncs_device"] = counts
    return out


def section_bf16_parity(ctx: "Context") -> dict[str, Any]:
    steps, mbs = ctx.sizes.parity_steps, ctx.sizes.micro_batch
    out: dict[str, Any] = {"rtol": BF16_RTOL, "steps": steps, "micro_batch_size": mbs,
                           "bf16": "parallel.fsdp_plan.param_dtype: bf16 (fp32 master weights, fp32 reduce)"}
    for example in EXAMPLES:
        if ctx.out_of_budget():
            out[example] = {"status": "skipped", "reason": ctx.budget_reason()}
            continue
        try:
            losses = {}
            for dtype in ("fp32", "bf16"):
                _log(f"bf16_parity: {example} {dtype}")
                cfg = ctx.runs.config(example, ctx.runs.overrides(
                    example, f"parity_{dtype}", steps=steps, micro_batch=mbs,
                    extra={"parallel.fsdp_plan.param_dtype": dtype}))
                losses[dtype] = ctx.runs.train(cfg)["losses"]
            out[example] = {**_compare_losses(losses["bf16"], losses["fp32"], BF16_RTOL),
                            "loss_fp32": [round(v, 5) for v in losses["fp32"]],
                            "loss_bf16": [round(v, 5) for v in losses["bf16"]]}
        except Exception as err:
            _log(traceback.format_exc())
            out[example] = {"status": "error", "error": _error_text(err)}
    out["all_within_tolerance"] = all(v.get("within_tolerance") for k, v in out.items() if k in EXAMPLES)
    return out


def _large_assets(ctx: "Context") -> Path:
    """A random-init Qwen3-VL's model directory: `config.json` from `Qwen3VLConfig` with the large text sizes, the
    qwen3vl-tiny tokenizer and processor (their ids are all below any vocabulary size used here)."""
    from transformers import Qwen3VLConfig

    path = ctx.work / "large_assets"
    if path.exists():
        return path
    tiny = EXAMPLES["qwen3vl_tiny"] / "assets"
    shutil.copytree(tiny, path)
    config = Qwen3VLConfig.from_pretrained(tiny)
    sizes = dict(ctx.sizes.large_text)
    mrope = sizes.pop("mrope")
    for key, value in sizes.items():
        setattr(config.text_config, key, value)
    config.text_config.max_position_embeddings = 4 * max(ctx.sizes.large_seq)
    config.text_config.rope_parameters["mrope_section"] = mrope
    config.vision_config.out_hidden_size = sizes["hidden_size"]
    config.save_pretrained(path)
    return path


def _long_rows(path: Path, rows: int, words: int) -> Path:
    """Text-only rows whose answers outgrow `cutoff_len`: each sample is cut to exactly `cutoff_len` tokens."""
    from mmfsdp.data.synthetic import COLOURS, SHAPES

    vocabulary = ["a", "and", *COLOURS, *SHAPES]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(rows):
            answer = " ".join(vocabulary[(i * 7 + j * 13 + j // 5) % len(vocabulary)] for j in range(words))
            fh.write(json.dumps({"messages": [{"role": "user", "content": "Describe a long scene."},
                                              {"role": "assistant", "content": answer}], "images": []}) + "\n")
    return path


def section_large_model(ctx: "Context") -> dict[str, Any]:
    from mmfsdp.data import prepare_dataset
    from mmfsdp.train.config import load_config
    from mmfsdp.train.memory import memory_plan

    assets = _large_assets(ctx)
    s = ctx.sizes
    out: dict[str, Any] = {"text_config": {k: v for k, v in s.large_text.items()}, "compute_dtype": s.compute_dtype,
                           "features": "enable_chunk_loss, recompute, padding-free, fsdp param_dtype "
                                       f"{s.compute_dtype}, 1 sample of seq tokens per micro-batch"}
    steps = s.large_warmup + s.large_steps
    for seq in s.large_seq:
        key = f"seq_{seq}"
        if ctx.out_of_budget(reserve_s=ctx.reserve_s("large_model_run")):
            out[key] = {"status": "skipped", "reason": ctx.budget_reason(ctx.reserve_s("large_model_run"))}
            continue
        _log(f"large_model: {seq} tokens per sample")
        try:
            data = _long_rows(ctx.work / f"large_data_{seq}" / "train.jsonl", rows=steps + 2, words=seq)
            items = {
                "model.model_id": "qwen3_vl", "model.model_name_or_path": assets, "model.random_init": "true",
                "data.dataset_param.dataset_type": "huggingface",
                "data.dataset_param.preprocess_parameters.model_name_or_path": assets,
                "data.dataset_param.preprocess_parameters.cutoff_len": seq,
                "data.dataset_param.basic_parameters.dataset": data,
                "data.dataset_param.basic_parameters.dataset_dir": data.parent,
                "data.dataset_param.basic_parameters.cache_dir": ctx.work / f"large_cache_{seq}",
                "parallel.fsdp_plan.param_dtype": s.compute_dtype, "parallel.recompute": "true",
                "features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": s.chunk_size,
                "training.micro_batch_size": 1, "training.train_iters": steps, "training.log_interval": 1,
                "training.lr": 1.0e-4, "training.lr_warmup_ratio": 0.0,
                "training.output_dir": ctx.work / "out" / f"large_{seq}",
            }
            cfg = load_config(EXAMPLES["qwen3vl_tiny"] / "config.yaml", [f"{k}={v}" for k, v in items.items()])
            prepare_dataset(cfg.data)
            plan = memory_plan(cfg, 1, image_token_share=0.0)
            seen: dict[str, dict[str, int]] = {}
            started = time.perf_counter()
            run = ctx.runs.train(cfg, memory=True, around_step=_sdpa_profiler(ctx, seen, device_kernels=False))
            wall = time.perf_counter() - started
            measured = run["records"][s.large_warmup:]

            def med(name):
                return _median([r[name] for r in measured if name in r])

            result = {
                "params_b": round(run["num_params"] / 1e9, 4), "steps_measured": len(measured),
                "tokens_per_step": med("num_tokens"), "tokens_per_s": med("tokens_per_s"),
                "step_time_s": med("step_time_s"), "tflops": med("tflops"), "mfu": med("mfu"), "hfu": med("hfu"),
                "peak_mem_gb": max(r["peak_mem_gb"] for r in run["records"]),
                "losses": [round(v, 4) for v in run["losses"]],
                "sdpa_kernels_used": _kernels_used(seen["sdpa_ops"]),
                "build_and_warmup_s": round(wall - sum(r["step_time_s"] for r in measured), 1),
            }
            out[key] = result
            peak = (run["tensor_peak_bytes"] / 2**30 if run["tensor_peak_bytes"] is not None
                    else result["peak_mem_gb"])
            ctx.memory[key] = {
                "plan_gib": round(plan.total / 2**30, 4),
                "plan_parts_gib": {part: round(getattr(plan, part) / 2**30, 4) for part in (
                    "parameters", "gradients", "optimizer_states", "compute_copies", "activations")},
                "measured_peak_gib": round(peak, 4),
                "measured_by": "TensorMemory (live tensors)" if run["tensor_peak_bytes"] is not None
                else "max_memory_allocated of a step (the trainer's peak_mem_gb)",
                "measured_over_plan": round(peak / (plan.total / 2**30), 3),
            }
        except Exception as err:
            _log(traceback.format_exc())
            out[key] = {"status": "error", "error": _error_text(err)}
            ctx.memory[key] = {"status": "error", "error": f"large_model {key} failed: {_error_text(err)}"}
    return out


def section_memory_plan(ctx: "Context") -> dict[str, Any]:
    if not ctx.memory:
        raise RuntimeError("no large_model run to compare with (that section failed or was skipped)")
    return {"function": "mmfsdp.train.memory.memory_plan(cfg, 1, image_token_share=0.0)",
            "target": "measured_over_plan within [0.75, 1.25] (tests/test_e2e_memory_measured.py's 25 %)",
            **ctx.memory}


def section_compile(ctx: "Context") -> dict[str, Any]:
    from torch._dynamo.utils import counters

    s = ctx.sizes
    steps = s.compile_warmup + s.compile_steps
    dtype = s.compute_dtype
    rtol = BF16_RTOL if dtype == "bf16" else FP32_COMPILE_RTOL
    runs = {}
    for name, extra in (("eager", {}), ("compiled", {"features.compile": "true",
                                                      "features.compile_plan.backend": s.compile_backend})):
        _log(f"compile: {name} ({s.compile_backend if name == 'compiled' else 'eager'})")
        cfg = ctx.runs.config("qwen3vl_tiny", ctx.runs.overrides(
            "qwen3vl_tiny", f"compile_{name}", steps=steps, micro_batch=s.micro_batch,
            extra={"parallel.fsdp_plan.param_dtype": dtype, **extra}))
        counters.clear()
        started = time.perf_counter()
        runs[name] = ctx.runs.train(cfg)
        runs[name]["wall_s"] = time.perf_counter() - started
        runs[name]["graphs"] = int(counters["stats"]["unique_graphs"])
    times = {name: [r["step_time_s"] for r in run["records"][s.compile_warmup:]] for name, run in runs.items()}
    eager_ms, compiled_ms = (1000 * statistics.median(times[n]) for n in ("eager", "compiled"))
    return {
        "backend": s.compile_backend, "dtype": dtype, "steps": steps, "warmup": s.compile_warmup,
        **_compare_losses(runs["compiled"]["losses"], runs["eager"]["losses"], rtol),
        "eager_step_ms": round(eager_ms, 3), "compiled_step_ms": round(compiled_ms, 3),
        "speedup": round(eager_ms / compiled_ms, 3),
        "first_compiled_step_s": round(runs["compiled"]["records"][0]["step_time_s"], 2),
        "graphs_compiled": runs["compiled"]["graphs"],  # a few: more would mean recompiling for new lengths
        "wall_s": {name: round(run["wall_s"], 1) for name, run in runs.items()},
    }


# ---------------------------------------------------------------------------------------------- driver


class Context:
    def __init__(self, args: argparse.Namespace, sizes: Sizes, device_type: str, work: Path):
        import torch

        self.args = args
        self.sizes = sizes
        self.device_type = device_type
        cuda = device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.work = work
        self.runs = Runs(work, device_type, sizes.num_train)
        self.started = time.perf_counter()
        self.memory: dict[str, Any] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def out_of_budget(self, reserve_s: float = 0.0) -> bool:
        """Whether the budget is spent, or would be by a part that needs `reserve_s` seconds."""
        return self.elapsed() + reserve_s >= self.args.budget_s

    def reserve_s(self, part: str) -> float:
        """Seconds `part` takes at least on a GPU (nothing is reserved on the CPU, where everything is small)."""
        return 0.0 if self.sizes.cpu else GPU_RESERVE_S.get(part, 0.0)

    def budget_reason(self, reserve_s: float = 0.0) -> str:
        needs = f"; this part needs about {reserve_s:.0f} s" if reserve_s else ""
        return f"the budget of {self.args.budget_s:.0f} s is spent ({self.elapsed():.0f} s elapsed{needs})"

    def synchronize(self) -> None:
        from mmfsdp.parallel import synchronize

        synchronize(self.device)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run every section on the CPU at tiny sizes")
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip the remaining sections after this")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--steps", type=int, default=0, help="steps of the parity and compile runs (0: the mode's)")
    parser.add_argument("--compile-backend", default="", help="torch.compile backend (default: inductor on CUDA, "
                        "aot_eager on the CPU)")
    parser.add_argument("--gpu-sizes", action="store_true", help="with --cpu: the GPU run's steps, micro-batches "
                        "and bf16 on the CPU (the large model and MoE layer at CPU sizes; ~5-10 min on 2 cores)")
    parser.add_argument("--work-dir", default="", help="where data and outputs go (default: a temporary directory)")
    parser.add_argument("--verbose", action="store_true", help="the trainer's INFO log on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    wanted = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    if args.cpu:
        os.environ["MMFSDP_DEVICE"] = "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    import torch
    import transformers

    from mmfsdp.config import get_logger
    from mmfsdp.parallel import detect_device_type, init_process_group

    for handler in get_logger().handlers:  # the trainer's log goes to stderr: stdout ends with the JSON line
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stderr)
    get_logger().setLevel(logging.INFO if args.verbose else logging.WARNING)
    device_type = detect_device_type()
    result: dict[str, Any] = {"mode": ("cpu_gpu_sizes" if args.gpu_sizes else "cpu") if args.cpu else "gpu",
                              "device_type": device_type}
    if device_type not in ("cuda", "cpu"):
        raise SystemExit(f"gpu_check runs on CUDA or the CPU, not {device_type}")
    cpu = device_type == "cpu"
    if cpu and not args.cpu:
        result["note"] = "no CUDA device: ran the --cpu sizes"
        result["mode"] = "cpu"
    result.update(
        device=torch.cuda.get_device_name() if not cpu else "cpu",
        torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), budget_s=args.budget_s,
    )
    init_process_group(device_type)
    _log(f"{result['mode']} mode on {result['device']}; process group ready")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, Sizes(cpu, args), device_type, work)
    ctx.started = started
    functions = {name: globals()[f"section_{name}"] for name in SECTIONS}
    try:
        for name in SECTIONS:
            if name not in wanted:
                result[name] = {"status": "skipped", "reason": "not in --sections"}
                continue
            if ctx.out_of_budget(reserve_s=ctx.reserve_s(name)):
                result[name] = {"status": "skipped", "reason": ctx.budget_reason(ctx.reserve_s(name))}
                _log(f"{name}: skipped ({result[name]['reason']})")
                continue
            _log(f"{name}: start ({ctx.elapsed():.0f} s elapsed)")
            section_started = time.perf_counter()
            try:
                result[name] = {"status": "ok", **functions[name](ctx)}
            except SectionSkipped as skip:
                result[name] = {"status": "skipped", "reason": str(skip)}
            except Exception as err:
                _log(traceback.format_exc())
                result[name] = {"status": "error", "error": _error_text(err)}
            result[name]["seconds"] = round(time.perf_counter() - section_started, 1)
            _log(f"{name}: {result[name]['status']} in {result[name]['seconds']} s")
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result = _tidy(result)
    import torch.distributed as dist

    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
