"""Per-rank peak memory of one training step, LoRA vs full fine-tune of the same model, on FSDP2 processes.

    uv run python tools/bench/lora_memory.py                      # 2 CPU processes, a ~470 MB Mistral3 (fp32)
    uv run python tools/bench/lora_memory.py --rank 16 --hidden 1024 --layers 12
    uv run python tools/bench/lora_memory.py --smoke                  # the smallest run (CI): hidden 64, 2 layers

Each of `--nproc` gloo ranks builds the same random Mistral3 (`mmfsdp.model`'s family class: the tiny Pixtral
tower and a Mistral decoder of `--layers` x `--hidden`, vocabulary `--vocab`, fp32), once as it is and once with
`training.lora` (rank `--rank` on every decoder attention and MLP projection, `mmfsdp.model.apply_lora`), and
puts it through the trainer's own steps: `entry.parallelize` (FSDP2 over each decoder layer, the embedding and
`lm_head`, default plan) and `build_optimizer` (AdamW over the trainable parameters). A first step creates the
AdamW state; the second is measured: forward + backward of a `--batch` x `--seq-len` batch of random tokens
(HF `labels=` loss), AdamW step, gradients freed.

Peak memory is the CPU stand-in for an accelerator's `max_memory_allocated`:
`mmfsdp.parallel.tensor_memory.TensorMemory`, the most tensor bytes alive at once during the step on the rank, counting the
state it starts with (parameter shards, AdamW moments) and everything the step allocates (all-gathered
parameters while they are gathered, activations, gradients). FSDP2 frees a gathered layer by resizing its storage
to 0 bytes and gathers into the same storage again later; the counter follows those resizes and tells storages
apart by their `StorageImpl`, so the figure is the same in every run (before 2026-12-05 it counted each gathered
parameter from its first gather to the end and keyed storages by address, which gave 0.55-0.60 from run to run).
Both variants are measured in the same run; the last line is one JSON
object with each variant's largest per-rank peak and `lora_over_full_peak` (target <= 0.5).
"""

from __future__ import annotations

import json
import time

from _smoke import doc_parser, parse_args

from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

RANK_MODULES = ("transformers", "peft", "mmfsdp.model.all_families", "mmfsdp.model.lora", "mmfsdp.train.trainer")
"""What every rank imports, once in the process the ranks fork from (`preload_for_ranks`)."""
DEFAULTS = dict(nproc=2, hidden=768, layers=8, vocab=32000, rank=8, batch=1, seq_len=256)
"""The measured sizes (the flags' defaults): the ones `lora_over_full_peak` <= 0.5 is claimed for."""
TARGETS = [
    f"model.language_model.layers.{{*}}.{part}"
    for part in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def _step(model, optimizer, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _measure(rank: int, world_size: int, args: dict, lora: bool) -> dict:
    import torch

    from mmfsdp.model import LoraConfig, apply_lora, get_model_entry, init_lora_adapters
    from mmfsdp.parallel import MeshPlan, ParallelConfig, build_parallel_dims
    from mmfsdp.parallel.tensor_memory import TensorMemory, state_tensors
    from mmfsdp.train.config import TrainingConfig
    from mmfsdp.train.trainer import build_optimizer

    entry = get_model_entry("mistral3")
    hidden, heads = args["hidden"], max(args["hidden"] // 64, 1)
    config = entry.testkit.tiny_config(
        vocab_size=args["vocab"],
        text_config=dict(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=args["layers"],
            num_attention_heads=heads,
            num_key_value_heads=max(heads // 4, 1),
            head_dim=hidden // heads,
            max_position_embeddings=max(args["seq_len"], 1024),
        ),
    )
    torch.manual_seed(0)
    model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    num_params = sum(p.numel() for p in model.parameters())
    lora_cfg = LoraConfig(enable=True, rank=args["rank"], alpha=2.0 * args["rank"], target_modules=TARGETS)
    if lora:
        apply_lora(model, lora_cfg, entry)
    parallel = ParallelConfig()
    entry.parallelize(model, parallel, build_parallel_dims(MeshPlan.from_config(parallel, world_size), "cpu"))
    if lora:
        init_lora_adapters(model, lora_cfg, seed=0)
    model.train()
    optimizer = build_optimizer(model, TrainingConfig(lr=1e-4), "cpu")
    gen = torch.Generator().manual_seed(1 + rank)
    input_ids = torch.randint(0, args["vocab"], (args["batch"], args["seq_len"]), generator=gen)
    _step(model, optimizer, input_ids[:, :8])  # creates the AdamW state (its size does not depend on the tokens)
    started = time.perf_counter()
    with TensorMemory("cpu") as mem:
        mem.hold(state_tensors(model, optimizer))
        start = mem.current  # (DTensor.to_local is itself dispatched: hold's return value misses those shards)
        loss = _step(model, optimizer, input_ids)
    return {
        "peak_mib": mem.peak / 2**20,
        "state_mib": start / 2**20,
        "loss": loss,
        "params_m": num_params / 1e6,
        "trainable_m": sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6,  # DTensor: global numel
        "seconds": time.perf_counter() - started,
    }


def _both(rank: int, world_size: int, args: dict) -> dict:
    return {"full": _measure(rank, world_size, args, lora=False), "lora": _measure(rank, world_size, args, lora=True)}


def main() -> None:
    parser = doc_parser(__doc__)
    parser.add_argument("--nproc", type=int, default=DEFAULTS["nproc"], help="FSDP2 processes (default: 2)")
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="decoder hidden size (default: 768)")
    parser.add_argument("--layers", type=int, default=DEFAULTS["layers"], help="decoder layers (default: 8)")
    parser.add_argument("--vocab", type=int, default=DEFAULTS["vocab"], help="vocabulary size (default: 32000)")
    parser.add_argument("--rank", type=int, default=DEFAULTS["rank"], help="LoRA rank (default: 8; alpha = 2 x rank)")
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="sequences per rank (default: 1)")
    parser.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens per sequence (default: 256)")
    args = vars(parse_args(parser, hidden=64, layers=2, vocab=512, seq_len=32))
    preload_for_ranks(*RANK_MODULES)
    ranks = run_distributed(_both, args["nproc"], args, timeout=3600)
    peaks = {name: max(r[name]["peak_mib"] for r in ranks) for name in ("full", "lora")}
    first = ranks[0]
    print(
        f"{args['nproc']} processes, Mistral3 {first['full']['params_m']:.1f}M parameters "
        f"({first['full']['params_m'] * 4:.0f} MB fp32), LoRA rank {args['rank']}, {args['batch']}x{args['seq_len']} tokens per rank"
    )
    print(f"{'variant':<6} {'trainable M':>12} {'state MiB':>10} {'peak MiB':>10} {'step s':>8} {'loss':>10}")
    for name in ("full", "lora"):
        r = first[name]
        print(
            f"{name:<6} {r['trainable_m']:>12.2f} {r['state_mib']:>10.1f} {peaks[name]:>10.1f} {r['seconds']:>8.2f} {r['loss']:>10.4f}"
        )
    print(
        json.dumps(
            {
                "nproc": args["nproc"],
                "params_m": round(first["full"]["params_m"], 1),
                "rank": args["rank"],
                "full_peak_mib": round(peaks["full"], 1),
                "lora_peak_mib": round(peaks["lora"], 1),
                "full_state_mib": round(first["full"]["state_mib"], 1),
                "lora_state_mib": round(first["lora"]["state_mib"], 1),
                "lora_over_full_peak": round(peaks["lora"] / peaks["full"], 4),
            }
        )
    )


if __name__ == "__main__":
    main()
