"""`features.compile` through the real trainer: the qwen3vl-tiny run, 5 steps, fp32 on 2 gloo processes.

Each compiled layout must give the per-step loss and gradient norm of the eager FSDP2 run with the same global
batch (relative difference <= 1e-5) on the same tokens:

- FSDP2 (data parallel 2), also with recompute and with chunk loss;
- Ulysses 2 (one CP group, the micro-batch of the 1-process run, which the eager FSDP2 run's global batch equals);
- LoRA on FSDP2 (the adapters inside the compiled layers), against an eager LoRA run.

The shapes rows mix text-only and image rows, and micro-batches are padding-free (the default: a micro-batch's
samples end to end in one row), so the length of a micro-batch changes from step to step: the compiled runs must
not recompile for that (packed attention runs outside the graphs, `mmfsdp.model.attention._sdpa_varlen`). The number of graphs dynamo compiled is read after every step
(`torch._dynamo.utils.counters`): steps 3-5 add none, and the run compiles at most a few graphs in all.

The tests use torch.compile's `aot_eager` backend (traced and run through AOTAutograd, no code generation). Inductor
works on this machine too (gcc 12: a 2-block MLP through `apply_compile` with inductor gave outputs within 5e-7 of
eager over three sequence lengths, with 2 graphs), but its C++ compilation took 82 s under load, per layout.
One spawn of 2 ranks runs every trainer in turn.
"""

from pathlib import Path

import pytest

from mmfsdp.data import prepare_dataset
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
STEPS = 5
MAX_GRAPHS = 16
"""Graphs a compiled run may compile in all: a decoder layer's forward and a variant or two for a new input; the
Ulysses run's layers break at each all-to-all into several graphs (13 measured), compiled once all the same."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _overrides(tmp: Path, name: str, **extra) -> list[str]:
    items = {
        "model.model_name_or_path": str(ASSETS),
        "data.dataset_param.preprocess_parameters.model_name_or_path": str(ASSETS),
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "data"),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache"),
        "data.dataset_param.synthetic.num_train": 32,
        "data.dataset_param.synthetic.num_eval": 4,
        "training.micro_batch_size": 2,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


COMPILE = {"features.compile": "true", "features.compile_plan.backend": "aot_eager"}
LORA = {"training.lora.enable": "true", "training.lora.rank": 8,
        "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj]", "training.lr": 1.0e-2}
RUNS = {
    "eager": {},
    "compiled": COMPILE,
    "compiled_recompute": {**COMPILE, "parallel.recompute": "true"},
    "compiled_chunk": {**COMPILE, "features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16},
    "compiled_ulysses2": {**COMPILE, "parallel.ulysses_parallel_size": 2, "training.micro_batch_size": 4},
    "eager_lora": LORA,
    "compiled_lora": {**COMPILE, **LORA},
}
REFERENCE = {"compiled_lora": "eager_lora"}
"""The eager run each compiled run is compared with (default: `eager`)."""
COMPILED = [name for name in RUNS if name.startswith("compiled")]


def _train(rank, world_size, runs):
    import torch
    from torch._dynamo.utils import counters

    from mmfsdp.parallel import is_compiled
    from mmfsdp.train.trainer import Trainer

    results = {}
    for name, overrides in runs:
        torch._dynamo.reset()
        counters.clear()
        trainer = Trainer(load_config(CONFIG, overrides), "cpu")
        graphs, lengths = [], []
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: lengths.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True
        )
        step = trainer.train_step

        def counted_step():
            result = step()
            graphs.append(int(counters["stats"]["unique_graphs"]))
            return result

        trainer.train_step = counted_step
        trainer.train()
        results[name] = {
            "steps": [(r.loss, r.grad_norm, r.num_tokens) for r in trainer.history],
            "graphs": graphs,
            "lengths": lengths,
            "compiled": sorted(n for n, m in trainer.model.named_modules() if is_compiled(m)),
        }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    prepare_dataset(load_config(CONFIG, _overrides(tmp, "prepare")).data)
    runs = [(name, _overrides(tmp, name, **extra)) for name, extra in RUNS.items()]
    return run_distributed(_train, 2, runs, timeout=1100)[0]


def _close(value: float, reference: float) -> bool:
    return abs(value - reference) <= 1e-5 * abs(reference)


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_run_matches_eager(results, name):
    got, expected = results[name]["steps"], results[REFERENCE.get(name, "eager")]["steps"]
    assert len(got) == len(expected) == STEPS
    for step, ((loss, norm, tokens), (ref_loss, ref_norm, ref_tokens)) in enumerate(zip(got, expected), 1):
        assert tokens == ref_tokens, f"{name}, step {step}: {tokens} tokens vs {ref_tokens}"
        assert _close(loss, ref_loss), f"{name}, step {step}: loss {loss} vs eager {ref_loss}"
        assert _close(norm, ref_norm), f"{name}, step {step}: grad norm {norm} vs eager {ref_norm}"


def test_compile_covers_the_decoder_layers_only_when_asked(results):
    assert results["eager"]["compiled"] == []
    assert results["compiled"]["compiled"] == ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert results["compiled_recompute"]["compiled"] == results["compiled"]["compiled"]
    assert results["eager_lora"]["compiled"] == [] and results["compiled_lora"]["compiled"]


@pytest.mark.parametrize("name", COMPILED)
def test_variable_lengths_do_not_recompile(results, name):
    run = results[name]
    if "ulysses" not in name:  # the Ulysses run's 4-row micro-batches all pad to the longest shapes row
        assert len(set(run["lengths"])) > 1, f"{name}: the micro-batches should differ in length: {run['lengths']}"
    graphs = run["graphs"]
    assert 0 < graphs[-1] <= MAX_GRAPHS, f"{name}: {graphs[-1]} graphs compiled (per step: {graphs})"
    assert graphs[1] == graphs[-1], f"{name}: steps 3-{STEPS} compiled new graphs (per step: {graphs})"
