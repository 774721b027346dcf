"""Step time of the tiny Qwen3-VL trainer with one FSDP2 group per module vs the default grouping of small modules.

    uv run python tools/bench/fsdp_grouping.py            # 6 rounds; --rounds N for more
    uv run python tools/bench/fsdp_grouping.py --smoke    # the smallest run (CI): 2 rounds on 64 rows

Two `Trainer`s (the qwen3vl-tiny example with the family's default FSDP plan, 2 gloo processes, fp32) live in the
same processes: `parallel.fsdp_plan.min_group_params: 0` (every decoder layer, vision block, merger, embedding and
`lm_head` its own group: 9 groups + root) and the default (3 groups + root). Their steps (`train_step` + AdamW) are
interleaved, 3 steps of one then 3 of the other per round, so both meet the same load on a shared machine; the first
round is dropped and the median step time of each printed, with `grouped_speedup` (ungrouped / grouped) in the last
line's JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _smoke import parse_args

from mmfsdp.parallel.testing import preload_for_ranks, run_distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
STEPS_PER_ROUND = 3
RANK_MODULES = ("transformers", "mmfsdp.model.all_families", "mmfsdp.data", "mmfsdp.train.trainer")
"""What every rank imports, once in the process the ranks fork from (`preload_for_ranks`)."""


def _data(tmp: str, num_train: int) -> list[str]:
    return [f"data.dataset_param.synthetic.num_train={num_train}", "data.dataset_param.synthetic.num_eval=16",
            f"data.dataset_param.basic_parameters.dataset_dir={tmp}/data",
            f"data.dataset_param.basic_parameters.cache_dir={tmp}/cache"]


def _interleaved(rank: int, world_size: int, tmp: str, num_train: int, rounds: int) -> dict[str, list[float]]:
    from mmfsdp.train.config import load_config
    from mmfsdp.train.trainer import Trainer

    common = [*_data(tmp, num_train), "parallel.fsdp_plan.apply_modules=null", "training.log_interval=1000"]
    variants = {"ungrouped": ["parallel.fsdp_plan.min_group_params=0"], "grouped": []}
    trainers = {name: Trainer(load_config(CONFIG, [*common, *extra, f"training.output_dir={tmp}/out_{name}"]), "cpu")
                for name, extra in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            for _ in range(STEPS_PER_ROUND):
                started = time.perf_counter()
                trainer.train_step()
                trainer.optimizer.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                times[name].append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds; the first is dropped (default: 6)")
    parser.add_argument("--num-train", type=int, default=1024, help="synthetic training rows (default: 1024)")
    args = parse_args(parser, rounds=2, num_train=64)
    from mmfsdp.data import prepare_dataset
    from mmfsdp.train.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        prepare_dataset(load_config(CONFIG, _data(tmp, args.num_train)).data)
        preload_for_ranks(*RANK_MODULES)
        times = run_distributed(_interleaved, 2, tmp, args.num_train, args.rounds, timeout=3600)[0]
    out = {name: {"median_ms": 1e3 * statistics.median(v[STEPS_PER_ROUND:]), "steps": len(v) - STEPS_PER_ROUND}
           for name, v in times.items()}
    out["grouped_speedup"] = out["ungrouped"]["median_ms"] / out["grouped"]["median_ms"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
