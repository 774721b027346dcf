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
  (the CPU, fla not installed) the section is skipped with the reason (`SectionSkipped`).

Each section is one function, `section_<name>(ctx)`, in its own module of `_gpu_check/` (`SECTIONS` lists them in
order; `_gpu_check/common.py` and `_gpu_check/context.py` hold what they share). Each section is guarded: an
exception becomes `{"status": "error", "error": "..."}` in its entry and the next section runs. Once `--budget-s` seconds are spent the remaining sections are `{"status": "skipped", "reason":
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
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _gpu_check.attention import section_attention
from _gpu_check.bf16_parity import section_bf16_parity
from _gpu_check.common import error_text, log, tidy
from _gpu_check.common import SectionSkipped
from _gpu_check.compile import section_compile
from _gpu_check.gated_deltanet import section_gated_deltanet
from _gpu_check.context import Context, Sizes
from _gpu_check.large_model import section_large_model
from _gpu_check.memory_plan import section_memory_plan
from _gpu_check.moe_experts import section_moe_experts

SECTIONS = {
    "attention": section_attention,
    "moe_experts": section_moe_experts,
    "bf16_parity": section_bf16_parity,
    "large_model": section_large_model,
    "memory_plan": section_memory_plan,
    "compile": section_compile,
    "gated_deltanet": section_gated_deltanet,
}
"""Section name -> its function (`_gpu_check/<name>.py`), in the order they run."""


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
    log(f"{result['mode']} mode on {result['device']}; process group ready")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, Sizes(cpu, args), device_type, work)
    ctx.started = started
    try:
        for name in SECTIONS:
            if name not in wanted:
                result[name] = {"status": "skipped", "reason": "not in --sections"}
                continue
            if ctx.out_of_budget(reserve_s=ctx.reserve_s(name)):
                result[name] = {"status": "skipped", "reason": ctx.budget_reason(ctx.reserve_s(name))}
                log(f"{name}: skipped ({result[name]['reason']})")
                continue
            log(f"{name}: start ({ctx.elapsed():.0f} s elapsed)")
            section_started = time.perf_counter()
            try:
                result[name] = {"status": "ok", **SECTIONS[name](ctx)}
            except SectionSkipped as skip:
                result[name] = {"status": "skipped", "reason": str(skip)}
            except Exception as err:
                log(traceback.format_exc())
                result[name] = {"status": "error", "error": error_text(err)}
            result[name]["seconds"] = round(time.perf_counter() - section_started, 1)
            log(f"{name}: {result[name]['status']} in {result[name]['seconds']} s")
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result = tidy(result)
    import torch.distributed as dist

    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
