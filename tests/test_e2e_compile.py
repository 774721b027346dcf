"""`features.compile` through the real trainer: the qwen3vl-tiny run, 5 steps, fp32 on 2 gloo processes (HSDP on 4).

Each compiled layout must give the per-step loss and gradient norm of the eager run with the same global
batch (relative difference <= 1e-5) on the same tokens:

- FSDP2 (data parallel 2), also with recompute and chunk loss (one run);
- Ulysses 2 (one CP group, the micro-batch of the 1-process run, which the eager FSDP2 run's global batch equals);
- LoRA on FSDP2 (the adapters inside the compiled layers), against an eager LoRA run;
- HSDP 2 replicas x 2 shards on 4 processes, micro-batch 1, against the eager FSDP2 run;
- expert parallel 2 on the MoE family (qwen3vl-moe-tiny, router aux loss on), against the eager EP 2 run, aux
  losses included;
- Ring 2 with packing on the tiny Mistral3, against `test_e2e_cp.py`'s 1-process packed run (the same case, so a
  session runs it once).

The shapes rows mix text-only and image rows, and micro-batches are padding-free (the default: a micro-batch's
samples end to end in one row), so the length of a micro-batch changes from step to step: the compiled runs must
not recompile for every new length (packed attention is one opaque op in the graphs, `mmfsdp::packed_sdpa`, which
reads the lengths from the micro-batch's plan), nor, in the MoE run, for the routing (the experts' dispatch runs
outside them, `experts_forward`). With `features.compile_plan.dynamic: null` (the default) each block's token
dimension is marked dynamic before its first trace (`mmfsdp.parallel.compile.mark_token_dims`). The number of graphs
dynamo compiled is read after every step (`torch._dynamo.utils.counters`): steps 4-5 add none, and the run compiles
at most a few graphs in all.

The tests use torch.compile's `aot_eager` backend (traced and run through AOTAutograd, no code generation). Inductor
works on this machine too (gcc 12: a 2-block MLP through `apply_compile` with inductor gave outputs within 5e-7 of
eager over three sequence lengths, with 2 graphs), but its C++ compilation took 82 s under load, per layout.
One spawn per world size (1 for the shared Ring reference, unless another file ran it; 2; 4) runs its cases of the
table in turn (`tests/parity.py`).
"""

import pytest

from apprun import MOE, MOE_ASSETS, QWEN, TINY, close
from parity import QWEN_SETTINGS, Case, PadSamplesAsRing2, Probe, assert_matches, run_cases, session_dir

MAX_GRAPHS = 8
"""Graphs a compiled run may compile in all (measured 2026-12-07 with the packed-attention op: 1 for the decoder
layer, plain, with recompute and HSDP, whatever the lengths; 2 with LoRA; 3 Ulysses, whose traced all-to-alls add
pieces; 4 Ring 2, whose attention runs eagerly, a graph break per layer), the MoE layers also broken at their
experts (`experts_forward` runs eagerly: 7 at EP 2)."""
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
        aux = [r.stats.get("aux_loss") for r in trainer.history]
        return {"graphs": self.graphs, "lengths": self.lengths, "compiled": compiled, "aux": aux}


COMPILE = {"features.compile": "true", "features.compile_plan.backend": "aot_eager"}
LORA = {"training.lora.enable": "true", "training.lora.rank": 8,
        "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj]", "training.lr": 1.0e-2}


def _case(name: str, overrides: dict, ref: str | None = None, world: int = 2, layout: dict | None = None) -> Case:
    return Case(name, world, QWEN, {**QWEN_SETTINGS, "training.micro_batch_size": 2, **overrides}, ref,
                dataset="shapes", probes=(Graphs,), layout=layout)


