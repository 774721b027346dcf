"""Check every attention backend of this machine against a CPU SDPA reference: the first thing to run on a new cluster.

    uv run python tools/probe/vision_attention.py                   # the device found (CUDA, NPU, else CPU)
    uv run python tools/probe/vision_attention.py --device cpu --dtype fp32 --trials 5

For each backend of `mmfsdp.model.attention` that resolves on the device (sdpa, eager,
flash_attention_2 where flash-attn / torch_npu is installed; the others are listed as
unavailable with the reason) two checks run on random inputs, `--trials` times each:

- `vision`: a small random Pixtral vision tower (`PixtralVisionModel`, with mmfsdp's
  per-image attention hook, `mmfsdp.model.families.mistral3.vision`) takes a batch of several images of
  different sizes, flattened into one sequence, on the device in `--dtype`. The reference
  runs each image *alone* through the same weights on the CPU in fp32 with plain SDPA, so a
  patch that attends to another image's patches shows up as a difference;
- `varlen_causal` / `varlen_full`: the backend's attention function is called directly with
  packed sequences of random lengths (`cu_seq_lens_q/k`, `max_length_q/k`, grouped-query
  heads), causal (the decoder) and not (the vision tower). The reference is SDPA on the CPU
  in fp32, one sequence at a time.

The worst absolute difference over the trials is printed per backend and check, relative to
the reference's largest magnitude, against a tolerance per dtype (fp32 1e-4, bf16 / fp16
3e-2). The last line is one JSON object: `device`, `dtype`, `backends` (per backend either
`{"vision": .., "varlen_causal": .., "varlen_full": .., "ok": ..}` or `{"unavailable": reason}`),
`worst` and `ok`. Exit status 1 when any available backend is over tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import PixtralVisionConfig, PixtralVisionModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mmfsdp.config import ConfigError
from mmfsdp.model.attention import attention_backend_names, resolve_attention_backend
from mmfsdp.model.families.mistral3.vision import install_per_image_attention
from mmfsdp.parallel import detect_device_type
from mmfsdp.parallel.dtypes import DTYPES

_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 3e-2}
_CHECKS = ("vision", "varlen_causal", "varlen_full")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda", "npu"),
        default="auto",
        help="device to probe (default: auto = the accelerator found, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="compute dtype on the device (default: fp32 on cpu, bf16 on an accelerator)",
    )
    parser.add_argument(
        "--backends", default="all", help="comma-separated backend names to probe (default: all registered)"
    )
    parser.add_argument("--trials", type=int, default=3, help="random batches per check (default: 3)")
    parser.add_argument("--num-images", type=int, default=3, help="images per vision batch (default: 3)")
    parser.add_argument(
        "--patch-size", type=int, default=14, help="vision patch size in pixels, Pixtral's is 14 (default: 14)"
    )
    parser.add_argument("--max-patches", type=int, default=12, help="largest image side in patches (default: 12)")
    parser.add_argument("--num-sequences", type=int, default=4, help="packed sequences per varlen batch (default: 4)")
    parser.add_argument("--max-seq-len", type=int, default=96, help="longest packed sequence in tokens (default: 96)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return parser


def _device_type(choice: str) -> str:
    return detect_device_type() if choice == "auto" else choice


def _import_npu(device_type: str) -> None:
    if device_type == "npu":
        import torch_npu  # noqa: F401  registers the npu device


# -- vision tower ---------------------------------------------------------------------------------


def _vision_config(patch_size: int, max_patches: int) -> PixtralVisionConfig:
    return PixtralVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=16,
        patch_size=patch_size,
        image_size=patch_size * max_patches,
        num_channels=3,
        hidden_act="silu",
        initializer_range=0.2,  # large random weights: attention, not the residual, dominates the output
    )


def _vision_tower(config: PixtralVisionConfig, hf_name: str, per_image: bool, state: dict | None) -> PixtralVisionModel:
    tower = PixtralVisionModel._from_config(config, attn_implementation=hf_name, dtype=torch.float32)
    if state is not None:
        tower.load_state_dict(state)
    if per_image:
        install_per_image_attention(tower)
    return tower.eval()


def _random_images(
    gen: torch.Generator, num_images: int, patch_size: int, max_patches: int
) -> tuple[torch.Tensor, list[list[int]]]:
    sides = torch.randint(1, max_patches + 1, (num_images, 2), generator=gen)
    sides[0] = max_patches  # one image fills the padded canvas
    sizes = [[int(h) * patch_size, int(w) * patch_size] for h, w in sides]
    edge = max_patches * patch_size
    pixels = torch.zeros(num_images, 3, edge, edge)
    for i, (h, w) in enumerate(sizes):
        pixels[i, :, :h, :w] = torch.randn(3, h, w, generator=gen)
    return pixels, sizes


@torch.no_grad()
def _vision_diff(
    hf_name: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace, gen: torch.Generator
) -> float:
    config = _vision_config(args.patch_size, args.max_patches)
    reference = _vision_tower(config, "sdpa", per_image=False, state=None)
    tested = _vision_tower(config, hf_name, per_image=True, state=reference.state_dict()).to(device=device, dtype=dtype)
    worst = 0.0
    for _ in range(args.trials):
        pixels, sizes = _random_images(gen, args.num_images, args.patch_size, args.max_patches)
        expected = torch.cat(
            [
                reference(pixels[i : i + 1, :, :h, :w], image_sizes=[[h, w]]).last_hidden_state[0]
                for i, (h, w) in enumerate(sizes)
            ]
        )
        got = tested(
            pixels.to(device=device, dtype=dtype), image_sizes=torch.tensor(sizes, device=device)
        ).last_hidden_state[0]
        worst = max(worst, _relative_max_diff(got, expected))
    return worst


# -- varlen attention function --------------------------------------------------------------------


def _attention_module(hf_name: str, causal: bool, num_kv_groups: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_causal = causal
    module.num_key_value_groups = num_kv_groups
    module.layer_idx = 0
    module.config = SimpleNamespace(_attn_implementation=hf_name)
    return module.eval()


def _sdpa_reference(q_HSD: torch.Tensor, k_KSD: torch.Tensor, v_KSD: torch.Tensor, causal: bool) -> torch.Tensor:
    groups = q_HSD.shape[0] // k_KSD.shape[0]
    out_HSD = F.scaled_dot_product_attention(
        q_HSD, k_KSD.repeat_interleave(groups, 0), v_KSD.repeat_interleave(groups, 0), is_causal=causal
    )
    return out_HSD.transpose(0, 1)  # [S, H, D]


@torch.no_grad()
def _varlen_diff(
    hf_name: str, device: torch.device, dtype: torch.dtype, causal: bool, args: argparse.Namespace, gen: torch.Generator
) -> float:
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    attention = ALL_ATTENTION_FUNCTIONS[hf_name]
    module = _attention_module(hf_name, causal, num_heads // num_kv_heads)
    worst = 0.0
    for _ in range(args.trials):
        lengths = torch.randint(1, args.max_seq_len + 1, (args.num_sequences,), generator=gen).tolist()
        total = sum(lengths)
        q_BHTD = torch.randn(1, num_heads, total, head_dim, generator=gen)
        k_BKTD = torch.randn(1, num_kv_heads, total, head_dim, generator=gen)
        v_BKTD = torch.randn(1, num_kv_heads, total, head_dim, generator=gen)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        expected_THD = torch.cat(
            [
                _sdpa_reference(q_BHTD[0, :, a:b], k_BKTD[0, :, a:b], v_BKTD[0, :, a:b], causal)
                for a, b in zip(starts, starts[1:])
            ]
        )
        cu_seq_lens = torch.tensor(starts, dtype=torch.int32, device=device)
        on_device = [t.to(device=device, dtype=dtype) for t in (q_BHTD, k_BKTD, v_BKTD)]
        out_BTHD = attention(
            module,
            *on_device,
            None,
            scaling=head_dim**-0.5,
            dropout=0.0,
            is_causal=causal,
            cu_seq_lens_q=cu_seq_lens,
            cu_seq_lens_k=cu_seq_lens,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        )[0]
        worst = max(worst, _relative_max_diff(out_BTHD.reshape(total, num_heads, head_dim), expected_THD))
    return worst


def _relative_max_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |got - expected| over the largest |expected| (both on the CPU in fp32)."""
    got = got.detach().to("cpu", torch.float32)
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


