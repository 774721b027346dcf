"""Per-rank vision encoder work under context parallel with vision data parallel, CP = 1, 2, 4.

    uv run python tools/bench/vision_dp.py
    uv run python tools/bench/vision_dp.py --width 256 --depth 4 --repeats 3
    uv run python tools/bench/vision_dp.py --smoke                  # the smallest run (CI): CP 1 and 2, width 64

Each CP size is a fresh set of gloo ranks on the CPU (`run_distributed`), one CP group. Every rank builds
the same Qwen3-VL (random weights; the vision tower `--width` wide and `--depth` deep, DeepStack mergers on
two of its blocks) and receives the same batch of several images of different sizes (`IMAGES`, patch grids).
CP = 1 encodes all of them with the model's `get_image_features`, as every CP rank did before vision DP; at
CP 2 and 4 each rank runs `VisionDataParallel.encode` (`mmfsdp.model.vision_dp`: its cost-balanced share
encoded, the features of every image all-gathered), the code path of the training forward. Per rank and per
repeat, one forward and backward (of the sum of every feature the merge uses) is measured:

- `time`: the process CPU time of the step (`torch.set_num_threads(1)`, so that ranks sharing the cores do
  not inflate each other's figure); the gather and its backward all-reduce are included;
- `bytes`: the bytes of the tensors autograd saves for backward (unique storages, parameters excluded), i.e.
  the vision activations held until backward.

A table goes to stdout; the last line is one JSON object with `time_ratio_cp<N>` and `bytes_ratio_cp<N>`
(the slowest / largest rank over the CP = 1 figure, time as the best of `--repeats`) and
`vision_ratio_cp<N>`, the larger of the two. The ideal is 1 / CP; the balance of the shares
(`share_cost_cp<N>`: the largest rank's cost model share) bounds it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from _smoke import parse_args

from mmfsdp.model import get_model_entry
from mmfsdp.model.vision_dp import VisionDataParallel, assign_media, media_costs
from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

RANK_MODULES = ("transformers", "mmfsdp.model.training_forward", "mmfsdp.model.families.qwen3_vl.model")
"""What every rank imports, once in the process the ranks fork from (`preload_for_ranks`)."""

IMAGES = [(32, 32), (16, 16), (24, 32), (32, 16), (16, 24), (24, 24), (16, 16), (32, 24), (8, 16), (24, 16)]
"""Patch grids (h, w) of the batch: 128 to 1,024 patches per image, 5,056 in all (merged 2×2 into 1,264 tokens)."""


def _config(width: int, depth: int):
    vision = dict(
        depth=depth, hidden_size=width, intermediate_size=2 * width, num_heads=width // 32,
        out_hidden_size=128, deepstack_visual_indexes=[0, depth - 1], num_position_embeddings=1024,
    )
    return get_model_entry("qwen3_vl").testkit.tiny_config(vision_config=vision, text_config={"hidden_size": 128})


def _batch(config):
    vision = config.vision_config
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    generator = torch.Generator().manual_seed(0)
    grids = torch.tensor([[1, h, w] for h, w in IMAGES])
    pixel_values = torch.randn(int(grids.prod(-1).sum()), patch_dim, generator=generator)
    return {"pixel_values": pixel_values, "image_grid_thw": grids, "return_dict": True}


def _saved_bytes_hooks(params: set[int], seen: dict[int, int]):
    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _rank(rank: int, world_size: int, width: int, depth: int, repeats: int) -> dict:
    # imported here: it pulls in transformers, which the parent never needs (the ranks have it preloaded)
    from mmfsdp.model.training_forward import vision_features

    torch.set_num_threads(1)
    config = _config(width, depth)
    torch.manual_seed(0)
    model = get_model_entry("qwen3_vl").model_class._from_config(config, attn_implementation="sdpa")
    base = model.model
    call = _batch(config)
    if world_size == 1:
        def encode():
            return base.get_image_features(**call)
    else:
        vision_dp = VisionDataParallel(model, dist.group.WORLD, rank, world_size, config.vision_config.hidden_size)

        def encode():
            return vision_dp.encode(base.get_image_features, dict(call))

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    times, saved = [], {}
    for _ in range(repeats + 1):  # the first is a warm-up
        if world_size > 1:
            dist.barrier()
        model.zero_grad(set_to_none=True)
        saved = {}
        start = time.process_time()
        with _saved_bytes_hooks(params, saved):
            output = encode()
        sum(feature.sum() for feature in vision_features(output)).backward()
        times.append(time.process_time() - start)
    return {"time": min(times[1:]), "bytes": sum(saved.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256, help="vision hidden size")
    parser.add_argument("--depth", type=int, default=4, help="vision blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cp-sizes", default="1,2,4", help="comma-separated; must start with 1 (default: 1,2,4)")
    args = parse_args(parser, width=64, depth=2, repeats=1, cp_sizes="1,2")
    cp_sizes = [int(x) for x in args.cp_sizes.split(",")]
    if cp_sizes[0] != 1:
        parser.error("--cp-sizes must start with 1 (the baseline)")
    patches = [h * w for h, w in IMAGES]
    costs = media_costs(patches, args.width)
    preload_for_ranks(*RANK_MODULES)
    results, summary = {}, {"images": len(IMAGES), "patches": sum(patches), "width": args.width, "depth": args.depth}
    for cp in cp_sizes:
        per_rank = run_distributed(_rank, cp, args.width, args.depth, args.repeats, timeout=900)
        results[cp] = per_rank
        shares = assign_media(costs, cp)
        share = max(sum(costs[i] for i in s) for s in shares) / sum(costs)
        for rank, result in enumerate(per_rank):
            print(f"cp {cp} rank {rank}: images {shares[rank]}, {result['time'] * 1e3:8.1f} ms CPU, "
                  f"{result['bytes'] / 2**20:7.1f} MiB saved")
        if cp > 1:
            time_ratio = max(r["time"] for r in per_rank) / results[1][0]["time"]
            bytes_ratio = max(r["bytes"] for r in per_rank) / results[1][0]["bytes"]
            summary[f"share_cost_cp{cp}"] = round(share, 3)
            summary[f"time_ratio_cp{cp}"] = round(time_ratio, 3)
            summary[f"bytes_ratio_cp{cp}"] = round(bytes_ratio, 3)
            summary[f"vision_ratio_cp{cp}"] = round(max(time_ratio, bytes_ratio), 3)
    summary["cp1_time_ms"] = round(results[1][0]["time"] * 1e3, 1)
    summary["cp1_saved_mib"] = round(results[1][0]["bytes"] / 2**20, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
