"""LLaMA-Factory on the rows of `train_throughput.py`: per-step wall time and real tokens, in LLaMA-Factory's own venv.

    uv venv /work/lf-venv --python 3.11
    uv pip install --python /work/lf-venv/bin/python llamafactory==0.9.5 torch==2.14.0 torchvision==0.29.2 torchaudio
    /work/lf-venv/bin/python tools/bench/llamafactory_run.py --assets ASSETS --data DIR/train.jsonl --out RESULT.json \
        --work WORKDIR [--nproc 2 --micro-batch 8 --max-steps 20 --cutoff-len 256] [--no-gradient-checkpointing]
    uv run python tools/bench/llamafactory_run.py --smoke       # CI, without LLaMA-Factory: everything up to the launch

`--smoke` (the project's venv is enough) does everything short of starting LLaMA-Factory on the qwen3vl-tiny assets
and two generated text-only rows (unless `--assets`/`--data` are given), in a temporary directory unless `--work`
and `--out` are given: the random-init model saved, the dataset registered, the `run_exp` arguments and the
`torch.distributed.run` command built; it prints them as one JSON line, `"llamafactory": "not run (smoke)"`.

This file runs in LLaMA-Factory's venv, never in the project's: it imports nothing from mmfsdp (its lock pins a
transformers that LLaMA-Factory 0.9.5 refuses, and the project never depends on LLaMA-Factory). `train_throughput.py
--llamafactory PYTHON` calls it with the venv's python.

What it does, in this process: copy `--assets` (config, tokenizer, processor files) to `WORKDIR/model` and save there
a random-init `Qwen3VLForConditionalGeneration` (`torch.manual_seed(0)`, fp32, `save_pretrained`), as the project's
runs build theirs from `random_init`; write `WORKDIR/dataset/dataset_info.json` registering `--data` (the project's
jsonl rows of `messages` + `images`, image paths relative to the jsonl's folder, which becomes `media_dir`) as a
sharegpt dataset with role/content tags. Then it launches itself on `--nproc` processes with `torch.distributed.run
--standalone` (which sets `OMP_NUM_THREADS=1` per process, as the project's app does) and each process calls
`llamafactory.train.tuner.run_exp` with: `stage: sft`, `finetuning_type: full`, `template: qwen3_vl_nothink`, fp32
(no `bf16`/`fp16`), `per_device_train_batch_size: --micro-batch`, `gradient_accumulation_steps: 1`,
`learning_rate: 1e-4`, `max_steps`, `cutoff_len`, `ddp_backend: gloo`, `dataloader_num_workers: 2`,
`preprocessing_num_workers: 1`, `overwrite_cache`, `report_to: none`, `save_strategy: no`, `trust_remote_code:
false`, a fresh `output_dir`, `logging_steps: 1` (the project's runs in the benchmark log every step too), and with
`--no-gradient-checkpointing` also `disable_gradient_checkpointing: true`. (At the end `run_exp` saves the trained
model into `output_dir` whatever `save_strategy` says; that is after the last step, outside the timings.)

Every other key is LLaMA-Factory's (or the HF Trainer's) default, which is what a user gets: data parallelism is
DDP through the HF Trainer and accelerate (every rank holds the whole model and optimizer state; no FSDP), gradient
checkpointing on every decoder layer (reentrant), `freeze_vision_tower` and `freeze_multi_modal_projector` true (the
vision tower and merger get no gradients and no optimizer state: `num_trainable_params` in the result says how many
are trained), the Trainer's AdamW (`optim` default), linear schedule without warmup, `max_grad_norm` 1.0, weight
decay 0, SDPA attention, its SFT collator padding each micro-batch to its longest row (rounded up to a multiple of
8), the Trainer's shuffling sampler (seed 42), prompts masked out of the labels, and its own tokenisation through
the template and the `qwen3_vl` multimodal plugin (its image pixel bounds: `image_max_pixels` 768², `image_min_pixels`
32²).

Measured (rank 0 writes `--out`, one JSON object): per optimizer step the wall time between consecutive
`on_step_end` callbacks (the first from `on_train_begin`), so data loading, the collator and everything the Trainer
does between steps is inside it, as in the project's runs; the real (non-pad) tokens of the step's global batch
(a forward pre-hook on the model sums `attention_mask` on each rank; the ranks' counts are gathered after the last
step, outside the timed region), each sample's real length and each image's `image_grid_thw` (so that the caller
counts FLOPs exactly as for the other runs); the input ids of the dataset's first row and the token count of
every row as LLaMA-Factory tokenised them (the caller compares them with its own); `num_params`,
`num_trainable_params`, the versions of llamafactory, transformers and torch, and the variant (`llamafactory` or
`llamafactory_nogc`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _smoke import parse_args

DATASET = "bench_rows"
TINY_ASSETS = Path(__file__).resolve().parents[2] / "examples" / "qwen3vl-tiny" / "assets"


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """The random-init model directory and the dataset directory (with `dataset_info.json`) under `--work`."""
    import torch
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    model_dir = work / "model"
    shutil.copytree(args.assets, model_dir)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(model_dir)
    model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    model.save_pretrained(model_dir)

    data = Path(args.data).resolve()
    dataset_dir = work / "dataset"
    dataset_dir.mkdir()
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
            "system_tag": "system"}
    info = {DATASET: {"file_name": str(data), "formatting": "sharegpt",
                      "columns": {"messages": "messages", "images": "images"}, "tags": tags}}
    (dataset_dir / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return model_dir, dataset_dir


def train_args(args: argparse.Namespace) -> dict:
    """The `run_exp` arguments: the keys the docstring lists; LLaMA-Factory's defaults for the rest."""
    work = Path(args.work)
    config = {
        "model_name_or_path": str(work / "model"),
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": DATASET,
        "dataset_dir": str(work / "dataset"),
        "media_dir": str(Path(args.data).resolve().parent),
        "template": "qwen3_vl_nothink",
        "cutoff_len": args.cutoff_len,
        "overwrite_cache": True,
        "preprocessing_num_workers": 1,
        "dataloader_num_workers": 2,
        "output_dir": str(work / "output"),
        "overwrite_output_dir": True,
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "per_device_train_batch_size": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-4,
        "max_steps": args.max_steps,
        "ddp_backend": "gloo",
    }
    if args.no_gradient_checkpointing:
        config["disable_gradient_checkpointing"] = True
    return config


