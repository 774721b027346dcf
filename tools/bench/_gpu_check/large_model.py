"""The `large_model` section: a ~1.6 B Qwen3-VL trained at 4k and 8k tokens per sample through the trainer; its
runs' measured peaks are what `memory_plan` compares with the plan."""

from __future__ import annotations

import json
import shutil
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .attention import kernels_used, sdpa_profiler
from .common import EXAMPLES, error_text, log, median

if TYPE_CHECKING:
    from .context import Context


def _large_assets(ctx: Context) -> Path:
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


def section_large_model(ctx: Context) -> dict[str, Any]:
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
        log(f"large_model: {seq} tokens per sample")
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
            run = ctx.runs.train(cfg, memory=True, around_step=sdpa_profiler(ctx, seen, device_kernels=False))
            wall = time.perf_counter() - started
            measured = run["records"][s.large_warmup:]

            def med(name):
                return median([r[name] for r in measured if name in r])

            result = {
                "params_b": round(run["num_params"] / 1e9, 4), "steps_measured": len(measured),
                "tokens_per_step": med("num_tokens"), "tokens_per_s": med("tokens_per_s"),
                "step_time_s": med("step_time_s"), "tflops": med("tflops"), "mfu": med("mfu"), "hfu": med("hfu"),
                "peak_mem_gb": max(r["peak_mem_gb"] for r in run["records"]),
                "losses": [round(v, 4) for v in run["losses"]],
                "sdpa_kernels_used": kernels_used(seen["sdpa_ops"]),
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
            log(traceback.format_exc())
            out[key] = {"status": "error", "error": error_text(err)}
            ctx.memory[key] = {"status": "error", "error": f"large_model {key} failed: {error_text(err)}"}
    return out
