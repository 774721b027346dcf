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

Each world size is spawned once and runs all of its trainers in turn.
"""

import shutil
from pathlib import Path

import pytest

from mmfsdp.data import prepare_dataset
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "qwen3vl-moe-tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "qwen3vl-moe-tiny" / "assets"
STEPS = 5
SAVE_AT = 3
COEF = 0.5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

EP2 = {"parallel.expert_parallel_size": 2}
# name: (world size, overrides); "ref" is the reference of every other run
RUNS = {
    # the reference pads its micro-batches (the batch plain HF takes); the others are padding-free (the default)
    "ref": (1, {"training.micro_batch_size": 4, "data.dataloader_param.padding_free": "false"}),
    "ref_ga2": (1, {"training.micro_batch_size": 2, "training.gradient_accumulation_steps": 2}),
    "fsdp2": (2, {}),
    "ep2": (2, {**EP2, "training.save_interval": SAVE_AT}),
    "ep2_ga2_recompute_chunk": (2, {
        **EP2, "training.micro_batch_size": 1, "training.gradient_accumulation_steps": 2,
        "parallel.recompute": "true", "features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16,
    }),
    "ep2_resumed": (2, {**EP2, "resume_from": "ep2"}),
    "ep1_resumed": (2, {"resume_from": "ep2"}),
    "ep2_fsdp2": (4, {**EP2, "training.micro_batch_size": 1, "training.init_model_with_meta_device": "true"}),
    "ep2_ulysses2": (4, {**EP2, "parallel.ulysses_parallel_size": 2}),
    "ep2_hsdp": (4, {
        **EP2, "training.micro_batch_size": 1, "parallel.data_parallel_replicate_size": 2,
        "training.init_model_with_meta_device": "true",
    }),
}


def _overrides(tmp: Path, name: str, **extra) -> list[str]:
    items = {
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "data"),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache"),
        "data.dataset_param.synthetic.num_train": 32,
        "data.dataset_param.synthetic.num_eval": 4,
        "data.dataset_param.preprocess_parameters.cutoff_len": 96,
        "features.loss_cfg.router_aux_loss_coef": COEF,
        "parallel.expert_parallel_size": 1,  # the example runs EP 2; each run sets its own
        "model.model_name_or_path": str(tmp / "hf"),
        "model.random_init": "false",
        "training.micro_batch_size": 2,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def _hf_step(batch, weights) -> tuple[float, float]:
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from mmfsdp.model import model_inputs

    with torch.random.fork_rng():
        config = Qwen3VLMoeConfig.from_pretrained(ASSETS)
        config.text_config.router_aux_loss_coef = COEF
        model = Qwen3VLMoeForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    model.load_state_dict(weights, strict=True)
    model.train()
    loss = model(**model_inputs(batch), labels=batch["labels"], output_router_logits=True).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss), float(norm)


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
    shutil.copy(ASSETS / "config.json", directory / "config.json")


def _record_expert_reads(into: list) -> None:
    """Record which expert tensors the HF loader reads, and how many rows of each."""
    from mmfsdp.ckpt.hf import SafetensorsDir

    read, read_slice = SafetensorsDir.read, SafetensorsDir.read_slice

    def whole(self, key):
        tensor = read(self, key)
        if ".mlp.experts." in key:
            into.append((key, tensor.shape[0]))
        return tensor

    def rows(self, key, index):
        tensor = read_slice(self, key, index)
        if ".mlp.experts." in key:
            into.append((key, tensor.shape[0]))
        return tensor

    SafetensorsDir.read, SafetensorsDir.read_slice = whole, rows


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _capture_first_grads(trainer, into: dict) -> None:
    """Keep the gathered gradients of the expert and router parameters when the optimizer first steps."""
    step = trainer.optimizer.step

    def first_step(*args, **kwargs):
        if not into:
            for name, param in trainer.model.named_parameters():
                if (".mlp.experts." in name or ".mlp.gate." in name) and param.grad is not None:
                    into[name] = _full(param.grad)
        return step(*args, **kwargs)

    trainer.optimizer.step = first_step


def _train(rank, world_size, tmp, runs):
    from mmfsdp.train.trainer import Trainer

    tmp = Path(tmp)
    results = {}
    for name, extra in runs:
        extra = dict(extra)
        source = extra.pop("resume_from", None)
        if source is not None:  # resume from the source run's step-3 checkpoint only
            ckpt = tmp / "ckpt" / name
            if rank == 0:
                shutil.copytree(tmp / "ckpt" / source / f"iter_{SAVE_AT:07d}", ckpt / f"iter_{SAVE_AT:07d}")
                (ckpt / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
            import torch.distributed as dist

            dist.barrier()
            extra["training.load"] = str(ckpt)
        elif "training.save_interval" in extra:
            extra["training.save"] = str(tmp / "ckpt" / name)
        expert_reads: list = []
        _record_expert_reads(expert_reads)
        trainer = Trainer(load_config(CONFIG, _overrides(tmp, name, **extra)), "cpu")
        first = None
        if name == "ref":
            state = trainer.loader.state_dict()
            batch = next(trainer.loader)
            trainer.loader.load_state_dict(state)
            first = (batch, {k: _full(v) for k, v in trainer.model.state_dict().items()})
        grads: dict = {}
        _capture_first_grads(trainer, grads)
        start = trainer.step
        trainer.train()
        plan = trainer.plan
        results[name] = {
            "layout": {"world": world_size, "dp": plan.dp, "ep": plan.ep, "ulysses": plan.ulysses,
                       "replicate": plan.dp_replicate},
            "start": start,
            "steps": [(r.loss, r.stats.get("aux_loss"), r.grad_norm,
                       {"max": r.stats.get("expert_load_max"), "mean": r.stats.get("expert_load_mean")})
                      for r in trainer.history],
            "grads": grads if rank == 0 and start == 0 else {},
            "expert_rows_read": sorted({rows for _, rows in expert_reads}),
            "expert_tensors_read": len(expert_reads),
        }
        if first is not None:
            results[name]["hf_step1"] = _hf_step(*first)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    tmp = tmp_path_factory.mktemp("moe")
    torch.manual_seed(7)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig.from_pretrained(ASSETS))
    _write_hub_layout(tmp / "hf", model.state_dict())
    prepare_dataset(load_config(CONFIG, _overrides(tmp, "prepare")).data)
    out = {}
    for world_size in (1, 2, 4):
        runs = [(name, extra) for name, (world, extra) in RUNS.items() if world == world_size]
        out.update(run_distributed(_train, world_size, str(tmp), runs, timeout=1200)[0])
    return out


def _close(value: float, reference: float, rel: float = 1e-5) -> bool:
    return abs(value - reference) <= rel * abs(reference)


def _assert_steps_match(name: str, got: list, expected: list) -> None:
    for step, (mine, theirs) in enumerate(zip(got, expected), 1):
        (loss, aux, norm, load), (ref_loss, ref_aux, ref_norm, ref_load) = mine, theirs
        assert aux is not None and ref_aux > 0, f"{name}, step {step}: no router aux loss logged"
        assert _close(loss, ref_loss), f"{name}, step {step}: LM loss {loss} vs {ref_loss}"
        assert _close(aux, ref_aux), f"{name}, step {step}: aux loss {aux} vs {ref_aux}"
        assert _close(norm, ref_norm), f"{name}, step {step}: grad norm {norm} vs {ref_norm}"
        assert load == ref_load, f"{name}, step {step}: expert load {load} vs {ref_load}"


REFERENCE = {"ep2_ga2_recompute_chunk": "ref_ga2"}
"""The 1-process run a layout is compared with, when not "ref"."""


@pytest.mark.parametrize(
    "name, layout",
    [
        ("fsdp2", {"world": 2, "dp": 2, "ep": 1, "ulysses": 1, "replicate": 1}),
        ("ep2", {"world": 2, "dp": 2, "ep": 2, "ulysses": 1, "replicate": 1}),
        ("ep2_ga2_recompute_chunk", {"world": 2, "dp": 2, "ep": 2, "ulysses": 1, "replicate": 1}),
        ("ep2_fsdp2", {"world": 4, "dp": 4, "ep": 2, "ulysses": 1, "replicate": 1}),
        ("ep2_ulysses2", {"world": 4, "dp": 2, "ep": 2, "ulysses": 2, "replicate": 1}),
        ("ep2_hsdp", {"world": 4, "dp": 4, "ep": 2, "ulysses": 1, "replicate": 2}),
    ],
)
def test_moe_layout_matches_one_process(results, name, layout):
    got, expected = results[name], results[REFERENCE.get(name, "ref")]
    assert got["layout"] == layout, f"{name} ran as {got['layout']}"
    assert len(got["steps"]) == len(expected["steps"]) == STEPS
    _assert_steps_match(name, got["steps"], expected["steps"])


@pytest.mark.parametrize("name", ["ep2", "ep2_ga2_recompute_chunk", "ep2_fsdp2", "ep2_ulysses2", "ep2_hsdp"])
def test_expert_and_router_gradients_of_step_one_match_one_process(results, name):
    import torch

    got, expected = results[name]["grads"], results[REFERENCE.get(name, "ref")]["grads"]
    assert any(".mlp.experts.gate_up_proj" in k for k in expected) and any(".mlp.gate.weight" in k for k in expected)
    assert sorted(got) == sorted(expected)
    for key, reference in expected.items():
        assert got[key].shape == reference.shape, key
        error = (got[key] - reference).norm() / reference.norm()
        assert error <= 1e-5, f"{name}: {key} gradient differs by {error:.2e} (relative)"
        assert not torch.equal(reference, torch.zeros_like(reference)), key


@pytest.mark.parametrize("name", ["ep2_fsdp2", "ep2_hsdp"])
def test_meta_init_under_expert_parallel_reads_only_each_ranks_experts(results, name):
    # 2 layers x (gate_up_proj, down_proj); EP 2 x FSDP 2 holds 2 of the 8 experts per rank, EP 2 x HSDP 4
    assert results[name]["expert_tensors_read"] == 4
    assert results[name]["expert_rows_read"] == ([2] if name == "ep2_fsdp2" else [4])


@pytest.mark.parametrize("name", ["ep2_resumed", "ep1_resumed"])
def test_resume_from_an_ep2_checkpoint_continues_the_run(results, name):
    got, uninterrupted = results[name], results["ep2"]
    assert got["start"] == SAVE_AT, f"{name} started at step {got['start']}, not at the checkpoint"
    assert len(got["steps"]) == STEPS - SAVE_AT
    _assert_steps_match(name, got["steps"], uninterrupted["steps"][SAVE_AT:])


def test_accumulation_reference_has_the_same_lm_loss(results):
    """Accumulating two micro-batches changes only the aux loss (HF's, per micro-batch), not the LM loss."""
    for (loss, aux, _, _), (ref_loss, ref_aux, _, _) in zip(results["ref_ga2"]["steps"][:1], results["ref"]["steps"][:1]):
        assert _close(loss, ref_loss) and aux != ref_aux


def test_first_step_lm_plus_aux_loss_matches_plain_hf(results):
    loss, aux, norm, load = results["ref"]["steps"][0]
    hf_loss, hf_norm = results["ref"]["hf_step1"]
    assert _close(loss + COEF * aux, hf_loss), f"step 1: {loss} + {COEF} x {aux} vs HF {hf_loss}"
    assert _close(norm, hf_norm), f"step 1: grad norm {norm} vs HF {hf_norm}"
    assert load["max"] >= load["mean"] > 0


def test_router_aux_loss_on_a_dense_model_is_a_config_error():
    from mmfsdp.train.check import model_check

    cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", ["features.loss_cfg.router_aux_loss_coef=0.01"])
    errors = [e for e in model_check(cfg) if "router_aux_loss_coef" in str(e)]
    assert len(errors) == 1 and "features.loss_cfg.router_aux_loss_coef" in str(errors[0]), errors
    assert "dense" in str(errors[0])
