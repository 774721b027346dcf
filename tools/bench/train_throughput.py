"""Tokens per second of a whole training run: a hand-written HF + FSDP2 loop against mmfsdp, side by side.

    uv run python tools/bench/train_throughput.py                       # both sizes, a few minutes on 2 CPU cores
    uv run python tools/bench/train_throughput.py --sizes tiny --steps 60 --warmup 10
    uv run python tools/bench/train_throughput.py --best training.micro_batch_size=2   # extra overrides for (c)
    uv run python tools/bench/train_throughput.py --smoke    # the smallest run (CI): tiny, 3 steps, no compile

The same random-init Qwen3-VL, the same data and the same global batch (`--nproc` ranks × `--micro-batch` rows)
run three ways (five with the `*_no_direct` runs), one after the other, each on `--nproc` gloo processes (fp32):

- `plain`: what a user writes by hand (one thread per process, as torchrun sets for the other runs): HF
  `Qwen3VLForConditionalGeneration` (SDPA), `fully_shard` on every decoder layer and the root, AdamW (torch's default,
  foreach), grad-norm clipping at 1.0, a `torch.utils.data.DataLoader` with a `DistributedSampler` whose collate pads
  each micro-batch to its longest row (mmfsdp's tokenised rows, so both see the same tokens), `model(**inputs,
  labels=labels)` — its ranks forked by `torch.multiprocessing.start_processes`;
- `mmfsdp`: the real app (`python apps/train CONFIG --nproc-per-node N`, run by `mmfsdp.train.cli.fork_main`: forked
  from this process, which imported it once) on a config that names only the model and the data: every other key at
  its default;
- `mmfsdp_best`: the same with the settings that make it fastest here (`--best-preset compile`, the default: each
  decoder layer compiled with inductor and `reshard_after_forward: false`; `balance`: each step's samples balanced
  over the ranks under a token budget; `packing`: rows packed to about a padded micro-batch's tokens — on the
  padding-free defaults neither of the last two was faster here; `--best KEY=VALUE` adds overrides);
- `mmfsdp_no_direct`, `mmfsdp_best_no_direct` (`--without-direct`, default both): the same two runs with
  `parallel.fsdp_plan.direct_cpu_comm: false`, i.e. FSDP2's own gloo collectives instead of the direct
  point-to-point exchanges (`mmfsdp.parallel.direct_comm`). That path is on by default but exists only on gloo: no
  GPU or NPU user runs it, so these runs show how much of the gain over the plain loop a GPU user would not see
  (`--smoke` runs `mmfsdp_no_direct` only).

Two sizes: `tiny` (the qwen3vl-tiny example's ~1 M-parameter model on its coloured-shapes rows, 16 × ~26 tokens)
and `large` (the same vision tower, a `--large-hidden` × `--large-layers` decoder: ≥ 50 M parameters, where the
matmuls dominate the step, on variable-length rows of `make_varlen_dataset`: 0–2 images of six sizes, 1–3 turns,
30 % text-only).

Each system runs `--repeats` times (default 3), interleaved with the others (plain, mmfsdp, best, plain, ...), and
each number of a run is the MEDIAN of its repeats, with the slowest and fastest repeat beside it (`tokens_per_s_min`,
`tokens_per_s_max`) and every repeat's numbers under `repeats`: on a shared machine the load changes between runs,
and the median is the number a user can expect rather than the luckiest one.

Each run's step time is taken per step (the loader's `next` to the optimizer step, both systems alike; the app's is
`step_time_s` of `metrics.jsonl`), the first `--warmup` steps dropped; tokens/s is the median over the remaining steps
of (real tokens of the global batch) / (step time). FLOP/s are the model FLOPs of each step's real batch
(`mmfsdp.model.flops`, 3 × forward) per device; `gemm_peak_fraction_*` divides them by the machine's GEMM rate,
measured by `mmfsdp.parallel.peak.measure_gemm_tflops` (1024² fp32, one thread per process) on all ranks at the same
time (mean of the ranks, best of 3 and of the repeats), the same peak for every run. The last line is one JSON object:
each run's numbers and the ratios `tiny_over_plain`, `large_over_plain`, `large_best_over_plain` (and
`tiny_best_over_plain`), each the median tokens/s of mmfsdp's run over the plain loop's; the same without the direct
exchanges (`{size}_no_direct_over_plain`, `{size}_best_no_direct_over_plain`) and the direct exchanges' own factor
(`{size}_direct_gain`, `{size}_best_direct_gain`: the run with them over the run without); `ratio_ranges` gives each
ratio's `min`, `max` and `repeats`, the ratios of the repeats run back to back (repeat i of both systems). `targets`
holds the issue's targets on the medians (`tiny_over_plain` ≥ 1.0, `large_over_plain` ≥ 1.3,
`large_best_over_plain` ≥ 1.5) and `targets_met` whether each measured ratio meets its target (null: not measured).

`--llamafactory PYTHON` (the python of a separate venv with `llamafactory==0.9.5`, never the project's: see
`tools/bench/llamafactory_run.py` and docs/benchmarks.md) adds, after the three runs of each size, LLaMA-Factory on
the same assets (a random init saved for it), the same training jsonl, global batch, warmup and steps, twice:
`llamafactory` (its defaults: DDP, gradient checkpointing on) and `llamafactory_nogc` (without gradient
checkpointing). Its step time is the wall time between the HF Trainer's consecutive `on_step_end`s; its FLOPs are
counted from each step's real samples and images as for the plain loop. Ratios: `{size}_over_llamafactory`,
`{size}_best_over_llamafactory`, `{size}_over_llamafactory_nogc` (mmfsdp's tokens/s over LLaMA-Factory's); each
LLaMA-Factory run also reports its first training row's token count against mmfsdp's, whether the ids are the
same, and how many rows its tokenisation gives another length than mmfsdp's (`rows`). A failed LLaMA-Factory run
leaves `{"error": TAIL}` and null ratios. Without the flag the JSON says `"llamafactory": "not run"`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _smoke import parse_args

ROOT = Path(__file__).resolve().parents[2]
TINY_ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
APP = ROOT / "apps" / "train"
LLAMAFACTORY_RUN = ROOT / "tools" / "bench" / "llamafactory_run.py"
LLAMAFACTORY_VARIANTS = {"llamafactory": [], "llamafactory_nogc": ["--no-gradient-checkpointing"]}
TARGETS = {"tiny_over_plain": 1.0, "large_over_plain": 1.3, "large_best_over_plain": 1.5}
"""The targets of the ratios, on the median of the repeats (issue 35)."""
NO_DIRECT = "parallel.fsdp_plan.direct_cpu_comm=false"
"""The override of the `*_no_direct` runs: FSDP2's own gloo collectives (issue 44)."""


