"""The MoE family through the real trainer: qwen3vl-moe-tiny (8 experts, top-2), fp32 on gloo, 5 steps,
`features.loss_cfg.router_aux_loss_coef` on in every run.

Every layout must give the 1-process, expert-parallel-1 run's per-step LM loss, router aux loss and
gradient norm (relative difference <= 1e-5) and its expert load (counts, equal), with the same global
batch of 4 samples (the aux loss is HF's over each micro-batch's global batch, so the accumulating run
is compared with a 1-process run accumulating the same micro-batches):

- FSDP2 on 2 processes at EP 1;
- EP 2 on 2 processes (the experts split, no FSDP left for them);
- EP 2 on 2 processes with micro-batch 1 × gradient accumulation 2, recompute and chunk loss;
- EP 2 × FSDP 2 on 4 processes (the experts FSDP-sharded over the 2 ranks holding the same ones),
  built on the meta device and filled from the HF weights (each rank reads its experts' rows);
- EP 2 with Ulysses 2 on 4 processes (the MoE layers see this rank's sequence shard);
- EP 2 with HSDP (2 replicas × 2 shards) on 4 processes, also a meta-device build.

Every run starts from the same HF directory in the hub's layout of Qwen3-VL-30B-A3B (fused experts
`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`, two safetensors shards): loaded eagerly by
`from_pretrained`, or into the sharded meta-built model, where every rank must read only its own
experts' rows of the expert tensors (the reads are recorded).

The gradients of every expert and router parameter at step 1 (gathered, before the optimizer step)
equal the 1-process run's. Resume under EP: the EP 2 run saves at step 3; a new trainer at EP 2 and
one at EP 1 (another expert layout: DCP reshards model and optimizer) resume from that checkpoint and
must log steps 4-5 only, equal to the uninterrupted run.

Step 1 of the 1-process run equals plain HF: `Qwen3VLMoeForConditionalGeneration` with that run's
initial weights, given the first batch with `labels=` and `output_router_logits=True`, returns as
`loss` the LM loss plus coef × aux loss, with the same gradient norm. A dense model with a non-zero
coefficient, or with expert parallel, is refused by the check, naming the key.

The cases are a table run by `tests/parity.py` (each world size spawned once).
"""

import shutil
from pathlib import Path

import pytest

from apprun import MOE, MOE_ASSETS, TINY, close
from parity import (
    STEPS, Case, HFFirstStep, Probe, assert_first_step_matches_hf, assert_matches, full_tensor, run_cases, session_dir,
)
from mmfsdp.train.config import load_config
from mmfsdp.parallel.testing import assert_within

SAVE_AT = 3
COEF = 0.5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


class Router(Probe):
    """Per step: the router aux loss and the expert load (max, mean)."""

    name = "router"

    def result(self, trainer) -> list[tuple]:
        return [
            (r.stats.get("aux_loss"), {"max": r.stats.get("expert_load_max"), "mean": r.stats.get("expert_load_mean")})
            for r in trainer.history
        ]


class ExpertReads(Probe):
    """Which expert tensors the HF loader reads, and how many rows of each."""

    name = "expert_reads"

    def __init__(self, case: dict, rank: int):
        super().__init__(case, rank)
        from mmfsdp.ckpt.hf import SafetensorsDir

        self.cls, self.reads = SafetensorsDir, []
        self.read, self.read_slice = read, read_slice = SafetensorsDir.read, SafetensorsDir.read_slice

        def note(key, tensor):
            if ".mlp.experts." in key:
                self.reads.append((key, tensor.shape[0]))
            return tensor

        SafetensorsDir.read = lambda files, key: note(key, read(files, key))
        SafetensorsDir.read_slice = lambda files, key, index: note(key, read_slice(files, key, index))

    def result(self, trainer) -> dict:
        return {"rows": sorted({rows for _, rows in self.reads}), "tensors": len(self.reads)}

    def detach(self) -> None:
        self.cls.read, self.cls.read_slice = self.read, self.read_slice


class FirstGrads(Probe):
    """The gathered gradients of the expert and router parameters when the optimizer first steps (rank 0 of a run
    from step 0)."""

    name = "grads"

    def attach(self, trainer) -> None:
        self.grads, step = {}, trainer.optimizer.step

        def first_step(*args, **kwargs):
            if not self.grads:
                for name, param in trainer.model.named_parameters():
                    if (".mlp.experts." in name or ".mlp.gate." in name) and param.grad is not None:
                        self.grads[name] = full_tensor(param.grad)
            return step(*args, **kwargs)

        trainer.optimizer.step = first_step
        self.start = trainer.step

    def result(self, trainer) -> dict:
        return self.grads if self.rank == 0 and self.start == 0 else {}


