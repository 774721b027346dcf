"""Per-rank peak memory of a DPO step against an SFT step on the same model and pairs, through the real trainer.

    uv run python tools/bench/dpo_memory.py                    # 2 CPU processes, Qwen3-VL decoder 512 x 6 layers
    uv run python tools/bench/dpo_memory.py --hidden 1024 --layers 8 --pairs 8
    uv run python tools/bench/dpo_memory.py --smoke            # the smallest run (CI): hidden 64, 2 layers

Each of `--nproc` gloo ranks builds `mmfsdp.train.Trainer` from the qwen3vl-tiny example's config with a larger
random-init Qwen3-VL (decoder `--hidden` x `--layers`, the example's vision tower and tokenizer) on the synthetic
shapes pairs (chosen names the shape's true colour, rejected a wrong one; 30 % text-only), `--pairs` pairs per
rank per micro-batch, padding-free, and runs five variants:

- `sft_lora` / `dpo_lora`: LoRA (rank 8 on the decoder's attention and MLP projections); DPO's reference is the same
  model with its adapters off (no second copy); SFT trains on the same micro-batches (both answers of each pair);
- `sft_full` / `dpo_precomputed`: full fine-tuning; DPO reads the reference's log-probabilities precomputed before
  the first step (`training.dpo.precompute_ref_logps`), so no reference model is in memory;
- `dpo_frozen`: full fine-tuning with the frozen FSDP2-sharded reference copy (its shards count in its peak).

A first step creates the AdamW state; the second is measured with `mmfsdp.parallel.tensor_memory.TensorMemory`
(the most tensor bytes alive at once on the rank, counting the state the step starts with: parameter shards,
the reference's shards, AdamW moments). The last line is one JSON object with each variant's largest per-rank
peak and the ratios `dpo_lora_over_sft_lora` (target <= 1.15) and `dpo_precomputed_over_sft_full` (target <= 1.1).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from _smoke import doc_parser, parse_args

from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
RANK_MODULES = ("transformers", "peft", "mmfsdp.model.all_families", "mmfsdp.train.trainer")
VARIANTS = {
    "sft_lora": {"training.stage": "sft", "training.lora.enable": "true"},
    "dpo_lora": {"training.stage": "dpo", "training.lora.enable": "true"},
    "sft_full": {"training.stage": "sft"},
    "dpo_precomputed": {"training.stage": "dpo", "training.dpo.precompute_ref_logps": "true"},
    "dpo_frozen": {"training.stage": "dpo"},
}
TARGETS = {"dpo_lora_over_sft_lora": 1.15, "dpo_precomputed_over_sft_full": 1.1}


def _model_dir(out: Path, hidden: int, layers: int) -> Path:
    """The example's assets with a larger decoder (`hidden`, `layers`; heads of 64, GQA 2)."""
    model = out / "model"
    shutil.copytree(ASSETS, model)
    config = json.loads((model / "config.json").read_text())
    heads = max(hidden // 64, 1)
    config["text_config"].update(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                 num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=hidden // heads)
    config["vision_config"]["out_hidden_size"] = hidden
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def add_model_args(parser) -> None:
    """`--nproc` and the decoder's size (`_model_dir`), shared with `grpo_step.py`."""
    parser.add_argument("--nproc", type=int, default=2, help="FSDP2 processes (default: 2)")
    parser.add_argument("--hidden", type=int, default=512, help="decoder hidden size (default: 512)")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (default: 6)")


def _overrides(args: dict, variant: str) -> list[str]:
    work = Path(args["work"])
    items = {
        "model.model_name_or_path": work / "model",
        "data.dataset_param.preprocess_parameters.model_name_or_path": work / "model",
        "data.dataset_param.dataset_type": "synthetic_shapes_pairs",
        "data.dataset_param.attr.ranking": "true",
        "data.dataset_param.basic_parameters.dataset_dir": work / "data",
        "data.dataset_param.basic_parameters.cache_dir": work / "cache",
        "data.dataset_param.synthetic.num_train": 4 * args["pairs"] * args["nproc"],
        "data.dataset_param.synthetic.num_eval": 2,
        "training.micro_batch_size": args["pairs"],
        "training.train_iters": 2,
        "training.output_dir": work / "out" / variant,
        "training.lora.rank": 8,
        "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        "parallel.heartbeat_timeout_s": 3600,
        **VARIANTS[variant],
    }
    return [f"{key}={value}" for key, value in items.items()]


def _measure(rank: int, world_size: int, args: dict) -> dict:
    import torch

    from mmfsdp.parallel.tensor_memory import TensorMemory, state_tensors
    from mmfsdp.train.config import load_config
    from mmfsdp.train.dpo import FrozenReference
    from mmfsdp.train.trainer import Trainer

    results = {}
    for variant in VARIANTS:
        trainer = Trainer(load_config(str(CONFIG), _overrides(args, variant)), "cpu")
        trainer.train_step()  # creates the AdamW state (and, precomputed, the reference table before it)
        trainer.step += 1
        held = state_tensors(trainer.model, trainer.optimizer)
        reference = getattr(trainer.objective, "reference", None)
        if isinstance(reference, FrozenReference):
            held += state_tensors(reference.model)
        started = time.perf_counter()
        with TensorMemory("cpu") as mem:
            mem.hold(held)
            start = mem.current
            trainer.train_step()
        results[variant] = {"peak_mib": mem.peak / 2**20, "state_mib": start / 2**20,
                            "seconds": time.perf_counter() - started,
                            "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6}
        trainer.close()
        del trainer
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return results


def main() -> None:
    parser = doc_parser(__doc__)
    add_model_args(parser)
    parser.add_argument("--pairs", type=int, default=8, help="pairs per rank per micro-batch (default: 8)")
    args = vars(parse_args(parser, hidden=64, layers=2, pairs=2))
    with tempfile.TemporaryDirectory(prefix="dpo_memory_") as work:
        args["work"] = work
        _model_dir(Path(work), args["hidden"], args["layers"])
        from mmfsdp.data import prepare_dataset
        from mmfsdp.train.config import load_config

        prepare_dataset(load_config(str(CONFIG), _overrides(args, "sft_full")).data)
        preload_for_ranks(*RANK_MODULES)
        ranks = run_distributed(_measure, args["nproc"], args, timeout=3600)
    peaks = {name: max(r[name]["peak_mib"] for r in ranks) for name in VARIANTS}
    first = ranks[0]
    print(f"{args['nproc']} processes, Qwen3-VL {first['sft_full']['params_m']:.1f}M parameters, decoder "
          f"{args['hidden']} x {args['layers']}, {args['pairs']} pairs per rank per micro-batch")
    print(f"{'variant':<16} {'state MiB':>10} {'peak MiB':>10} {'step s':>8}")
    for name in VARIANTS:
        print(f"{name:<16} {first[name]['state_mib']:>10.1f} {peaks[name]:>10.1f} {first[name]['seconds']:>8.2f}")
    ratios = {
        "dpo_lora_over_sft_lora": round(peaks["dpo_lora"] / peaks["sft_lora"], 4),
        "dpo_precomputed_over_sft_full": round(peaks["dpo_precomputed"] / peaks["sft_full"], 4),
        "dpo_frozen_over_sft_full": round(peaks["dpo_frozen"] / peaks["sft_full"], 4),
    }
    print(json.dumps({
        "nproc": args["nproc"], "hidden": args["hidden"], "layers": args["layers"], "pairs": args["pairs"],
        **{f"{name}_peak_mib": round(peak, 1) for name, peak in peaks.items()},
        **ratios,
        "targets": TARGETS,
        "targets_met": all(ratios[key] <= target for key, target in TARGETS.items()),
    }))


if __name__ == "__main__":
    main()