MOE_SETTINGS = {
    "model.model_name_or_path": str(MOE_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(MOE_ASSETS),
    "data.dataset_param.preprocess_parameters.cutoff_len": 96,
    "features.loss_cfg.router_aux_loss_coef": 0.5,
    "parallel.expert_parallel_size": 2,
    "training.micro_batch_size": 2,
}
"""The MoE family at expert parallel 2, aux loss on (`test_e2e_moe_router.py` checks the eager run against one
process; here the compiled run must give the eager one's steps and aux losses)."""
RING_PACKED = {
    "data.dataset_param.basic_parameters.packing": "true",
    "data.dataset_param.preprocess_parameters.cutoff_len": 128,
    "training.micro_batch_size": 1,
}
"""`test_e2e_cp.py`'s Ring 2 + packing run; its 1-process reference (`single_packed`) is shared with that file."""

CASES = {
    case.name: case
    for case in [
        _case("eager", {}),
        _case("compiled", COMPILE, "eager"),
        # recompute and chunk loss in one run (one compiled run less): the checkpoint wraps the compiled layers,
        # the chunked loss runs on the eager lm_head
        _case("compiled_recompute_chunk", {**COMPILE, "parallel.recompute": "true",
                                           "features.enable_chunk_loss": "true",
                                           "features.chunkloss_plan.chunk_size": 16}, "eager"),
        _case("compiled_ulysses2", {**COMPILE, "parallel.ulysses_parallel_size": 2, "training.micro_batch_size": 4},
              "eager"),
        _case("eager_lora", LORA),
        _case("compiled_lora", {**COMPILE, **LORA}, "eager_lora"),
        # HSDP 2 replicas x 2 shards, micro-batch 1: the global batch of 4 of the eager FSDP2 run
        _case("compiled_hsdp", {**COMPILE, "parallel.data_parallel_replicate_size": 2, "training.micro_batch_size": 1},
              "eager", world=4, layout={"dp": 4, "replicate": 2}),
        Case("eager_ep2", 2, MOE, MOE_SETTINGS, dataset="shapes", probes=(Graphs,)),
        Case("compiled_ep2", 2, MOE, {**MOE_SETTINGS, **COMPILE}, "eager_ep2", dataset="shapes", probes=(Graphs,),
             layout={"dp": 2, "ep": 2}),
        Case("single_packed", 1, TINY, RING_PACKED, dataset="shapes64", probes=(PadSamplesAsRing2,)),
        Case("compiled_ring2_packed", 2, TINY, {**RING_PACKED, **COMPILE, "parallel.ring_attention_size": 2},
             "single_packed", dataset="shapes64", probes=(Graphs,), layout={"dp": 1, "ring": 2}),
    ]
}
COMPILED = [name for name in CASES if name.startswith("compiled")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = run_cases(list(CASES.values()), tmp_path_factory.mktemp("compile"), session_dir(tmp_path_factory), 1100)
    return {name: {**result, **result["graphs"][0]} if "graphs" in result else result for name, result in out.items()}


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_run_matches_eager(results, name):
    case = CASES[name]
    assert_matches(results, case, reference_world=CASES[case.reference].world)


def test_compiled_expert_parallel_run_has_the_eager_aux_losses(results):
    got, expected = results["compiled_ep2"]["aux"], results["eager_ep2"]["aux"]
    assert len(got) == len(expected) == len(results["eager_ep2"]["steps"])
    for step, (aux, ref_aux) in enumerate(zip(got, expected), 1):
        assert ref_aux is not None and ref_aux > 0, f"step {step}: no router aux loss logged"
        assert close(aux, ref_aux, what=f"step {step} aux loss"), f"step {step}: aux loss {aux} vs {ref_aux}"


def test_compile_covers_the_decoder_layers_only_when_asked(results):
    assert results["eager"]["compiled"] == []
    assert results["compiled"]["compiled"] == ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert results["compiled_recompute_chunk"]["compiled"] == results["compiled"]["compiled"]
    assert results["eager_lora"]["compiled"] == [] and results["compiled_lora"]["compiled"]
    assert results["eager_ep2"]["compiled"] == []
    for name in ("compiled_hsdp", "compiled_ep2", "compiled_ring2_packed"):
        assert results[name]["compiled"] == results["compiled"]["compiled"], name


@pytest.mark.parametrize("name", COMPILED)
def test_variable_lengths_do_not_recompile(results, name):
    run = results[name]
    # the Ulysses run's 4-row micro-batches all pad to the longest shapes row; the Ring run's packed rows all fill
    # cutoff_len (its samples end at other places in every row)
    if "ulysses" not in name and "ring" not in name:
        assert len(set(run["lengths"])) > 1, f"{name}: the micro-batches should differ in length: {run['lengths']}"
    graphs, most = run["graphs"], MAX_GRAPHS
    assert 0 < graphs[-1] <= most, f"{name}: {graphs[-1]} graphs compiled (per step: {graphs})"
    assert graphs[-3] == graphs[-1], f"{name}: steps {len(graphs) - 1}-{len(graphs)} compiled new graphs (per step: {graphs})"