class ResumeFromEP2(Probe):
    """Before the trainer is built: the `ep2` run's step-3 checkpoint (only) copied to where the case loads from."""

    name = "resume"

    def __init__(self, case: dict, rank: int):
        super().__init__(case, rank)
        import torch.distributed as dist

        ckpt = Path(dict(item.split("=", 1) for item in case["overrides"])["training.load"])
        if rank == 0:
            shutil.copytree(ckpt.parent / "ep2" / f"iter_{SAVE_AT:07d}", ckpt / f"iter_{SAVE_AT:07d}")
            (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
        dist.barrier()


class HFFirstStepWithAux(HFFirstStep):
    hf_config = {"router_aux_loss_coef": COEF}
    hf_kwargs = {"output_router_logits": True}


EP2 = {"parallel.expert_parallel_size": 2}
PROBES = (Router, ExpertReads, FirstGrads)


def _case(name: str, world: int, overrides: dict, ref: str | None = None, layout: dict | None = None,
          probes: tuple = PROBES) -> Case:
    base = {
        "data.dataset_param.preprocess_parameters.cutoff_len": 96,
        "data.dataset_param.preprocess_parameters.model_name_or_path": str(MOE_ASSETS),
        "features.loss_cfg.router_aux_loss_coef": COEF,
        "parallel.expert_parallel_size": 1,  # the example runs EP 2; each run sets its own
        "model.model_name_or_path": "{tmp}/hf",
        "model.random_init": "false",
        "training.micro_batch_size": 2,
    }
    full = None if layout is None else {"world": world, **dict(zip(("dp", "ep", "ulysses", "replicate"), layout))}
    return Case(name, world, MOE, {**base, **overrides}, ref, dataset="shapes", probes=probes, layout=full)


CASES = {
    case.name: case
    for case in [
        # the reference pads its micro-batches (the batch plain HF takes); the others are padding-free (the default)
        _case("ref", 1, {"training.micro_batch_size": 4, "data.dataloader_param.padding_free": "false"},
              probes=(*PROBES, HFFirstStepWithAux)),
        _case("ref_ga2", 1, {"training.micro_batch_size": 2, "training.gradient_accumulation_steps": 2}),
        _case("fsdp2", 2, {}, "ref", (2, 1, 1, 1)),
        _case("ep2", 2, {**EP2, "training.save_interval": SAVE_AT, "training.save": "{tmp}/ckpt/ep2"}, "ref",
              (2, 2, 1, 1)),
        _case("ep2_ga2_recompute_chunk", 2, {
            **EP2, "training.micro_batch_size": 1, "training.gradient_accumulation_steps": 2,
            "parallel.recompute": "true", "features.enable_chunk_loss": "true",
            "features.chunkloss_plan.chunk_size": 16,
        }, "ref_ga2", (2, 2, 1, 1)),
        _case("ep2_resumed", 2, {**EP2, "training.load": "{tmp}/ckpt/ep2_resumed"}, probes=(*PROBES, ResumeFromEP2)),
        _case("ep1_resumed", 2, {"training.load": "{tmp}/ckpt/ep1_resumed"}, probes=(*PROBES, ResumeFromEP2)),
        _case("ep2_fsdp2", 4, {**EP2, "training.micro_batch_size": 1, "training.init_model_with_meta_device": "true"},
              "ref", (4, 2, 1, 1)),
        _case("ep2_ulysses2", 4, {**EP2, "parallel.ulysses_parallel_size": 2}, "ref", (2, 2, 2, 1)),
        _case("ep2_hsdp", 4, {
            **EP2, "training.micro_batch_size": 1, "parallel.data_parallel_replicate_size": 2,
            "training.init_model_with_meta_device": "true",
        }, "ref", (4, 2, 1, 2)),
    ]
}


def _write_hub_layout(directory: Path, state: dict) -> None:
    """Two safetensors shards + index + config.json, the experts transposed as on the hub."""
    import json

    from safetensors.torch import save_file

    directory.mkdir()
    tensors = {k: (v.transpose(1, 2) if ".mlp.experts." in k else v).contiguous() for k, v in state.items()}
    weight_map = {}
    for index in range(2):
        filename = f"model-{index + 1:05d}-of-00002.safetensors"
        part = sorted(tensors)[index::2]
        save_file({name: tensors[name] for name in part}, directory / filename)
        weight_map.update({name: filename for name in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(MOE_ASSETS / "config.json", directory / "config.json")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    tmp = tmp_path_factory.mktemp("moe")
    torch.manual_seed(7)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig.from_pretrained(MOE_ASSETS))
    _write_hub_layout(tmp / "hf", model.state_dict())
    return run_cases(list(CASES.values()), tmp, session_dir(tmp_path_factory), 1200)


def _assert_router_matches(name: str, got: dict, expected: dict, first: int = 0) -> None:
    """The aux loss (logged, within 1e-5) and the expert load (equal) of every step of `got` and `expected` from
    step `first` + 1."""
    for step, ((aux, load), (ref_aux, ref_load)) in enumerate(zip(got["router"][0], expected["router"][0][first:]), 1):
        assert aux is not None and ref_aux > 0, f"{name}, step {step}: no router aux loss logged"
        assert close(aux, ref_aux, what=f"{name} step {step} aux loss"), f"{name}, step {step}: aux loss {aux} vs {ref_aux}"
        assert load == ref_load, f"{name}, step {step}: expert load {load} vs {ref_load}"


@pytest.mark.parametrize("name", ["fsdp2", "ep2", "ep2_ga2_recompute_chunk", "ep2_fsdp2", "ep2_ulysses2", "ep2_hsdp"])
def test_moe_layout_matches_one_process(results, name):
    case = CASES[name]
    assert_matches(results, case)
    _assert_router_matches(name, results[name], results[case.reference])


@pytest.mark.parametrize("name", ["ep2", "ep2_ga2_recompute_chunk", "ep2_fsdp2", "ep2_ulysses2", "ep2_hsdp"])
def test_expert_and_router_gradients_of_step_one_match_one_process(results, name):
    import torch

    got, expected = results[name]["grads"][0], results[CASES[name].reference]["grads"][0]
    assert any(".mlp.experts.gate_up_proj" in k for k in expected) and any(".mlp.gate.weight" in k for k in expected)
    assert sorted(got) == sorted(expected)
    for key, reference in expected.items():
        assert got[key].shape == reference.shape, key
        error = (got[key] - reference).norm() / reference.norm()
        assert_within(error.item(), 1e-5, f"{name}: {key} gradient")
        assert not torch.equal(reference, torch.zeros_like(reference)), key


@pytest.mark.parametrize("name", ["ep2_fsdp2", "ep2_hsdp"])
def test_meta_init_under_expert_parallel_reads_only_each_ranks_experts(results, name):
    # 2 layers x (gate_up_proj, down_proj); EP 2 x FSDP 2 holds 2 of the 8 experts per rank, EP 2 x HSDP 4
    reads = results[name]["expert_reads"][0]
    assert reads["tensors"] == 4
    assert reads["rows"] == ([2] if name == "ep2_fsdp2" else [4])


@pytest.mark.parametrize("name", ["ep2_resumed", "ep1_resumed"])
def test_resume_from_an_ep2_checkpoint_continues_the_run(results, name):
    from parity import assert_steps

    got, uninterrupted = results[name], results["ep2"]
    assert got["start"] == SAVE_AT, f"{name} started at step {got['start']}, not at the checkpoint"
    assert len(got["steps"]) == STEPS - SAVE_AT
    assert_steps(name, got["steps"], uninterrupted["steps"][SAVE_AT:], what="(uninterrupted)")
    _assert_router_matches(name, got, uninterrupted, SAVE_AT)


def test_accumulation_reference_has_the_same_lm_loss(results):
    """Accumulating two micro-batches changes only the aux loss (HF's, per micro-batch), not the LM loss."""
    (loss, _, _), (ref_loss, _, _) = results["ref_ga2"]["steps"][0], results["ref"]["steps"][0]
    (aux, _), (ref_aux, _) = results["ref_ga2"]["router"][0][0], results["ref"]["router"][0][0]
    assert close(loss, ref_loss, what="loss") and aux != ref_aux


def test_first_step_lm_plus_aux_loss_matches_plain_hf(results):
    aux, load = results["ref"]["router"][0][0]
    assert_first_step_matches_hf(results["ref"], COEF * aux, what="loss + coef x aux")
    assert load["max"] >= load["mean"] > 0


def test_router_aux_loss_on_a_dense_model_is_a_config_error():
    from mmfsdp.train.check import model_check

    cfg = load_config(TINY, ["features.loss_cfg.router_aux_loss_coef=0.01"])
    errors = [e for e in model_check(cfg) if "router_aux_loss_coef" in str(e)]
    assert len(errors) == 1 and "features.loss_cfg.router_aux_loss_coef" in str(errors[0]), errors
    assert "dense" in str(errors[0])
