"""The run's state: the sizes of a mode (`Sizes`), the trainer runs of the examples (`Runs`) and `Context`, what
each section function takes (device, sizes, runs, work directory, the budget)."""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any, Callable

from .common import EXAMPLES

GPU_RESERVE_S = {"large_model": 100.0, "large_model_run": 80.0, "compile": 120.0}
"""Seconds a part needs at least on a GPU (a 1.6 B model's CPU init and transfer; inductor's first compile): it
is skipped rather than started when less of the budget is left, so the whole run stays within about 8 minutes."""


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

                def wrapped(trainer=trainer):  # bound now: the name is deleted below
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
