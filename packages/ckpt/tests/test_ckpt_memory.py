"""Conversion works tensor by tensor / shard by shard: peak RSS grows by a few tensors, never the model.

Each conversion runs in a fresh child process (this file as a script) that
reports its RSS after imports and its peak RSS (VmHWM, reset after the imports) after converting a 128 MB
checkpoint of 16 tensors of 8 MB.

glibc serves allocations below its sliding mmap threshold (up to 32 MB) from a
heap it may keep after they are freed; real checkpoints have tensors far above
that, so the child pins the threshold at 1 MB to measure what the converter
keeps alive rather than what the allocator caches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mmfsdp.ckpt import save_checkpoint

MB = 2**20
NUM_TENSORS, TENSOR_MB = 16, 8


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(mode: str, src: str, out: str, assets: str) -> None:
    from mmfsdp.ckpt import dcp_to_hf, hf_to_dcp  # imported before the baseline is taken

    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here on: the imports' peaks (compiling
        f.write("5")                                 # sources where no .pyc exists) must not hide the conversion's
    baseline = _rss_mb("VmRSS")
    if mode == "hf_to_dcp":
        hf_to_dcp(src, out, progress=False)
    else:
        dcp_to_hf(src, out, assets, max_shard_size=f"{2 * TENSOR_MB}MiB", progress=False)
    print(json.dumps({"baseline_mb": baseline, "peak_mb": _rss_mb("VmHWM")}))


def _measure(mode: str, src: Path, out: Path, assets: Path) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MB), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, mode, str(src), str(out), str(assets)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["peak_mb"] - result["baseline_mb"]


@pytest.mark.slow  # fresh interpreters measure their own peak memory
def test_conversion_peak_memory_stays_near_one_tensor_or_shard(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.weight": torch.randn(TENSOR_MB * MB // 4, generator=gen) for i in range(NUM_TENSORS)}
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(tensors, hf / "model.safetensors")
    (hf / "config.json").write_text("{}")
    model_mb = NUM_TENSORS * TENSOR_MB

    growth = _measure("hf_to_dcp", hf, tmp_path / "dcp", hf)
    assert growth < 3 * TENSOR_MB, f"hf_to_dcp grew RSS by {growth:.0f} MB for a {model_mb} MB model"

    growth = _measure("dcp_to_hf", tmp_path / "dcp", tmp_path / "out", hf)
    assert growth < 3 * TENSOR_MB, f"dcp_to_hf (release) grew RSS by {growth:.0f} MB for a {model_mb} MB model"

    # a training checkpoint packs all tensors into one file per rank: loaded per output shard
    module = torch.nn.Module()
    module.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(NUM_TENSORS))
    for i, layer in enumerate(module.layers):
        layer.weight = torch.nn.Parameter(tensors[f"layers.{i}.weight"])
    save_checkpoint(tmp_path / "train", 1, model=module)
    del module
    growth = _measure("dcp_to_hf", tmp_path / "train", tmp_path / "out2", hf)
    # one output shard of 2 tensors loaded, its file being serialised (2 more), one tensor in flight; plus up to 1 MB
    # of heap (allocations below the pinned 1 MB mmap threshold)
    assert growth < 5 * TENSOR_MB + 1, f"dcp_to_hf (packed) grew RSS by {growth:.0f} MB for a {model_mb} MB model"


if __name__ == "__main__":
    _child(*sys.argv[1:5])
