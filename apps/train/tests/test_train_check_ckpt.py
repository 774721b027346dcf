"""`apps/train --check` reads the checkpoint the run would load (metadata only) and compares it with the model.

Checkpoints are written in-process by the trainer's own writers (`save_checkpoint` with model + AdamW state,
adapter-only LoRA saves, `dcp_to_hf` exports) from tiny models built from the examples' configs.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmfsdp.ckpt import dcp_to_hf, hf_to_dcp, save_checkpoint
from mmfsdp.ckpt.lora import LORA_METADATA, dcp_to_peft
from mmfsdp.model import apply_lora, get_model_entry
from mmfsdp.model.config import ModelConfig
from mmfsdp.model.lora import LoraConfig, lora_metadata
from mmfsdp.train.check_ckpt import MAX_LINES
from mmfsdp.train.cli import main

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "tiny" / "assets"
MOE = ROOT / "examples" / "qwen3vl-moe-tiny"
TARGETS = ["q_proj", "v_proj"]


def _build(model_id: str, assets: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model_cfg = ModelConfig(model_id=model_id, model_name_or_path=str(assets), random_init=True)
    return get_model_entry(model_id).build(model_cfg)


def _save_trained(model: torch.nn.Module, save_dir: Path, iteration: int = 4, **kwargs) -> Path:
    """A checkpoint as the trainer writes it: model + AdamW state after a step, scheduler and step in app_state."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    save_checkpoint(save_dir, iteration, model=model, optimizer=optimizer,
                    app_state={"step": iteration, "scheduler": {}}, **kwargs)
    return save_dir


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    model = _build("mistral3", ASSETS)
    good = _save_trained(model, root / "good")
    hf_good = dcp_to_hf(good, root / "hf_good", ASSETS, progress=False)

    wider = root / "wider_assets"  # another tiny mistral3: text hidden size 96 instead of 128
    wider.mkdir()
    config = json.loads((ASSETS / "config.json").read_text())
    config["text_config"]["hidden_size"] = 96
    (wider / "config.json").write_text(json.dumps(config))
    wrong = _save_trained(_build("mistral3", wider), root / "wrong")

    edited = root / "hf_edited"  # the good export with lm_head removed and a key no model has
    shutil.copytree(hf_good, edited)
    index = json.loads((edited / "model.safetensors.index.json").read_text())
    (shard,) = set(index["weight_map"].values())
    tensors = load_file(edited / shard)
    del tensors["language_model.lm_head.weight"]
    tensors["language_model.model.extra.weight"] = torch.zeros(3, 4)
    save_file(tensors, edited / shard)
    index["weight_map"] = {key: shard for key in tensors}
    (edited / "model.safetensors.index.json").write_text(json.dumps(index))

    lora_cfg = LoraConfig(enable=True, rank=4, target_modules=TARGETS)
    lora_model = _build("mistral3", ASSETS)
    modules = apply_lora(lora_model, lora_cfg, get_model_entry("mistral3"))
    lora = _save_trained(lora_model, root / "lora", trainable_only=True,
                         metadata={LORA_METADATA: lora_metadata(lora_cfg, modules)})

    moe = _save_trained(_build("qwen3_vl_moe", MOE / "assets"), root / "moe")
    return {"good": good, "hf_good": hf_good, "wrong": wrong, "hf_edited": edited, "lora": lora, "moe": moe}


def _check(capsys, tmp_path, *overrides, config=TINY, nproc=2):
    code = main([str(config), "--check", f"training.output_dir={tmp_path / 'out'}",
                 f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}", *overrides,
                 "--nproc-per-node", str(nproc)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("config error: ")]
    return code, lines, captured


def _passes(capsys, tmp_path, *overrides, **kwargs):
    code, lines, captured = _check(capsys, tmp_path, *overrides, **kwargs)
    assert code == 0 and not lines, captured.err[-3000:]
    return captured.out


def test_matching_dcp_checkpoint_passes_resume_and_load(capsys, tmp_path, ckpts):
    out = _passes(capsys, tmp_path, f"training.save={ckpts['good']}")
    assert f"resuming from {ckpts['good'] / 'iter_0000004'}" in out
    out = _passes(capsys, tmp_path, f"training.load={ckpts['good']}", f"training.save={tmp_path / 'new'}")
    assert "resuming from" in out