def worker(args: argparse.Namespace) -> None:
    """One rank: `run_exp` with a callback that times steps and a pre-hook that counts each step's tokens."""
    import llamafactory
    import torch
    import torch.distributed as dist
    import transformers
    from llamafactory.train.tuner import run_exp
    from transformers import TrainerCallback

    class StepMeter(TrainerCallback):
        def __init__(self) -> None:
            self.step_times: list[float] = []
            self.sample_lens: list[list[int]] = []  # per step, this rank's micro-batch
            self.image_grids: list[list[list[int]]] = []
            self.pending_lens: list[int] = []
            self.pending_grids: list[list[int]] = []
            self.last = 0.0
            self.model = None
            self.first_sample_ids: list[int] = []
            self.row_lengths: list[int] = []

        def count(self, module, inputs, kwargs) -> None:
            mask = kwargs.get("attention_mask")
            if mask is not None:
                self.pending_lens += [int(n) for n in mask.reshape(mask.shape[0], -1).sum(dim=-1).tolist()]
            grid = kwargs.get("image_grid_thw")
            if grid is not None:
                self.pending_grids += [[int(v) for v in row] for row in grid.tolist()]

        def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
            self.model = model
            model.register_forward_pre_hook(self.count, with_kwargs=True)
            # the dataset's first row as LLaMA-Factory tokenised it (its rows keep the jsonl's order)
            dataset = train_dataloader.dataset
            self.first_sample_ids = [int(t) for t in dataset[0]["input_ids"]]
            self.row_lengths = [len(ids) for ids in dataset["input_ids"]]
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_times.append(now - self.last)
            self.last = now
            self.sample_lens.append(self.pending_lens)
            self.image_grids.append(self.pending_grids)
            self.pending_lens, self.pending_grids = [], []

        def on_train_end(self, args, state, control, **kwargs):
            # after the last step: the global batch's samples and images, every rank's step times
            mine = {"times": self.step_times, "lens": self.sample_lens, "grids": self.image_grids}
            ranks = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
            if dist.is_initialized():
                dist.all_gather_object(ranks, mine)
            if int(os.environ.get("RANK", "0")) != 0:
                return
            steps = []
            for i in range(len(self.step_times)):
                lens = [n for r in ranks for n in r["lens"][i]]
                grids = [g for r in ranks for g in r["grids"][i]]
                steps.append({"num_tokens": sum(lens), "step_time_s": self.step_times[i],
                              "max_rank_step_time_s": max(r["times"][i] for r in ranks),
                              "sample_lens": lens, "image_grid_thw": grids})
            model = self.model
            result = {
                "variant": "llamafactory_nogc" if args_ns.no_gradient_checkpointing else "llamafactory",
                "steps": steps,
                "num_params": sum(p.numel() for p in model.parameters()),
                "num_trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                "world_size": len(ranks),
                "first_sample_input_ids": self.first_sample_ids,
                "row_lengths": self.row_lengths,
                "versions": {"llamafactory": llamafactory.__version__, "transformers": transformers.__version__,
                             "torch": torch.__version__},
                "train_args": train_args(args_ns),
            }
            Path(args_ns.out).write_text(json.dumps(result))

    args_ns = args
    run_exp(train_args(args), callbacks=[StepMeter()])


