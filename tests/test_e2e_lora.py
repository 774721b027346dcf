"""LoRA through the real trainer: the tiny Mistral3 run from HF weights, 5 steps, fp32 on gloo.

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

Each world size is spawned once (module fixture) and runs all of its trainers in turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mmfsdp.data import prepare_dataset
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "tiny" / "assets"
STEPS = 5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

LORA = {
    "training.lora.enable": "true",
    "training.lora.rank": 8,
    "training.lora.alpha": 16,
    "training.lora.target_modules": "[q_proj,k_proj,v_proj,o_proj]",
    "training.lr": 1.0e-2,
}


def _overrides(tmp: Path, name: str, **extra) -> list[str]:
    items = {
        "model.model_name_or_path": str(tmp / "hf"),
        "model.random_init": "false",
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "data"),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache"),
        "data.dataset_param.synthetic.num_train": 32,
        "data.dataset_param.synthetic.num_eval": 4,
        "training.micro_batch_size": 4,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


# name: (world size, overrides); "ref" is the reference of every 2-process run
RUNS = {
    "full": (1, {"training.save": "{tmp}/ckpt/full"}),
    # padded micro-batches: the exported PEFT / merged models take its batch as plain HF does
    "ref": (1, {**LORA, "training.save": "{tmp}/ckpt/ref", "data.dataloader_param.padding_free": "false"}),
    "from_peft": (1, {**LORA, "training.lora.pretrained_lora_path": "{tmp}/peft_ref"}),  # built, not trained
    "fsdp2": (2, {**LORA, "training.micro_batch_size": 2}),
    "fsdp2_meta_chunk_recompute": (
        2,
        {
            **LORA,
            "training.micro_batch_size": 2,
            "training.init_model_with_meta_device": "true",
            "training.load": "{tmp}/hf",
            "training.load_format": "hf",
            "model.model_name_or_path": str(ASSETS),
            "features.enable_chunk_loss": "true",
            "features.chunkloss_plan.chunk_size": 16,
            "parallel.recompute": "true",
        },
    ),
    "ulysses2": (2, {**LORA, "parallel.ulysses_parallel_size": 2}),
    "ring2": (2, {**LORA, "parallel.ring_attention_size": 2}),
    "hsdp": (
        2,
        {
            **LORA,
            "training.micro_batch_size": 2,
            "parallel.data_parallel_replicate_size": 2,
            "parallel.fully_shard_parallel_size": 1,
        },
    ),
    "fsdp2_bf16": (
        2,
        {**LORA, "training.micro_batch_size": 2, "model.dtype": "bf16", "parallel.fsdp_plan.param_dtype": "bf16"},
    ),
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


def _train(rank, world_size, tmp, runs):
    import torch

    from mmfsdp.model import model_inputs
    from mmfsdp.train.trainer import Trainer

    def adapters(trainer):
        from torch.distributed.tensor import DTensor

        state = trainer.model.state_dict()
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items() if "lora_" in k}

    results, trained = {}, None
    for name, overrides in runs:
        if name == "from_peft":
            from mmfsdp.ckpt.lora import dcp_to_peft

            dcp_to_peft(tmp / "ckpt" / "ref", tmp / "peft_ref")
            trainer = Trainer(load_config(TINY, overrides), "cpu")
            loaded = adapters(trainer)
            results[name] = {"same_adapters": loaded.keys() == trained.keys()
                             and all(torch.equal(loaded[k], trained[k]) for k in trained)}
            trainer.close()
            continue
        trainer = Trainer(load_config(TINY, overrides), "cpu")
        state = trainer.loader.state_dict()
        batch = model_inputs(next(trainer.loader))
        trainer.loader.load_state_dict(state)
        trainer.train()
        result = {
            "steps": [(r.loss, r.grad_norm, r.num_tokens) for r in trainer.history],
            "layout": (trainer.dims.dp_size, trainer.plan.ulysses, trainer.plan.ring),
        }
        if name in ("ref", "fsdp2"):
            result["base_changes"] = _base_changes(trainer, tmp / "hf")
        if name == "ref":
            trained = adapters(trainer)
            with torch.no_grad():
                result["logits"] = trainer.model.eval()(**batch).logits.detach().clone()
            result["batch"] = batch
        if name == "fsdp2_bf16":
            result["adapter_dtypes"] = sorted(
                {str(p.dtype) for n, p in trainer.model.named_parameters() if "lora_" in n}
            )
        trainer.close()
        results[name] = result
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tmp = tmp_path_factory.mktemp("lora")
    torch.manual_seed(3)
    Mistral3ForConditionalGeneration(Mistral3Config.from_pretrained(ASSETS)).save_pretrained(tmp / "hf")
    prepare_dataset(load_config(TINY, _overrides(tmp, "prepare")).data)
    out = {}
    for world_size in (1, 2):
        runs = [
            (name, _overrides(tmp, name, **{k: str(v).format(tmp=tmp) for k, v in extra.items()}))
            for name, (world, extra) in RUNS.items()
            if world == world_size
        ]
        out.update(run_distributed(_train, world_size, tmp, runs, timeout=900)[0])
    return tmp, out


def _close(value: float, reference: float) -> bool:
    return abs(value - reference) <= 1e-5 * abs(reference)


def test_lora_first_step_with_zero_b_is_the_base_models_exactly(results):
    _, out = results
    assert out["ref"]["steps"][0][0] == out["full"]["steps"][0][0]
    assert out["ref"]["steps"][0][2] == out["full"]["steps"][0][2]


@pytest.mark.parametrize(
    "name, layout",
    [
        ("fsdp2", (2, 1, 1)),
        ("fsdp2_meta_chunk_recompute", (2, 1, 1)),
        ("ulysses2", (1, 2, 1)),
        ("ring2", (1, 1, 2)),
        ("hsdp", (2, 1, 1)),
    ],
)
def test_lora_layout_matches_one_process(results, name, layout):
    _, out = results
    assert out[name]["layout"] == layout and out["ref"]["layout"] == (1, 1, 1), "(data-parallel, Ulysses, Ring size)"
    got, expected = out[name]["steps"], out["ref"]["steps"]
    assert len(got) == len(expected) == STEPS
    for step, ((loss, norm, tokens), (ref_loss, ref_norm, ref_tokens)) in enumerate(zip(got, expected), 1):
        assert tokens == ref_tokens, f"{name}, step {step}: {tokens} tokens vs {ref_tokens}"
        assert _close(loss, ref_loss), f"{name}, step {step}: loss {loss} vs {ref_loss}"
        assert _close(norm, ref_norm), f"{name}, step {step}: grad norm {norm} vs {ref_norm}"
    assert expected[-1][0] < expected[0][0], "the LoRA run should learn"


def test_lora_pretrained_path_starts_from_the_exported_adapters(results):
    _, out = results
    assert out["from_peft"]["same_adapters"]


def test_lora_changes_only_the_adapters(results):
    _, out = results
    assert out["ref"]["base_changes"] == [] and out["fsdp2"]["base_changes"] == []


def test_lora_bf16_base_with_fp32_adapters_trains(results):
    _, out = results
    import math

    assert out["fsdp2_bf16"]["adapter_dtypes"] == ["torch.float32"]
    assert all(math.isfinite(loss) for loss, _, _ in out["fsdp2_bf16"]["steps"])


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_lora_checkpoint_exports_give_the_trained_logits_and_are_small(results):
    import torch
    from peft import PeftModel
    from transformers import Mistral3ForConditionalGeneration

    from mmfsdp.ckpt.cli import main as mm_convert
    from mmfsdp.model.testing import rel_diff

    tmp, out = results
    lora_ckpt, full_ckpt = tmp / "ckpt" / "ref" / f"iter_{STEPS:07d}", tmp / "ckpt" / "full" / f"iter_{STEPS:07d}"
    assert _dir_bytes(lora_ckpt) * 10 <= _dir_bytes(full_ckpt), (_dir_bytes(lora_ckpt), _dir_bytes(full_ckpt))

    assert (
        mm_convert(
            ["LoraConverter", "dcp_to_peft", "--load_dir", str(tmp / "ckpt" / "ref"), "--save_dir", str(tmp / "peft")]
        )
        == 0
    )
    assert (
        mm_convert(
            [
                "LoraConverter",
                "dcp_to_merged_hf",
                "--load_dir",
                str(tmp / "ckpt" / "ref"),
                "--save_dir",
                str(tmp / "merged"),
                "--model_assets_dir",
                str(tmp / "hf"),
            ]
        )
        == 0
    )
    batch, trained = out["ref"]["batch"], out["ref"]["logits"]
    peft_model = PeftModel.from_pretrained(Mistral3ForConditionalGeneration.from_pretrained(tmp / "hf"), tmp / "peft")
    merged = Mistral3ForConditionalGeneration.from_pretrained(tmp / "merged")
    with torch.no_grad():
        assert rel_diff(peft_model.eval()(**batch).logits, trained) <= 1e-5
        assert rel_diff(merged.eval()(**batch).logits, trained) <= 1e-5
