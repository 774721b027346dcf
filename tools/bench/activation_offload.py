"""Device-side saved-activation bytes (and, on an accelerator, peak memory) of one fwd+bwd, with and without offload.

    uv run python tools/bench/activation_offload.py                       # CPU, a small Mistral decoder
    uv run python tools/bench/activation_offload.py --recompute           # offload on top of recompute
    uv run python tools/bench/activation_offload.py --smoke               # the smallest run (CI)
    uv run python tools/bench/activation_offload.py --device cuda --dtype bf16 --hidden 4096 --layers 8 --seq-len 8192

One process builds a random Mistral3 (`mmfsdp.model`'s `Mistral3ForConditionalGenerationFSDP`,
text path, `--layers` decoder layers of `--hidden`) and runs one forward + backward of a
`--batch` × `--seq-len` batch twice from the same weights and inputs: plain, and with
`features.activation_offload_plan.apply_modules = model.language_model.layers.{*}`
(`mmfsdp.parallel.apply_activation_offload`), both optionally with the decoder layers
checkpointed first (`--recompute`, as the trainer orders them).

- `saved` counts the bytes of the tensors autograd keeps on the device for backward (unique
  storages, parameters excluded): an outer `saved_tensors_hooks` sees everything saved outside
  the offloaded layers, and inside them (where the offload hooks take precedence) the tensors
  the offload leaves where they are. On the CPU the offload is told to treat CPU tensors as
  device tensors (`ActivationOffload(include_cpu=True)`), so the whole copy path runs and the
  bytes it moves are exactly those a device would no longer hold;
- `peak` (accelerators only): the rise of the allocator's peak over the step
  (`max_memory_allocated` after, with the peak reset before, minus the allocation before).

The last line is one JSON object: `saved_mib_plain`, `saved_mib_offload`, `saved_ratio`
(offload over plain), `offloaded_mib` (bytes the offload copied to the host, counted per saved
tensor, so a storage saved twice counts twice), `loss_rel_diff` (the two losses must agree) and, on an
accelerator, `peak_mib_plain`, `peak_mib_offload`, `peak_ratio`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from _smoke import parse_args

from mmfsdp.model import get_model_entry
from mmfsdp.parallel import ActivationOffload, apply_activation_checkpointing, apply_activation_offload
from mmfsdp.parallel import detect_device_type
from mmfsdp.parallel.dtypes import DTYPES

OFFLOAD_PATTERN = "model.language_model.layers.{*}"
_DTYPES = {name: DTYPES[name] for name in ("fp32", "bf16")}


class _CountingOffload(ActivationOffload):
    """The real offload hooks, also recording the storages they leave on the device (parameters excluded)."""

    def __init__(self, kept: dict[int, int], **kwargs):
        super().__init__(**kwargs)
        self.kept_storages = kept

    def _pack(self, skip, tensor):
        packed = super()._pack(skip, tensor)
        if packed is tensor:
            _record(self.kept_storages, tensor, skip)
        return packed


def _record(storages: dict[int, int], tensor: torch.Tensor, params: set[int]) -> None:
    storage = tensor.untyped_storage()
    if isinstance(tensor, torch.nn.Parameter) or storage.data_ptr() in params:
        return
    storages[storage.data_ptr()] = storage.nbytes()


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    entry = get_model_entry("mistral3")
    heads = max(args.hidden // 64, 1)
    config = entry.testkit.tiny_config(
        vocab_size=args.vocab,
        text_config=dict(
            hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
            num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1), head_dim=args.hidden // heads,
            max_position_embeddings=max(args.seq_len, 1024),
        ),
    )
    torch.manual_seed(args.seed)
    model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa", dtype=dtype)
    return model.to(device).train()


def _measure(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, offload: bool) -> dict:
    model = _build(args, device, dtype)
    if args.recompute:
        apply_activation_checkpointing(model, [OFFLOAD_PATTERN])
    saved: dict[int, int] = {}
    counting = None
    if offload:
        counting = _CountingOffload(saved, include_cpu=device.type == "cpu")
        apply_activation_offload(model, [OFFLOAD_PATTERN], offload=counting)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    gen = torch.Generator().manual_seed(args.seed + 1)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    accelerator = getattr(torch, device.type) if device.type != "cpu" else None
    if accelerator is not None:
        accelerator.synchronize()
        accelerator.reset_peak_memory_stats()
        before = accelerator.memory_allocated()

    def pack(tensor):
        _record(saved, tensor, params)
        return tensor

    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    saved_bytes = sum(saved.values())
    loss.backward()
    result = {
        "saved_mib": saved_bytes / 2**20,
        "offloaded_mib": (counting.offloaded_bytes / 2**20) if counting else 0.0,
        "loss": loss.item(),
    }
    if accelerator is not None:
        accelerator.synchronize()
        result["peak_mib"] = (accelerator.max_memory_allocated() - before) / 2**20
    result["seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto",
                        help="device (default: auto = the accelerator found, else cpu)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32", help="model dtype (default: fp32)")
    parser.add_argument("--hidden", type=int, default=256, help="decoder hidden size (default: 256)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default: 1024)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (default: 2)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512)")
    parser.add_argument("--recompute", action="store_true", help="checkpoint the decoder layers too (offload on top)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default: 0)")
    args = parse_args(parser, hidden=64, layers=2, vocab=256, batch=1, seq_len=32)
    device_type = detect_device_type() if args.device == "auto" else args.device
    if device_type == "npu":
        import torch_npu  # noqa: F401  registers the npu device
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    dtype = _DTYPES[args.dtype]

    plain = _measure(args, device, dtype, offload=False)
    offloaded = _measure(args, device, dtype, offload=True)
    print(f"device {device}, {args.dtype}, hidden {args.hidden}, {args.layers} layers, "
          f"{args.batch}x{args.seq_len} tokens, recompute {args.recompute}")
    print(f"{'variant':<10} {'saved MiB':>10} {'moved MiB':>10} {'peak MiB':>10} {'seconds':>8} {'loss':>12}")
    for name, r in (("plain", plain), ("offload", offloaded)):
        peak = f"{r['peak_mib']:>10.1f}" if "peak_mib" in r else f"{'-':>10}"
        sizes = f"{r['saved_mib']:>10.1f} {r['offloaded_mib']:>10.1f} {peak}"
        print(f"{name:<10} {sizes} {r['seconds']:>8.2f} {r['loss']:>12.6f}")
    summary = {
        "device": str(device), "dtype": args.dtype, "recompute": args.recompute,
        "saved_mib_plain": round(plain["saved_mib"], 3), "saved_mib_offload": round(offloaded["saved_mib"], 3),
        "saved_ratio": round(offloaded["saved_mib"] / plain["saved_mib"], 4),
        "offloaded_mib": round(offloaded["offloaded_mib"], 3),
        "loss_rel_diff": abs(offloaded["loss"] - plain["loss"]) / abs(plain["loss"]),
    }
    if "peak_mib" in plain:
        summary.update(peak_mib_plain=round(plain["peak_mib"], 1), peak_mib_offload=round(offloaded["peak_mib"], 1),
                       peak_ratio=round(offloaded["peak_mib"] / plain["peak_mib"], 4))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
