"""Peak RSS per rank for loading a model of a few hundred MB on 2 processes: meta-device vs. eager.

Writes a synthetic HF safetensors checkpoint (a stack of `nn.Linear`, `--size_mb`
total, two shards), then loads it in two fresh 2-process gloo runs:

- meta:  build on the meta device -> `fully_shard` each layer and the root ->
         `to_empty(device="cpu")` -> `mmfsdp.ckpt.load_hf_weights` (each rank reads
         only its slice of each tensor)
- eager: build the full model on the CPU -> `load_hf_weights` (full tensors) ->
         `fully_shard` (the full parameters are freed)

Each rank reports its RSS before building the model (Python, torch, the process
group and FSDP2's one-time setup: the same for both) and its peak RSS (`VmHWM`)
after loading.
`meta_over_eager_rss` is the largest per-rank peak *increase over that
baseline* for meta divided by the same for eager, i.e. the memory the loading
itself takes; `meta_over_eager_peak_rss` is the plain ratio of the largest peaks.
The last line is one JSON object (target for `meta_over_eager_rss`: <= 0.6).

    uv run python tools/bench/load_memory.py [--size_mb 400] [--workdir DIR]
    uv run python tools/bench/load_memory.py --smoke        # the smallest run (CI): 2 layers, 32 MiB
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
from _smoke import parse_args
from safetensors.torch import save_file

from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

HIDDEN = 2048
RANK_MODULES = ("mmfsdp.ckpt",)
"""What every rank imports, once in the process the ranks fork from (`preload_for_ranks`)."""


class LinearStack(torch.nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def _shard(model: LinearStack) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


def load_on_rank(rank: int, world_size: int, mode: str, hf_dir: str, num_layers: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from mmfsdp.ckpt import load_hf_weights

    # One-time costs common to both ways (FSDP2/DTensor imports, the default device mesh)
    # are paid before the baseline: shard a throwaway meta module.
    with torch.device("meta"):
        fully_shard(torch.nn.Linear(2, 2))
    torch.distributed.barrier()
    baseline = _status_mb("VmRSS")
    if mode == "meta":
        with torch.device("meta"):
            model = LinearStack(num_layers)
        _shard(model)
        model.to_empty(device="cpu")
        load_hf_weights(model, hf_dir)
    else:
        model = LinearStack(num_layers)
        load_hf_weights(model, hf_dir)
        _shard(model)
    peak = _status_mb("VmHWM")
    local_mb = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    with torch.no_grad():  # both ways must give the same model (measured after the peak was read)
        check = model(torch.ones(2, HIDDEN)).sum().item()
    return {"baseline_mb": baseline, "peak_mb": peak, "local_params_mb": local_mb, "check": check}


def write_checkpoint(path: Path, num_layers: int) -> float:
    torch.manual_seed(0)
    path.mkdir(parents=True)
    weight_map, total = {}, 0
    half = num_layers // 2
    for index, layers in enumerate((range(half), range(half, num_layers))):
        tensors = {}
        for i in layers:
            tensors[f"layers.{i}.weight"] = torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5
            tensors[f"layers.{i}.bias"] = torch.randn(HIDDEN) * 0.01
        filename = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file(tensors, path / filename, metadata={"format": "pt"})
        weight_map.update({key: filename for key in tensors})
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size_mb", type=float, default=400, help="model size in MiB (default 400)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a new temporary directory)")
    args = parse_args(parser, size_mb=1)
    num_layers = max(2, round(args.size_mb * 2**20 / ((HIDDEN * HIDDEN + HIDDEN) * 4)))

    root = Path(tempfile.mkdtemp(prefix="load-memory-bench-", dir=args.workdir))
    try:
        model_mb = write_checkpoint(root / "hf", num_layers)
        print(f"model: {num_layers} x Linear({HIDDEN}, {HIDDEN}) fp32 = {model_mb:.0f} MiB, 2 processes")
        results = {}
        preload_for_ranks(*RANK_MODULES)
        for mode in ("meta", "eager"):
            results[mode] = run_distributed(load_on_rank, 2, mode, str(root / "hf"), num_layers, timeout=600)
            for rank, r in enumerate(results[mode]):
                print(f"{mode:>5} rank {rank}: baseline {r['baseline_mb']:7.0f} MiB  peak {r['peak_mb']:7.0f} MiB  "
                      f"(+{r['peak_mb'] - r['baseline_mb']:.0f})  local params {r['local_params_mb']:.0f} MiB")
        assert {r["check"] for rs in results.values() for r in rs} == {results["meta"][0]["check"]}, "meta and eager loads differ"
        growth = {mode: max(r["peak_mb"] - r["baseline_mb"] for r in rs) for mode, rs in results.items()}
        peak = {mode: max(r["peak_mb"] for r in rs) for mode, rs in results.items()}
        summary = {
            "model_mb": round(model_mb, 1),
            "meta_peak_mb": [round(r["peak_mb"], 1) for r in results["meta"]],
            "eager_peak_mb": [round(r["peak_mb"], 1) for r in results["eager"]],
            "baseline_mb": [round(r["baseline_mb"], 1) for r in results["meta"]],
            "meta_over_eager_peak_rss": round(peak["meta"] / peak["eager"], 3),
            "meta_over_eager_rss": round(growth["meta"] / growth["eager"], 3),
        }
        print(json.dumps(summary))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