def test_dcp_checkpoint_of_another_model_lists_its_mismatches(capsys, tmp_path, ckpts):
    code, lines, _ = _check(capsys, tmp_path, f"training.save={ckpts['wrong']}")
    assert code == 2 and all(line.startswith("config error: training.save: ") for line in lines)
    assert "does not fit model mistral3" in lines[0] and "shape mismatch" in lines[0]
    assert str(ckpts["wrong"] / "iter_0000004") in lines[0]
    problems = [line.removeprefix("config error: training.save: ") for line in lines[1:]]
    assert len(problems) == MAX_LINES + 1 and problems[-1].startswith("... and ")
    embed = "model.language_model.embed_tokens.weight"
    vocab = json.loads((ROOT / "examples" / "tiny" / "assets" / "config.json").read_text())["text_config"]["vocab_size"]
    assert f"{embed}: shape ({vocab}, 128) in the model, ({vocab}, 96) in the checkpoint" in problems
    assert not any("optimizer" in line for line in lines)

    code, lines, _ = _check(capsys, tmp_path, f"training.load={ckpts['wrong']}", f"training.save={tmp_path / 'new'}")
    assert code == 2 and lines[0].startswith("config error: training.load: ") and len(lines) == MAX_LINES + 2


def test_matching_hf_directory_passes(capsys, tmp_path, ckpts):
    out = _passes(capsys, tmp_path, f"training.load={ckpts['hf_good']}", "training.load_format=hf")
    assert f"HF weights from training.load {ckpts['hf_good']}" in out
    _passes(capsys, tmp_path, f"model.model_name_or_path={ckpts['hf_good']}", "model.random_init=false")


def test_hf_directory_with_a_missing_and_an_extra_key(capsys, tmp_path, ckpts):
    code, lines, _ = _check(capsys, tmp_path, f"training.load={ckpts['hf_edited']}", "training.load_format=hf")
    assert code == 2
    assert "(1 missing, 1 unexpected)" in lines[0]
    assert lines[1:] == [
        "config error: training.load: missing key lm_head.weight (in the model, not in the checkpoint)",
        "config error: training.load: unexpected key language_model.model.extra.weight "
        "(in the checkpoint, not in the model)",
    ]
    code, lines, _ = _check(capsys, tmp_path, f"model.model_name_or_path={ckpts['hf_edited']}",
                            "model.random_init=false")
    assert code == 2 and len(lines) == 3
    assert all(line.startswith("config error: model.model_name_or_path: ") for line in lines)


def test_hf_directory_of_another_model(capsys, tmp_path, ckpts):
    hf_wrong = dcp_to_hf(ckpts["wrong"], tmp_path / "hf_wrong", ckpts["wrong"].parent / "wider_assets", progress=False)
    code, lines, _ = _check(capsys, tmp_path, f"training.load={hf_wrong}", "training.load_format=hf")
    assert code == 2 and lines[-1].startswith("config error: training.load: ... and ")
    k_proj = "model.language_model.layers.0.self_attn.k_proj.weight"
    assert f"config error: training.load: {k_proj}: shape (64, 128) in the model, (64, 96) in the checkpoint" in lines


def test_released_weights(capsys, tmp_path, ckpts):
    """`training.load` at an `mm-convert hf_to_dcp` output: the release's model tensors are compared."""
    hf_to_dcp(ckpts["hf_good"], tmp_path / "good_dcp")
    out = _passes(capsys, tmp_path, f"training.load={tmp_path / 'good_dcp'}")
    assert "released DCP weights" in out
    hf_to_dcp(ckpts["hf_edited"], tmp_path / "edited_dcp")
    code, lines, _ = _check(capsys, tmp_path, f"training.load={tmp_path / 'edited_dcp'}")
    assert code == 2 and "the released weights" in lines[0] and lines[1:] == [
        "config error: training.load: missing key lm_head.weight (in the model, not in the checkpoint)",
        "config error: training.load: unexpected key model.language_model.extra.weight "
        "(in the checkpoint, not in the model)",
    ]


