"""LoRA through the real trainer: the tiny Mistral3 run from HF weights, 4 steps, fp32 on gloo.

The base is a `save_pretrained` tiny Mistral3 (original `language_model.model.*` naming); LoRA rank 8 on the
attention projections of every layer, vision tower included (`q_proj`, `k_proj`, `v_proj`, `o_proj`).

- With B = 0 the first step's loss is the full model's exactly (the full fine-tune from the same weights).
- Per-step loss and gradient norm of every 2-process layout equal the 1-process LoRA run (relative 1e-5):
  FSDP2 (data parallel 2); meta-device init from the HF directory (`training.load`, `load_format: hf`) with
  chunk loss and recompute; Ulysses 2; Ring 2; HSDP (2 replicas of 1 shard).
- Only adapters change: after training every base tensor equals the HF file's bitwise (1 and 2 processes).
- A bf16 base with fp32 adapters in the same FSDP2 groups trains (finite losses, adapters stay fp32).
- `training.lora.pretrained_lora_path` = the trained run exported with `dcp_to_peft` starts a trainer with
  exactly the trained adapters.
- Export: the LoRA checkpoint through `mm-convert LoraConverter dcp_to_peft` loaded by
  `PeftModel.from_pretrained(HF base, dir)`, and through `dcp_to_merged_hf` loaded by `from_pretrained`, give
  the trained model's logits (relative 1e-5); the LoRA checkpoint is at most 1/10 the size of the full one.

The cases are a table run by `tests/parity.py` (each world size spawned once); the HF directory is the
session's seed-3 tiny Mistral3 (`parity.write_tiny_hf`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apprun import TINY
from parity import Case, Probe, assert_matches, full_tensor, learns, run_cases, session_dir, write_tiny_hf

STEPS = 4
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LORA = {
    "training.lora.enable": "true",
    "training.lora.rank": 8,
    "training.lora.alpha": 16,
    "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj]",
    "training.lr": 1.0e-2,
}
HF = "{shared}/hf_tiny_seed3"


def _adapters(trainer) -> dict:
    return {k: full_tensor(v) for k, v in trainer.model.state_dict().items() if "lora_" in k}


class BaseChanges(Probe):
    """Base tensors of the trained model that differ from the HF files (collective: full tensors)."""

    name = "base_changes"

    def result(self, trainer) -> list[str]:
        return _base_changes(trainer, Path(trainer.cfg.model.model_name_or_path))


class TrainedModel(Probe):
    """The trained adapters, the first micro-batch and the trained model's logits on it."""

    name = "trained"

    def attach(self, trainer) -> None:
        from mmfsdp.model import model_inputs

        state = trainer.loader.state_dict()
        self.batch = model_inputs(next(trainer.loader))
        trainer.loader.load_state_dict(state)

    def result(self, trainer) -> dict:
        import torch

        with torch.no_grad():
            logits = trainer.model.eval()(**self.batch).logits.detach().clone()
        return {"adapters": _adapters(trainer), "batch": self.batch, "logits": logits}


class FromPeft(Probe):
    """Export `ref`'s checkpoint with `dcp_to_peft` into the directory the case loads, before its trainer is built;
    record the adapters the trainer starts from."""

    name = "adapters"

    def __init__(self, case: dict, rank: int):
        super().__init__(case, rank)
        from mmfsdp.ckpt.lora import dcp_to_peft

        items = dict(item.split("=", 1) for item in case["overrides"])
        peft = Path(items["training.lora.pretrained_lora_path"])
        dcp_to_peft(peft.parent / "ckpt" / "ref", peft)

    def result(self, trainer) -> dict:
        return _adapters(trainer)


class AdapterDtypes(Probe):
    name = "adapter_dtypes"

    def result(self, trainer) -> list[str]:
        return sorted({str(p.dtype) for n, p in trainer.model.named_parameters() if "lora_" in n})


def _case(name: str, world: int, overrides: dict, ref: str | None = None, layout: tuple | None = None,
          **kw) -> Case:
    base = {"model.model_name_or_path": HF, "model.random_init": "false", "training.micro_batch_size": 4,
            "training.train_iters": STEPS}
    expected = None if layout is None else dict(zip(("dp", "ulysses", "ring"), layout))
    return Case(name, world, TINY, {**base, **overrides}, ref, dataset="shapes", layout=expected, **kw)


