"""One GRPO step, taken apart: generate / reward / train seconds, tokens per second, and its peak memory over SFT's.

    uv run python tools/bench/grpo_step.py                    # 2 CPU processes, Qwen3-VL decoder 512 x 6 layers
    uv run python tools/bench/grpo_step.py --hidden 1024 --layers 8 --prompts 4 --generations 8
    uv run python tools/bench/grpo_step.py --smoke            # the smallest run (CI): hidden 64, 2 layers

Each of `--nproc` gloo ranks builds `mmfsdp.train.Trainer` from the qwen3vl-tiny example's config with a larger
random-init Qwen3-VL (decoder `--hidden` x `--layers`, the example's vision tower and tokenizer; `dpo_memory.py`'s
model) on the synthetic shapes (30 % text-only), padding-free, and runs two variants:

- `grpo`: `training.stage: grpo`, `--prompts` prompts per rank per micro-batch, `--generations` completions each
  (at most `--completion-length` tokens, the hf rollout engine inside the training processes), rewards `accuracy`
  and `format`, β 0 (no reference);
- `sft`: the same model trained on the same rows (prompt and answer) with `--prompts` x `--generations` samples per
  micro-batch: as many sequences as GRPO's training micro-batch holds.

A first step creates the AdamW state; the second is measured. Time: the rollout engine's `generate` and the reward
set's `score` are timed where the objective calls them (wrapped on the instance; the ranks run them in lockstep),
`train` is the rest of the step (forward, backward, optimizer), the three medians over the ranks' `--repeats`
measured steps; tokens/s = the step's trained tokens (rank 0's count of the global batch) / the step's seconds.
Memory: `mmfsdp.parallel.tensor_memory.TensorMemory` over one step (the most tensor bytes alive at once on the rank,
counting the state the step starts with: parameter shards and AdamW moments), each variant's largest rank. The
last line is one JSON object: per variant its seconds, tokens/s and peak, the GRPO split and `grpo_over_sft_peak`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from _smoke import doc_parser, parse_args
from dpo_memory import CONFIG, _model_dir, add_model_args

from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

RANK_MODULES = ("transformers", "datasets", "mmfsdp.model.all_families", "mmfsdp.data.all_families",
                "mmfsdp.train.trainer")


def _overrides(args: dict, variant: str) -> list[str]:
    work = Path(args["work"])
    sequences = args["prompts"] * args["generations"]
    items = {
        "model.model_name_or_path": work / "model",
        "data.dataset_param.preprocess_parameters.model_name_or_path": work / "model",
        "data.dataset_param.dataset_type": "synthetic_shapes",
        "data.dataset_param.basic_parameters.dataset_dir": work / "data",
        "data.dataset_param.basic_parameters.cache_dir": work / "cache",
        "data.dataset_param.synthetic.num_train": 4 * sequences * args["nproc"],
        "data.dataset_param.synthetic.num_eval": 2,
        "training.train_iters": 1 + args["repeats"],
        "training.output_dir": work / "out" / variant,
        "training.log_interval": 1000,
        "parallel.heartbeat_timeout_s": 3600,
    }
    if variant == "grpo":
        items.update({
            "training.stage": "grpo",
            "training.micro_batch_size": args["prompts"],
            "training.grpo.num_generations": args["generations"],
            "training.grpo.max_completion_length": args["completion_length"],
            "training.grpo.reward_funcs": "[accuracy, format]",
            "training.grpo.log_completions_interval": 0,
        })
    else:
        items["training.micro_batch_size"] = sequences
    return [f"{key}={value}" for key, value in items.items()]


class _Timed:
    """Seconds spent in one method of an object, per call (the instance's attribute wraps the bound method)."""

    def __init__(self, owner, name: str):
        self.calls: list[float] = []
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - started)

        setattr(owner, name, timed)

    def since(self, count: int) -> float:
        return sum(self.calls[count:])


def _measure(rank: int, world_size: int, args: dict) -> dict:
    from mmfsdp.parallel.testing import rank_may_start_processes

    with rank_may_start_processes():  # the reward workers
        return {variant: _variant(args, variant) for variant in ("sft", "grpo")}