def _smoke_rows(folder: Path) -> str:
    """Two text-only rows in the project's jsonl format, for `--smoke`."""
    path = folder / "train.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                          {"role": "assistant", "content": " ".join(map(str, range(1, n + 1)))}], "images": []}
            for n in (3, 5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--assets", help="model directory: config.json, tokenizer, processor files")
    parser.add_argument("--data", help="jsonl of messages + images (paths relative to its folder)")
    parser.add_argument("--out", help="result JSON (written by rank 0)")
    parser.add_argument("--work", help="scratch directory (removed first)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per rank and step")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps (warmup included)")
    parser.add_argument("--cutoff-len", type=int, default=256)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--worker-args", help=argparse.SUPPRESS)
    args = parse_args(parser, assets=str(TINY_ASSETS), micro_batch=1, max_steps=2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker_args:  # a rank under torch.distributed.run, whose own parser would take `--nproc` as its option
        worker(argparse.Namespace(**json.loads(Path(args.worker_args).read_text())))
        return
    scratch = Path(tempfile.mkdtemp(prefix="llamafactory-smoke-")) if args.smoke else None
    if scratch is not None:
        args.data = args.data or _smoke_rows(scratch)
        args.work, args.out = args.work or str(scratch / "work"), args.out or str(scratch / "result.json")
    missing = [name for name in ("assets", "data", "out", "work") if getattr(args, name) is None]
    if missing:
        parser.error("required: " + ", ".join(f"--{name}" for name in missing))
    model_dir, dataset_dir = prepare(args)
    Path(args.out).unlink(missing_ok=True)
    worker_args = Path(args.work) / "worker_args.json"
    worker_args.write_text(json.dumps(vars(args)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(Path(__file__).resolve()), "--worker-args", str(worker_args)]
    if scratch is not None:
        print(json.dumps({"llamafactory": "not run (smoke)", "command": cmd, "train_args": train_args(args),
                          "model_files": sorted(p.name for p in model_dir.iterdir()),
                          "dataset_info": json.loads((dataset_dir / "dataset_info.json").read_text())}))
        shutil.rmtree(scratch)
        return
    env = {**os.environ, "HF_DATASETS_CACHE": str(Path(args.work) / "hf_datasets")}
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0 or not Path(args.out).exists():
        raise SystemExit(f"LLaMA-Factory run failed (exit {proc.returncode})")


if __name__ == "__main__":
    main()