# -- main ------------------------------------------------------------------------------------------


def probe(args: argparse.Namespace) -> dict:
    device_type = _device_type(args.device)
    _import_npu(device_type)
    dtype_name = args.dtype or ("fp32" if device_type == "cpu" else "bf16")
    dtype, tolerance = DTYPES[dtype_name], _TOLERANCE[dtype_name]
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    names = (
        attention_backend_names()
        if args.backends == "all"
        else [n.strip() for n in args.backends.split(",") if n.strip()]
    )
    results: dict[str, dict] = {}
    worst = 0.0
    for name in names:
        try:
            backend = resolve_attention_backend(name, device_type)
        except ConfigError as err:
            results[name] = {"unavailable": str(err).split(": ", 1)[-1]}
            continue
        gen = torch.Generator().manual_seed(args.seed)
        try:
            diffs = {
                "vision": _vision_diff(backend.hf_name, device, dtype, args, gen),
                "varlen_causal": _varlen_diff(backend.hf_name, device, dtype, True, args, gen),
                "varlen_full": _varlen_diff(backend.hf_name, device, dtype, False, args, gen),
            }
        except Exception as err:  # a broken kernel is a finding of the probe, not a crash of it
            results[name] = {"error": f"{type(err).__name__}: {err}".splitlines()[0], "ok": False}
            continue
        results[name] = {**diffs, "ok": max(diffs.values()) <= tolerance}
        worst = max(worst, *diffs.values())
    ok = all(r.get("ok", True) for r in results.values()) and any(
        "ok" in r and "error" not in r for r in results.values()
    )
    return {
        "device": str(device),
        "dtype": dtype_name,
        "tolerance": tolerance,
        "backends": results,
        "worst": worst,
        "ok": ok,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.trials < 1 or args.num_images < 1 or args.num_sequences < 1 or args.max_patches < 1 or args.max_seq_len < 1:
        print(
            "error: --trials, --num-images, --num-sequences, --max-patches and --max-seq-len must be positive",
            file=sys.stderr,
        )
        return 2
    torch.manual_seed(args.seed)
    summary = probe(args)
    where = f"device {summary['device']}, dtype {summary['dtype']}"
    print(f"{where}, tolerance {summary['tolerance']:g} (max |diff| / max |reference|)")
    print(f"{'backend':<20}" + "".join(f"{c:>16}" for c in _CHECKS) + "  result")
    for name, result in summary["backends"].items():
        if "unavailable" in result:
            print(f"{name:<20}  unavailable: {result['unavailable']}")
        elif "error" in result:
            print(f"{name:<20}  FAILED: {result['error']}")
        else:
            print(
                f"{name:<20}"
                + "".join(f"{result[c]:>16.3e}" for c in _CHECKS)
                + ("  ok" if result["ok"] else "  OVER TOLERANCE")
            )
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