def test_lora_adapter_checkpoint(capsys, tmp_path, ckpts):
    lora = ("training.lora.enable=true", f"training.lora.target_modules=[{', '.join(TARGETS)}]")
    out = _passes(capsys, tmp_path, f"training.save={ckpts['lora']}", *lora, "training.lora.rank=4")
    assert "LoRA adapters" in out
    code, lines, _ = _check(capsys, tmp_path, f"training.save={ckpts['lora']}", *lora, "training.lora.rank=8")
    assert code == 2 and "adapter-only checkpoint" in lines[0] and "training.lora" in lines[0]
    key = "model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert f"config error: training.save: {key}: shape (8, 128) in the model, (4, 128) in the checkpoint" in lines
    # the frozen base comes from the initial weights: a LoRA run on the edited HF export reports its keys too
    code, lines, _ = _check(capsys, tmp_path, f"training.load={ckpts['hf_edited']}", "training.load_format=hf", *lora,
                            f"training.save={tmp_path / 'new'}")
    assert code == 2
    assert "config error: training.load: missing key lm_head.weight (in the model, not in the checkpoint)" in lines


def test_moe_checkpoint_under_expert_parallel(capsys, tmp_path, ckpts):
    """Expert tensors are stored with their global [E, ...] shape, so a checkpoint fits any EP size."""
    _passes(capsys, tmp_path, f"training.save={ckpts['moe']}", config=MOE / "config.yaml")
    # exported in the hub layout (experts transposed), read back through the family's state-dict adapter
    hf = dcp_to_hf(ckpts["moe"], tmp_path / "moe_hf", MOE / "assets", progress=False)
    header = load_file(next(hf.glob("*.safetensors")))
    experts = "model.language_model.layers.0.mlp.experts"
    gate_up, down = header[f"{experts}.gate_up_proj"].shape, header[f"{experts}.down_proj"].shape
    assert gate_up[2] == 2 * down[1]  # [E, H, 2I], [E, I, H]: not the model's [E, 2I, H], [E, H, I]
    _passes(capsys, tmp_path, f"training.load={hf}", "training.load_format=hf", config=MOE / "config.yaml")
    tensors = load_file(next(hf.glob("*.safetensors")))
    tensors[f"{experts}.down_proj"] = tensors[f"{experts}.down_proj"][:4].contiguous()  # 4 of the 8 experts
    save_file(tensors, next(hf.glob("*.safetensors")))
    code, lines, _ = _check(capsys, tmp_path, f"training.load={hf}", "training.load_format=hf",
                            config=MOE / "config.yaml")
    assert code == 2 and any(f"{experts}" in line for line in lines[1:]), lines
    code, lines, _ = _check(capsys, tmp_path, f"training.save={ckpts['moe']}", "training.lora.enable=true",
                            "training.lora.target_modules=[q_proj]", config=MOE / "config.yaml")
    assert code == 2 and any("holds a whole model" in line for line in lines)


def test_pretrained_lora_adapter(capsys, tmp_path, ckpts):
    """`training.lora.pretrained_lora_path` (a PEFT directory, loaded at every start) against the LoRA model."""
    peft = dcp_to_peft(ckpts["lora"], tmp_path / "peft")
    lora = ("training.lora.enable=true", "training.lora.rank=4", f"training.lora.pretrained_lora_path={peft}",
            "training.lora.alpha=16")
    _passes(capsys, tmp_path, *lora, f"training.lora.target_modules=[{', '.join(TARGETS)}]")
    code, lines, _ = _check(capsys, tmp_path, *lora, "training.lora.target_modules=[q_proj]")
    assert code == 2 and "the PEFT adapter" in lines[0] and "(8 unexpected)" in lines[0]  # A and B of 4 v_proj layers
    assert ("config error: training.lora.pretrained_lora_path: unexpected key "
            "base_model.model.model.language_model.layers.0.self_attn.v_proj.lora_A.weight "
            "(in the checkpoint, not in the model)") in lines