MBS2 = {"training.micro_batch_size": 2}
CASES = {
    case.name: case
    for case in [
        _case("full", 1, {"training.save": "{tmp}/ckpt/full"}),
        # padded micro-batches: the exported PEFT / merged models take its batch as plain HF does
        _case("ref", 1, {**LORA, "training.save": "{tmp}/ckpt/ref", "data.dataloader_param.padding_free": "false"},
              probes=(BaseChanges, TrainedModel)),
        _case("from_peft", 1, {**LORA, "training.lora.pretrained_lora_path": "{tmp}/peft_ref"}, probes=(FromPeft,),
              train=False),
        _case("fsdp2", 2, {**LORA, **MBS2}, "ref", (2, 1, 1), probes=(BaseChanges,)),
        _case("fsdp2_meta_chunk_recompute", 2, {
            **LORA, **MBS2, "training.init_model_with_meta_device": "true", "training.load": HF,
            "training.load_format": "hf", "model.model_name_or_path": str(TINY.parent / "assets"),
            "features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 16,
            "parallel.recompute": "true",
        }, "ref", (2, 1, 1)),
        _case("ulysses2", 2, {**LORA, "parallel.ulysses_parallel_size": 2}, "ref", (1, 2, 1)),
        _case("ring2", 2, {**LORA, "parallel.ring_attention_size": 2}, "ref", (1, 1, 2)),
        _case("hsdp", 2, {**LORA, **MBS2, "parallel.data_parallel_replicate_size": 2,
                          "parallel.fully_shard_parallel_size": 1}, "ref", (2, 1, 1)),
        _case("fsdp2_bf16", 2, {**LORA, **MBS2, "model.dtype": "bf16", "parallel.fsdp_plan.param_dtype": "bf16"},
              probes=(AdapterDtypes,)),
    ]
}


def _base_changes(trainer, hf_dir: Path) -> list[str]:
    """Base tensors of the trained model that differ from the HF files (collective: full tensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    from mmfsdp.ckpt import SafetensorsDir, find_state_dict_adapter
    from mmfsdp.ckpt.adapters import plan_from_hf
    from mmfsdp.ckpt.lora import stored_key

    files = SafetensorsDir(hf_dir)
    plans = plan_from_hf(
        find_state_dict_adapter(files.config), {k: (i.shape, i.dtype) for k, i in files.tensors.items()}
    )
    changed = []
    for key, value in trainer.model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if stored_key(key) is not None and not torch.equal(full.cpu(), plans[stored_key(key)].build(files.read)):
            changed.append(key)
    return changed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    shared, tmp = session_dir(tmp_path_factory), tmp_path_factory.mktemp("lora")
    write_tiny_hf(shared / "hf_tiny_seed3")
    return tmp, shared, run_cases(list(CASES.values()), tmp, shared)


def test_lora_first_step_with_zero_b_is_the_base_models_exactly(results):
    _, _, out = results
    assert out["ref"]["steps"][0][0] == out["full"]["steps"][0][0]
    assert out["ref"]["steps"][0][2] == out["full"]["steps"][0][2]


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_meta_chunk_recompute", "ulysses2", "ring2", "hsdp"])
def test_lora_layout_matches_one_process(results, name):
    _, _, out = results
    assert out["ref"]["layout"]["dp"] == out["ref"]["layout"]["ulysses"] == out["ref"]["layout"]["ring"] == 1
    assert_matches(out, CASES[name])
    assert learns(out["ref"]), "the LoRA run should learn"


def test_lora_pretrained_path_starts_from_the_exported_adapters(results):
    import torch

    _, _, out = results
    loaded, trained = out["from_peft"]["adapters"][0], out["ref"]["trained"][0]["adapters"]
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)


def test_lora_changes_only_the_adapters(results):
    _, _, out = results
    assert out["ref"]["base_changes"][0] == [] and out["fsdp2"]["base_changes"][0] == []


def test_lora_bf16_base_with_fp32_adapters_trains(results):
    _, _, out = results
    import math

    assert out["fsdp2_bf16"]["adapter_dtypes"][0] == ["torch.float32"]
    assert all(math.isfinite(loss) for loss, _, _ in out["fsdp2_bf16"]["steps"])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_lora_checkpoint_exports_give_the_trained_logits_and_are_small(results):
    import torch
    from peft import PeftModel
    from transformers import Mistral3ForConditionalGeneration

    from mmfsdp.ckpt.cli import main as mm_convert
    from mmfsdp.model.testing import assert_close

    tmp, shared, out = results
    hf = shared / "hf_tiny_seed3"
    lora_ckpt, full_ckpt = tmp / "ckpt" / "ref" / f"iter_{STEPS:07d}", tmp / "ckpt" / "full" / f"iter_{STEPS:07d}"
    assert _dir_bytes(lora_ckpt) * 10 <= _dir_bytes(full_ckpt), (_dir_bytes(lora_ckpt), _dir_bytes(full_ckpt))

    ckpt = str(tmp / "ckpt" / "ref")
    assert mm_convert(["LoraConverter", "dcp_to_peft", "--load_dir", ckpt, "--save_dir", str(tmp / "peft")]) == 0
    assert mm_convert([
        "LoraConverter", "dcp_to_merged_hf", "--load_dir", ckpt, "--save_dir", str(tmp / "merged"),
        "--model_assets_dir", str(hf),
    ]) == 0
    trained = out["ref"]["trained"][0]
    peft_model = PeftModel.from_pretrained(Mistral3ForConditionalGeneration.from_pretrained(hf), tmp / "peft")
    merged = Mistral3ForConditionalGeneration.from_pretrained(tmp / "merged")
    with torch.no_grad():
        assert_close(peft_model.eval()(**trained["batch"]).logits, trained["logits"], 1e-5, "PEFT logits")
        assert_close(merged.eval()(**trained["batch"]).logits, trained["logits"], 1e-5, "merged logits")
