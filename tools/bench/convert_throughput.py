"""Throughput of `mm-convert` hf_to_dcp and dcp_to_hf relative to copying the same files with `cp -r`.

Builds a synthetic HF safetensors checkpoint (`--size_gb`, default ~1 GB, fp32
and bf16 tensors in several shards), then times, in the same run:

- `cp -r HF`        vs  hf_to_dcp(HF -> DCP)
- `cp -r DCP/release` vs dcp_to_hf(DCP -> OUT)

Each is repeated `--repeats` times and the fastest run is kept (the machine may
be shared). The ratio is cp_time / convert_time, i.e. conversion throughput as
a fraction of cp's; both read from the page cache and write to the same
filesystem. The last line is one JSON object with `hf_to_dcp_vs_cp` and
`dcp_to_hf_vs_cp` (target >= 0.5 each).

    uv run python tools/bench/convert_throughput.py [--size_gb 1.0] [--workdir DIR]
    uv run python tools/bench/convert_throughput.py --smoke     # the smallest run (CI): ~4 MB, hidden 256
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _smoke import parse_args
from safetensors.torch import save_file

from mmfsdp.ckpt import dcp_to_hf, hf_to_dcp

ADAPTER = "identity"
"""The synthetic checkpoint's `model_type` has no family: its tensor names are kept as they are."""


def make_hf_checkpoint(path: Path, size_bytes: int, num_shards: int, hidden: int = 2048) -> int:
    """Write layers of (fp32 attention, bf16 mlp, fp32 norm) tensors until `size_bytes`; return bytes written."""
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    while total < size_bytes:
        for name, shape, dtype in (("attn.weight", (hidden, hidden), torch.float32),
                                   ("mlp.weight", (4 * hidden, hidden), torch.bfloat16),
                                   ("norm.weight", (hidden,), torch.float32)):
            tensor = torch.randn(shape, generator=gen).to(dtype)
            tensors[f"model.layers.{layer}.{name}"] = tensor
            total += tensor.nbytes
        layer += 1
    path.mkdir(parents=True)
    names = list(tensors)
    per_shard = -(-len(names) // num_shards)
    weight_map = {}
    for index in range(num_shards):
        filename = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[index * per_shard:(index + 1) * per_shard]}
        save_file(part, path / filename, metadata={"format": "pt"})
        weight_map.update({name: filename for name in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"model_type": "synthetic", "hidden_size": hidden, "num_hidden_layers": layer}))
    return total


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_of(repeats: int, run, cleanup) -> float:
    times = []
    for _ in range(repeats):
        cleanup()
        times.append(timed(run))
    cleanup()
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size_gb", type=float, default=1.0, help="checkpoint size in GB (default 1.0)")
    parser.add_argument("--shards", type=int, default=4, help="number of HF shards (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest is kept (default 3)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the layers' tensors (default 2048)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a new temporary directory)")
    args = parse_args(parser, size_gb=0.004, shards=2, repeats=1, hidden=256)
    torch.set_num_threads(1)

    root = Path(tempfile.mkdtemp(prefix="mm-convert-bench-", dir=args.workdir))
    try:
        hf, dcp_dir, out, copy = root / "hf", root / "dcp", root / "out", root / "copy"
        total = make_hf_checkpoint(hf, int(args.size_gb * 1e9), args.shards, args.hidden)
        print(f"checkpoint: {total / 1e9:.2f} GB in {args.shards} shards at {hf}")

        def rm(*paths: Path):
            return lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths]

        def cp(src: Path):
            return lambda: subprocess.run(["cp", "-r", str(src), str(copy)], check=True)

        cp_hf = best_of(args.repeats, cp(hf), rm(copy))
        to_dcp = best_of(args.repeats, lambda: hf_to_dcp(hf, dcp_dir, adapter=ADAPTER, progress=False), rm(dcp_dir))
        hf_to_dcp(hf, dcp_dir, adapter=ADAPTER, progress=False)
        cp_dcp = best_of(args.repeats, cp(dcp_dir / "release"), rm(copy))
        to_hf = best_of(args.repeats, lambda: dcp_to_hf(dcp_dir, out, hf, adapter=ADAPTER, progress=False), rm(out))

        gb = total / 1e9
        for name, seconds in (("cp -r HF", cp_hf), ("hf_to_dcp", to_dcp), ("cp -r DCP", cp_dcp), ("dcp_to_hf", to_hf)):
            print(f"{name:>10}: {seconds:6.2f} s  {gb / seconds:6.2f} GB/s")
        result = {
            "size_gb": round(gb, 3),
            "cp_hf_s": round(cp_hf, 3), "hf_to_dcp_s": round(to_dcp, 3),
            "cp_dcp_s": round(cp_dcp, 3), "dcp_to_hf_s": round(to_hf, 3),
            "hf_to_dcp_vs_cp": round(cp_hf / to_dcp, 3),
            "dcp_to_hf_vs_cp": round(cp_dcp / to_hf, 3),
        }
        print(json.dumps(result))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