def _variant(args: dict, variant: str) -> dict:
    """The first step, then `repeats` measured ones (seconds, the split, peak, tokens) of one variant on this rank."""
    from mmfsdp.parallel.tensor_memory import TensorMemory, state_tensors
    from mmfsdp.train.config import load_config
    from mmfsdp.train.step import settle
    from mmfsdp.train.trainer import Trainer

    trainer = Trainer(load_config(str(CONFIG), _overrides(args, variant)), "cpu")
    timers = {}
    if variant == "grpo":
        timers = {"generate": _Timed(trainer.objective.engine, "generate"),
                  "reward": _Timed(trainer.objective.rewards, "score")}
    trainer.train_step()  # creates the AdamW state
    trainer.step += 1
    steps = []
    for _ in range(args["repeats"]):
        counts = {name: len(timer.calls) for name, timer in timers.items()}
        held = state_tensors(trainer.model, trainer.optimizer)
        started = time.perf_counter()
        with TensorMemory("cpu") as mem:
            mem.hold(held)
            result = trainer.train_step()
            settle([result])  # the step's numbers read: its device work done
        seconds = time.perf_counter() - started
        trainer.step += 1
        split = {name: timer.since(counts[name]) for name, timer in timers.items()}
        steps.append({"seconds": seconds, "peak_mib": mem.peak / 2**20, "tokens": int(result.num_tokens), **split})
    params = sum(p.numel() for p in trainer.model.parameters()) / 1e6
    trainer.close()
    return {"steps": steps, "params_m": params}


def _summary(ranks: list[dict], variant: str) -> dict:
    """Medians over every rank's measured steps (a step's time is its slowest rank's, as the ranks wait for it), the
    largest peak, and rank 0's token counts."""
    steps = [r[variant]["steps"] for r in ranks]
    seconds = [max(rank[i]["seconds"] for rank in steps) for i in range(len(steps[0]))]
    out = {
        "step_s": round(statistics.median(seconds), 4),
        "tokens_per_s": round(statistics.median(s["tokens"] / t for s, t in zip(steps[0], seconds)), 1),
        "peak_mib": round(max(s["peak_mib"] for rank in steps for s in rank), 2),
    }
    if variant == "grpo":
        for name in ("generate", "reward"):
            out[f"{name}_s"] = round(statistics.median(max(rank[i][name] for rank in steps) for i in range(len(seconds))), 4)
        out["train_s"] = round(max(out["step_s"] - out["generate_s"] - out["reward_s"], 0.0), 4)
        out["split"] = {name: round(out[f"{name}_s"] / out["step_s"], 3) for name in ("generate", "reward", "train")}
    return out


def main() -> None:
    parser = doc_parser(__doc__)
    add_model_args(parser)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank per micro-batch (default: 2)")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (default: 4)")
    parser.add_argument("--completion-length", type=int, default=32, help="max new tokens per completion (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="measured steps after the first (median; default: 3)")
    args = vars(parse_args(parser, hidden=64, layers=2, prompts=1, generations=2, completion_length=4, repeats=1))
    with tempfile.TemporaryDirectory(prefix="grpo_step_") as work:
        args["work"] = work
        _model_dir(Path(work), args["hidden"], args["layers"])
        from mmfsdp.data import prepare_dataset
        from mmfsdp.train.config import load_config

        for variant in ("sft", "grpo"):  # the prompt rows and the training rows have caches of their own
            prepare_dataset(load_config(str(CONFIG), _overrides(args, variant)).data)
        preload_for_ranks(*RANK_MODULES)
        ranks = run_distributed(_measure, args["nproc"], args, timeout=3600)
    sft, grpo = _summary(ranks, "sft"), _summary(ranks, "grpo")
    print(f"{args['nproc']} processes, Qwen3-VL {ranks[0]['sft']['params_m']:.1f}M parameters, decoder "
          f"{args['hidden']} x {args['layers']}; {args['prompts']} prompts x {args['generations']} completions "
          f"(<= {args['completion_length']} tokens) per rank per micro-batch")
    print(f"grpo: step {grpo['step_s']:.3f} s = generate {grpo['generate_s']:.3f} + reward {grpo['reward_s']:.3f} + "
          f"train {grpo['train_s']:.3f}; {grpo['tokens_per_s']:.0f} tok/s; peak {grpo['peak_mib']:.1f} MiB")
    print(f"sft:  step {sft['step_s']:.3f} s; {sft['tokens_per_s']:.0f} tok/s; peak {sft['peak_mib']:.1f} MiB")
    print(json.dumps({
        "nproc": args["nproc"], "hidden": args["hidden"], "layers": args["layers"], "prompts": args["prompts"],
        "generations": args["generations"], "completion_length": args["completion_length"],
        "repeats": args["repeats"], "grpo": grpo, "sft": sft,
        "grpo_over_sft_peak": round(grpo["peak_mib"] / sft["peak_mib"], 4),
    }))


if __name__ == "__main__":
    main()
