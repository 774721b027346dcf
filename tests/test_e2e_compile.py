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
One spawn of 2 ranks runs every case of the table in turn (`tests/parity.py`).
"""

import pytest

from apprun import QWEN
from parity import QWEN_SETTINGS, Case, Probe, assert_matches, run_cases, session_dir

MAX_GRAPHS = 16
"""Graphs a compiled run may compile in all: a decoder layer's forward and a variant or two for a new input; the
Ulysses run's layers break at each all-to-all into several graphs (13 measured), compiled once all the same."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


class Graphs(Probe):
    """Dynamo's graph count after every step (counted from a reset before the trainer is built), each micro-batch's
    length, and the modules `features.compile` compiled."""

    name = "graphs"

    def __init__(self, case: dict, rank: int):
        super().__init__(case, rank)
        import torch
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        self.counters, self.graphs, self.lengths = counters, [], []

    def attach(self, trainer) -> None:
        trainer.model.register_forward_pre_hook(
            lambda module, args, kwargs: self.lengths.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True
        )
        step = trainer.train_step

        def counted_step():
            result = step()
            self.graphs.append(int(self.counters["stats"]["unique_graphs"]))
            return result

        trainer.train_step = counted_step

    def result(self, trainer) -> dict:
        from mmfsdp.parallel import is_compiled

        compiled = sorted(n for n, m in trainer.model.named_modules() if is_compiled(m))
        return {"graphs": self.graphs, "lengths": self.lengths, "compiled": compiled}


COMPILE = {"features.compile": "true", "features.compile_plan.backend": "aot_eager"}
LORA = {"training.lora.enable": "true", "training.lora.rank": 8,
        "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj]", "training.lr": 1.0e-2}


def _case(name: str, overrides: dict, ref: str | None = None) -> Case:
    return Case(name, 2, QWEN, {**QWEN_SETTINGS, "training.micro_batch_size": 2, **overrides}, ref, dataset="shapes",
                probes=(Graphs,))


CASES = {
    case.name: case
    for case in [
        _case("eager", {}),
        _case("compiled", COMPILE, "eager"),
        _case("compiled_recompute", {**COMPILE, "parallel.recompute": "true"}, "eager"),
        _case("compiled_chunk", {**COMPILE, "features.enable_chunk_loss": "true",
                                 "features.chunkloss_plan.chunk_size": 16}, "eager"),
        _case("compiled_ulysses2", {**COMPILE, "parallel.ulysses_parallel_size": 2, "training.micro_batch_size": 4},
              "eager"),
        _case("eager_lora", LORA),
        _case("compiled_lora", {**COMPILE, **LORA}, "eager_lora"),
    ]
}
COMPILED = [name for name in CASES if name.startswith("compiled")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_cases(list(CASES.values()), tmp_path_factory.mktemp("compile"), session_dir(tmp_path_factory), 1100)
    return {name: {**result, **result["graphs"][0]} for name, result in out.items()}


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_run_matches_eager(results, name):
    assert_matches(results, CASES[name], reference_world=2)


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
    assert graphs[1] == graphs[-1], f"{name}: steps 3-{len(graphs)} compiled new graphs (per step: {graphs})"