# ---------------------------------------------------------------------------------------------- setup


def large_assets(out: Path, hidden: int, layers: int) -> Path:
    """The tiny assets with a bigger decoder (vision tower unchanged but projecting to `hidden`)."""
    path = out / f"assets_{hidden}x{layers}"
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(TINY_ASSETS, path)
    config = json.loads((path / "config.json").read_text())
    heads = hidden // 64
    text = config["text_config"]
    text.update(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=max(heads // 3, 1), head_dim=64)
    text["rope_parameters"]["mrope_section"] = [16, 8, 8]  # sums to head_dim / 2
    config["vision_config"]["out_hidden_size"] = hidden
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def data_config(size: str, out: Path, assets: Path, tiny_rows: int) -> dict:
    """The `data:` section of both systems for `size` (the app's keys; the plain loop reads the same rows)."""
    pre = {"model_name_or_path": str(assets), "template": "qwen3_vl_nothink", "image_plugin": "qwen2_vl",
           "cutoff_len": 256}
    if size == "tiny":
        return {"dataset_param": {
            "dataset_type": "synthetic_shapes", "preprocess_parameters": pre,
            "basic_parameters": {"dataset_dir": str(out / "data_tiny"), "cache_dir": str(out / "cache_tiny")},
            "synthetic": {"num_train": tiny_rows, "num_eval": 16},
        }, "dataloader_param": {"collate_param": {"model_name": "qwen3vl"}}}
    from mmfsdp.data.synthetic import make_varlen_dataset

    make_varlen_dataset(out / "data_large", num_train=512, num_eval=0, seed=3, min_images=0, max_images=2,
                        max_answer_words=30, text_only_share=0.3)
    return {"dataset_param": {
        "dataset_type": "huggingface", "preprocess_parameters": pre,
        "basic_parameters": {"dataset": str(out / "data_large" / "train.jsonl"),
                             "dataset_dir": str(out / "data_large"), "cache_dir": str(out / "cache_large")},
    }, "dataloader_param": {"collate_param": {"model_name": "qwen3vl"}}}


def write_config(path: Path, assets: Path, data: dict, args, output_dir: Path) -> Path:
    """An app config naming only the model, the data and the run's length: every other key is mmfsdp's default."""
    from mmfsdp.config import dump_yaml

    config = {
        "model": {"model_id": "qwen3_vl", "model_name_or_path": str(assets), "random_init": True},
        "data": data,
        "training": {"micro_batch_size": args.micro_batch, "train_iters": args.warmup + args.steps,
                     "lr": 1.0e-4, "output_dir": str(output_dir), "log_interval": 1, "seed": 1234},
    }
    path.write_text(dump_yaml(config))
    return path


# ---------------------------------------------------------------------------------------------- the plain loop


class _PadToLongest:
    """collate_fn: the micro-batch's samples padded to its longest row (mmfsdp's collator without packing)."""

    def __init__(self, pad_token_id: int):
        from mmfsdp.data.collators import get_collator

        self.collate = get_collator("qwen3vl")(pad_token_id=pad_token_id)

    def __call__(self, samples):
        return self.collate(samples)


def gemm_peak_tflops(tries: int = 3) -> float:
    """The machine's GEMM rate per process: 1024² fp32 matmuls timed on every rank at the same moment (mean of
    the ranks), the best of `tries` (on a shared machine one timing can land on a busy moment)."""
    import torch
    import torch.distributed as dist

    from mmfsdp.parallel.peak import measure_gemm_tflops

    best = 0.0
    for _ in range(tries):
        dist.barrier()
        measured = torch.tensor([measure_gemm_tflops(torch.device("cpu"), torch.float32, size=1024, seconds=0.5)],
                                dtype=torch.float64)
        dist.all_reduce(measured)
        best = max(best, float(measured) / dist.get_world_size())
    return best


def _plain_rank(rank: int, world_size: int, port: int, config_path: str, args: dict, result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    from mmfsdp.data import build_dataset, build_processor
    from mmfsdp.model import get_model_entry, model_inputs
    from mmfsdp.model.flops import count_forward, sample_lengths
    from mmfsdp.train.config import load_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # one thread per process, as torchrun sets for the app and for LLaMA-Factory (OMP_NUM_THREADS=1)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    cfg = load_config(Path(config_path), [])
    peak = gemm_peak_tflops()

    torch.manual_seed(0)
    hf_config = AutoConfig.from_pretrained(cfg.model.model_name_or_path)
    model = Qwen3VLForConditionalGeneration._from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    for layer in model.model.language_model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0e-4, weight_decay=0.0)

    processor = build_processor(cfg.data)
    dataset = build_dataset(cfg.data, processor, split="train")
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=1234,
                                                              drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args["micro_batch"], sampler=sampler,
                                         collate_fn=_PadToLongest(processor.pad_token_id),
                                         num_workers=args["plain_workers"],
                                         drop_last=True)
    entry = get_model_entry("qwen3_vl")
    shape = entry.costs.flop_shape(hf_config)
    steps = []
    batches = iter(loader)
    for _ in range(args["warmup"] + args["steps"]):
        started = time.perf_counter()
        batch = next(batches)
        loss = model(**model_inputs(batch), labels=batch["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_time = time.perf_counter() - started
        lengths = sample_lengths(batch["attention_mask"], None)
        flops = count_forward(shape, lengths, entry.costs.image_patches(hf_config, batch))
        counts = torch.tensor([float(batch["attention_mask"].sum()), float(flops.model), step_time],
                              dtype=torch.float64)
        dist.all_reduce(counts)  # outside the timed region: tokens and FLOPs of the global batch, summed step time
        steps.append({"num_tokens": counts[0].item(), "flops": counts[1].item(), "step_time_s": step_time})
    if rank == 0:
        Path(result_path).write_text(json.dumps({"steps": steps, "peak_tflops": peak,
                                                 "num_params": sum(p.numel() for p in model.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def run_plain(config_path: Path, args, out: Path) -> dict:
    import torch.multiprocessing as mp

    from mmfsdp.parallel.testing import free_port

    result = out / "plain.json"
    result.unlink(missing_ok=True)
    # forked, as the app's CPU launcher forks its ranks: neither run pays an interpreter start per rank
    mp.start_processes(_plain_rank, args=(args.nproc, free_port(), str(config_path), vars(args), str(result)),
                       nprocs=args.nproc, join=True, start_method="fork")
    return json.loads(result.read_text())


# ---------------------------------------------------------------------------------------------- mmfsdp


def run_app(config_path: Path, overrides: list[str], args, output_dir: Path) -> dict:
    """The app on `config_path` + `overrides`; its per-step records from `metrics.jsonl`."""
    if output_dir.exists():
        shutil.rmtree(output_dir)
    from mmfsdp.train.cli import fork_main

    app_args = [str(config_path), *overrides, "--nproc-per-node", str(args.nproc)]
    log = output_dir.with_name(output_dir.name + ".console.log")
    code = fork_main(app_args, cwd=ROOT, log=log)  # `python apps/train ARGS`, forked: no interpreter start per run
    output = log.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"{sys.executable} {APP} {' '.join(app_args)} failed (exit status {code}):\n{output[-6000:]}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [{"num_tokens": r["num_tokens"], "step_time_s": r["step_time_s"],
              "flops": r["tflops"] * r["step_time_s"] * args.nproc * 1e12} for r in records]
    compile_lines = [line.strip() for line in output.splitlines()
                     if "compile: " in line and ("first compiled" in line or "modules compiled" in line)]
    return {"steps": steps, "log": compile_lines[:3]}


# ---------------------------------------------------------------------------------------------- LLaMA-Factory


def run_llamafactory(python: str, variant: str, assets: Path, cfg, args, out: Path, size: str) -> dict:
    """`llamafactory_run.py` in LLaMA-Factory's venv (`python`) on the run's assets and training rows; its steps with
    the FLOPs of each step's real batch counted as for the plain loop (`count_forward` of the samples' lengths and the
    images' patches, which the script records). Raises `RuntimeError` with the output's tail when it fails."""
    import torch
    from transformers import AutoConfig

    from mmfsdp.data import dataset_files
    from mmfsdp.model import get_model_entry
    from mmfsdp.model.flops import count_forward

    (train_file,) = dataset_files(cfg.data, "train")
    result = out / f"{size}_{variant}.json"
    cmd = [python, str(LLAMAFACTORY_RUN), "--assets", str(assets), "--data", str(train_file), "--out", str(result),
           "--work", str(out / f"{size}_{variant}"), "--nproc", str(args.nproc), "--micro-batch", str(args.micro_batch),
           "--max-steps", str(args.warmup + args.steps),
           "--cutoff-len", str(cfg.data.dataset_param.preprocess_parameters.cutoff_len),
           *LLAMAFACTORY_VARIANTS[variant]]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    result.unlink(missing_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}")
    run = json.loads(result.read_text())
    entry = get_model_entry("qwen3_vl")
    hf_config = AutoConfig.from_pretrained(assets)
    shape = entry.costs.flop_shape(hf_config)
    for step in run["steps"]:
        grids = step["image_grid_thw"]
        batch = {"image_grid_thw": torch.tensor(grids, dtype=torch.long) if grids else None}
        patches = entry.costs.image_patches(hf_config, batch)
        step["flops"] = float(count_forward(shape, step["sample_lens"], patches).model)
    return run


# ---------------------------------------------------------------------------------------------- summary


def summarise(run: dict, warmup: int, peak_tflops: float, nproc: int) -> dict:
    steady = run["steps"][warmup:]
    if not steady:
        raise SystemExit("no steady-state steps: raise --steps")
    return {
        "tokens_per_s": statistics.median(s["num_tokens"] / s["step_time_s"] for s in steady),
        "step_ms": 1e3 * statistics.median(s["step_time_s"] for s in steady),
        "tokens_per_step": statistics.median(s["num_tokens"] for s in steady),
        "tflops_per_device": statistics.median(s["flops"] / s["step_time_s"] / nproc / 1e12 for s in steady),
        "gemm_peak_fraction": statistics.median(s["flops"] / s["step_time_s"] / nproc / 1e12 for s in steady)
        / peak_tflops,
        "steady_steps": len(steady),
    }


def median_of_repeats(summaries: list[dict]) -> dict:
    """One run's numbers over its repeats: the median of each, the slowest and fastest repeat's tokens/s, and every
    repeat's numbers (`repeats`, in the order they ran)."""
    tokens = [s["tokens_per_s"] for s in summaries]
    return {**{key: statistics.median(s[key] for s in summaries) for key in summaries[0]},
            "tokens_per_s_min": min(tokens), "tokens_per_s_max": max(tokens), "repeats": summaries}


def ratio(ours: dict, theirs: dict) -> dict:
    """`ours` over `theirs` in tokens/s: on the medians (`median`), and per repeat (repeat i of both ran back to
    back: `repeats`, their `min` and `max`)."""
    paired = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours["repeats"], theirs["repeats"])]
    return {"median": ours["tokens_per_s"] / theirs["tokens_per_s"], "min": min(paired), "max": max(paired),
            "repeats": paired}


def measure_size(size: str, args, out: Path) -> dict:
    from mmfsdp.data import build_dataset, build_processor, prepare_dataset
    from mmfsdp.train.config import load_config

    assets = TINY_ASSETS if size == "tiny" else large_assets(out, args.large_hidden, args.large_layers)
    data = data_config(size, out, assets, args.tiny_rows)
    config_path = write_config(out / f"{size}.yaml", assets, data, args, out / f"{size}_mmfsdp")
    cfg = load_config(config_path, [])
    prepare_dataset(cfg.data)
    dataset = build_dataset(cfg.data, build_processor(cfg.data), split="train")
    lengths = dataset.lengths
    mean_len = sum(lengths) / len(lengths)
    # packed rows of about the tokens of a padded micro-batch: the same global batch in tokens
    capacity = max(int(mean_len * args.micro_batch), max(lengths))
    presets = {
        # rows packed first-fit to about a padded micro-batch's tokens, one row per micro-batch
        "packing": ["data.dataset_param.basic_parameters.packing=true", "training.micro_batch_size=1",
                    f"data.dataset_param.preprocess_parameters.cutoff_len={capacity}"],
        # the padding-free defaults, each step's samples balanced over the ranks by the cost model
        "balance": ["data.dataloader_param.balance=true", f"training.micro_batch_tokens={capacity}"],
        # the padding-free defaults, each decoder layer compiled (inductor), the gathered parameters kept from
        # forward to backward (no second all-gather per layer: more memory for less communication)
        "compile": ["features.compile=true", "parallel.fsdp_plan.reshard_after_forward=false"],
    }
    best = [*presets[args.best_preset], *args.best]

    # Each system runs `--repeats` times, the systems interleaved (plain, mmfsdp, best, [LLaMA-Factory], plain,
    # ...), so that a change of load on the machine meets all of them; each system's result is its repeats' median.
    lf_variants = list(LLAMAFACTORY_VARIANTS) if args.llamafactory else []
    no_direct = [f"{name}_no_direct" for name in args.without_direct.split(",") if name]
    repeats: dict[str, list[dict]] = {
        name: [] for name in ("plain", "mmfsdp", "mmfsdp_best", *no_direct, *lf_variants)
    }
    errors: dict[str, str] = {}
    started = time.perf_counter()
    for _ in range(args.repeats):
        repeats["plain"].append(run_plain(config_path, args, out))
        repeats["mmfsdp"].append(run_app(config_path, list(args.defaults_override), args, out / f"{size}_mmfsdp"))
        repeats["mmfsdp_best"].append(run_app(config_path, [f"training.output_dir={out / f'{size}_best'}", *best],
                                              args, out / f"{size}_best"))
        if "mmfsdp_no_direct" in repeats:
            repeats["mmfsdp_no_direct"].append(run_app(
                config_path, [f"training.output_dir={out / f'{size}_no_direct'}", *args.defaults_override, NO_DIRECT],
                args, out / f"{size}_no_direct"))
        if "mmfsdp_best_no_direct" in repeats:
            repeats["mmfsdp_best_no_direct"].append(run_app(
                config_path, [f"training.output_dir={out / f'{size}_best_no_direct'}", *best, NO_DIRECT],
                args, out / f"{size}_best_no_direct"))
        for variant in lf_variants:
            if variant in errors:
                continue
            try:
                repeats[variant].append(run_llamafactory(args.llamafactory, variant, assets, cfg, args, out, size))
            except RuntimeError as err:
                errors[variant] = str(err)[-3000:]
    peak = max(run["peak_tflops"] for run in repeats["plain"])
    summary: dict = {}
    runs = {}
    for name, done in repeats.items():
        if not done:
            summary[name] = {"error": errors.get(name, "no run")}
            continue
        runs[name] = done[0]
        summary[name] = median_of_repeats([summarise(run, args.warmup, peak, args.nproc) for run in done])
    summary["num_params"] = runs["plain"]["num_params"]
    summary["mean_sample_tokens"] = mean_len
    summary["best_overrides"] = best
    summary["peak_tflops"] = peak
    summary["compile_log"] = runs["mmfsdp_best"]["log"]  # the first repeat's
    first_ids = [int(t) for t in dataset.record(0)["input_ids"]]
    for variant in lf_variants:
        if variant not in runs:
            continue
        run = runs[variant]
        lf_ids, lf_lengths = run["first_sample_input_ids"], run["row_lengths"]
        summary[variant].update(
            num_params=run["num_params"], num_trainable_params=run["num_trainable_params"],
            gradient_checkpointing=run["gradient_checkpointing"], versions=run["versions"],
            first_sample_tokens={"mmfsdp": len(first_ids), "llamafactory": len(lf_ids)},
            first_sample_same_ids=lf_ids == first_ids,
            # every training row's token count, row by row (both keep the jsonl's order)
            rows={"mmfsdp": len(lengths), "llamafactory": len(lf_lengths),
                  "tokens_mmfsdp": int(sum(lengths)), "tokens_llamafactory": int(sum(lf_lengths)),
                  "other_length": sum(int(a) != b for a, b in zip(lengths, lf_lengths))
                  if len(lengths) == len(lf_lengths) else None})
    summary["wall_s"] = time.perf_counter() - started
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,large", help="comma-separated: tiny, large")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per rank and step (global batch: × nproc)")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped before the medians")
    parser.add_argument("--steps", type=int, default=15, help="steady-state steps measured (tiny)")
    parser.add_argument("--plain-workers", type=int, default=2,
                        help="DataLoader workers of the plain loop (default: 2)")
    parser.add_argument("--tiny-rows", type=int, default=1024, help="training rows of the tiny size (default: 1024)")
    parser.add_argument("--large-steps", type=int, default=6, help="steady-state steps measured (large)")
    parser.add_argument("--large-warmup", type=int, default=2)
    parser.add_argument("--large-hidden", type=int, default=768)
    parser.add_argument("--large-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each system, interleaved (default: 3); each number is the median of the repeats, "
                             "with the min and max beside it")
    parser.add_argument("--best-preset", choices=("balance", "compile", "packing"), default="compile",
                        help="the best run's settings: compile (each decoder layer compiled with inductor, "
                             "parameters kept gathered from forward to backward), balance (each step's samples "
                             "balanced over the ranks, a token budget of about a micro-batch's tokens) or packing "
                             "(rows packed to about that)")
    parser.add_argument("--best", action="append", default=[], help="extra KEY=VALUE override of the best run")
    parser.add_argument("--defaults-override", action="append", default=[],
                        help="KEY=VALUE for the defaults run, e.g. parallel.fsdp_plan.min_group_params=0 (the plan "
                             "before grouping)")
    parser.add_argument("--without-direct", default="mmfsdp,mmfsdp_best",
                        help="comma-separated runs (mmfsdp, mmfsdp_best) also run with "
                             "parallel.fsdp_plan.direct_cpu_comm: false, as <run>_no_direct (default: both; '' none)")
    parser.add_argument("--llamafactory", metavar="PYTHON", default=None,
                        help="python of a venv with llamafactory==0.9.5: also run LLaMA-Factory (tools/bench/"
                             "llamafactory_run.py), with and without its gradient checkpointing; default: not run")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench_train_throughput"))
    args = parse_args(parser, sizes="tiny", micro_batch=2, warmup=1, steps=2, tiny_rows=32, repeats=1,
                      best_preset="balance", plain_workers=0, without_direct="mmfsdp")
    unknown = set(filter(None, args.without_direct.split(","))) - {"mmfsdp", "mmfsdp_best"}
    if unknown:
        parser.error(f"--without-direct: unknown runs {sorted(unknown)} (mmfsdp, mmfsdp_best)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    results: dict = {"nproc": args.nproc, "global_batch_rows": args.nproc * args.micro_batch, "repeats": args.repeats,
                     "targets": TARGETS, "ratio_ranges": {}}
    for size in args.sizes.split(","):
        size_args = argparse.Namespace(**vars(args))
        if size == "large":
            size_args.steps, size_args.warmup = args.large_steps, args.large_warmup
        results[size] = measure_size(size, size_args, out)
        r = results[size]
        measured = [name for name in ("plain", "mmfsdp", "mmfsdp_best", "mmfsdp_no_direct", "mmfsdp_best_no_direct")
                    if name in r]
        for name in measured:
            print_run(size, name, r[name])
        pairs = [(f"{size}_over_plain", "mmfsdp", "plain"), (f"{size}_best_over_plain", "mmfsdp_best", "plain"),
                 (f"{size}_no_direct_over_plain", "mmfsdp_no_direct", "plain"),
                 (f"{size}_best_no_direct_over_plain", "mmfsdp_best_no_direct", "plain"),
                 (f"{size}_direct_gain", "mmfsdp", "mmfsdp_no_direct"),
                 (f"{size}_best_direct_gain", "mmfsdp_best", "mmfsdp_best_no_direct")]
        for key, ours, theirs in pairs:
            if ours in r and theirs in r:
                ranges = ratio(r[ours], r[theirs])
                results[key] = ranges.pop("median")
                results["ratio_ranges"][key] = ranges
        for name in measured:
            results[f"gemm_peak_fraction_{size}_{name}"] = r[name]["gemm_peak_fraction"]
        if args.llamafactory is None:
            results["llamafactory"] = "not run"
            continue
        for name, kind, ours in (("llamafactory", "over", "mmfsdp"), ("llamafactory", "best_over", "mmfsdp_best"),
                                  ("llamafactory_nogc", "over", "mmfsdp")):
            key = f"{size}_{kind}_{name}"
            run = r[name]
            if "error" in run:
                results[key] = None
                continue
            ranges = ratio(r[ours], run)
            results[key] = ranges.pop("median")
            results["ratio_ranges"][key] = ranges
        for name in LLAMAFACTORY_VARIANTS:
            run = r[name]
            if "error" in run:
                print(f"{size:5s} {name:17s} failed: {run['error'][-500:]}", flush=True)
                continue
            print_run(size, name, run, f"  first row same ids: {run['first_sample_same_ids']}, rows of other length: "
                                       f"{run['rows']['other_length']} of {run['rows']['llamafactory']}")
            results[f"gemm_peak_fraction_{size}_{name}"] = run["gemm_peak_fraction"]
    results["targets_met"] = {key: None if key not in results else results[key] >= target
                              for key, target in TARGETS.items()}
    print(json.dumps(results))


def print_run(size: str, name: str, run: dict, extra: str = "") -> None:
    print(f"{size:5s} {name:21s} {run['tokens_per_s']:9.0f} tokens/s (median; {run['tokens_per_s_min']:.0f}–"
          f"{run['tokens_per_s_max']:.0f})  {run['step_ms']:8.1f} ms/step  {run['tokens_per_step']:6.0f} tokens/step  "
          f"GEMM-peak fraction {run['gemm_peak_fraction']:.3f}{extra}", flush=True)


if __name__ == "__main__":
    main()
