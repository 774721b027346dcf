"""LoRA (`mmfsdp.model.lora`) on every registered family, fp32 on the CPU, one process.

- `training.lora` values and target resolution (patterns, leaf names, the errors with their hints);
- injection keeps every module path, freezes the base, adapters fp32 on a bf16 base, B = 0 gives the base
  model's logits exactly;
- meta build + `load_hf_weights(key_map=stored_key)` + `init_lora_adapters` equals the eager build bitwise;
- export: a trainable-only checkpoint of the adapted model -> `mm-convert LoraConverter dcp_to_peft` loaded
  by `PeftModel.from_pretrained(HF base, dir)`, and `dcp_to_merged_hf` loaded by `from_pretrained`, give our
  model's logits (relative 1e-5), for mistral3, qwen3_vl and qwen3_vl_moe, and for qwen3_5 and qwen3_5_moe with
  the Gated DeltaNet, attention and vision-attention presets; the PEFT directory loads back as
  `pretrained_lora_path`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmfsdp.ckpt import load_hf_weights, save_checkpoint
from mmfsdp.ckpt.cli import main as mm_convert
from mmfsdp.ckpt.lora import stored_key
from mmfsdp.config import ConfigError, build
from mmfsdp.model import ModelConfig, get_model_entry
from mmfsdp.model.lora import (
    LoraConfig,
    apply_lora,
    init_lora_adapters,
    load_lora_adapter,
    lora_layers,
    lora_metadata,
    resolve_lora_targets,
)
from mmfsdp.model.meta_init import init_rotary_buffers
from mmfsdp.model.families.qwen3_vl.model import mm_token_types
from mmfsdp.model.testing import assert_close, model_inputs
from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_batch, qwen3_vl_sample
from mmfsdp.model.families.mistral3.testing import tiny_batch

FAMILIES = ("mistral3", "qwen3_vl", "qwen3_vl_moe")
TOL = 1e-5


def _lora(**kwargs) -> LoraConfig:
    return LoraConfig(
        **{
            "enable": True,
            "rank": 4,
            "alpha": 8.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            **kwargs,
        }
    )


def _hf_class(entry):
    return entry.model_class.__bases__[-1]  # (TrainingForwardMixin or a family mixin, the HF class)


def _inputs(entry, config) -> dict[str, torch.Tensor]:
    if entry.model_id == "mistral3":
        return model_inputs(tiny_batch(config, batch_size=1, seq_len=24, image_sizes=((32, 32),)))
    inputs = model_inputs(qwen3_vl_batch([[qwen3_vl_sample(config, 20, [(4, 4)], seed=1)]], seq_len=20))
    inputs["mm_token_type_ids"] = mm_token_types(inputs["input_ids"], config.image_token_id, config.video_token_id)
    return inputs


@torch.no_grad()
def _logits(model, inputs) -> torch.Tensor:
    return model.eval()(**inputs).logits


def _save_base(entry, path, seed: int = 0):
    torch.manual_seed(seed)
    config = entry.testkit.tiny_config()
    _hf_class(entry)._from_config(config, attn_implementation="sdpa").save_pretrained(path)
    return config


def _build(entry, path, device="cpu", dtype=None):
    return entry.build(ModelConfig(model_id=entry.model_id, model_name_or_path=str(path)), device=device, dtype=dtype)


@pytest.mark.parametrize(
    "values, key",
    [
        ({"rank": 0}, "rank"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"enable": True}, "target_modules"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    ],
)
def test_lora_config_values_name_the_key(values, key):
    with pytest.raises(ConfigError) as err:
        build(LoraConfig, values, "training.lora")
    assert err.value.key == f"training.lora.{key}"


def test_targets_by_pattern_and_by_leaf_name_and_the_errors():
    entry = get_model_entry("mistral3")
    with torch.device("meta"):
        model = entry.model_class._from_config(entry.testkit.tiny_config())
    by_leaf = resolve_lora_targets(model, ["q_proj"], entry)
    assert "model.language_model.layers.1.self_attn.q_proj" in by_leaf
    assert "model.vision_tower.transformer.layers.0.attention.q_proj" in by_leaf  # a leaf name is every such module
    assert resolve_lora_targets(
        model, ["model.language_model.layers.{*}.self_attn.q_proj", "model.language_model.layers.1.self_attn.q_proj"]
    ) == ["model.language_model.layers.0.self_attn.q_proj", "model.language_model.layers.1.self_attn.q_proj"]
    cases = [
        (["q_prj"], "similar names: q_proj"),
        (["model.language_model.layers.{*}.self_atn.q_proj"], "model.language_model.layers.{*}.self_attn.q_proj"),
        (["model.language_model.layers.{*}.self_attn"], "MistralAttention; LoRA wraps nn.Linear"),
        (["lm_head"], "the output projection"),
    ]
    for targets, hint in cases:
        with pytest.raises(ConfigError) as err:
            resolve_lora_targets(model, ["v_proj", *targets], entry)
        assert err.value.key == "training.lora.target_modules[1]" and hint in err.value.message, err.value.message


@pytest.mark.parametrize("model_id", FAMILIES)
def test_injection_keeps_paths_freezes_the_base_and_zero_b_is_the_base_model(model_id):
    entry = get_model_entry(model_id)
    config = entry.testkit.tiny_config()
    torch.manual_seed(0)
    model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    inputs = _inputs(entry, config)
    before_modules = {name for name, _ in model.named_modules()}
    base_logits = _logits(model, inputs)
    names = apply_lora(model, _lora(), entry)
    init_lora_adapters(model, _lora(), seed=0)
    assert before_modules <= {name for name, _ in model.named_modules()}, "a module path disappeared"
    assert names and set(lora_layers(model)) == set(names)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert torch.equal(_logits(model, inputs), base_logits), "B = 0 must leave the model's output unchanged"
    a = model.get_submodule(names[0]).lora_A["default"].weight
    assert a.abs().sum() > 0 and a.dtype == torch.float32


def test_adapters_stay_fp32_on_a_bf16_base():
    entry = get_model_entry("qwen3_vl")
    model = entry.model_class._from_config(entry.testkit.tiny_config(), dtype=torch.bfloat16)
    apply_lora(model, _lora(), entry)
    dtypes = {("lora_" in name, p.dtype) for name, p in model.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}


def test_meta_build_loaded_from_hf_equals_the_eager_build(tmp_path):
    entry = get_model_entry("mistral3")
    config = _save_base(entry, tmp_path / "base")
    lora = _lora(init_lora_weights=False)
    eager = _build(entry, tmp_path / "base")
    apply_lora(eager, lora, entry)
    init_lora_adapters(eager, lora, seed=3)
    meta = _build(entry, tmp_path / "base", device="meta")
    apply_lora(meta, lora, entry)
    meta.to_empty(device="cpu")
    init_rotary_buffers(meta)
    result = load_hf_weights(meta, tmp_path / "base", key_map=stored_key)
    assert result.missing_keys == [] and result.unexpected_keys == []
    init_lora_adapters(meta, lora, seed=3)
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), name
    inputs = _inputs(entry, config)
    assert torch.equal(_logits(meta, inputs), _logits(eager, inputs))


ATTENTION_TARGETS = ["q_proj", "v_proj", "model.language_model.layers.{*}.self_attn.o_proj"]
QWEN3_5_TARGETS = ["preset:attention", "preset:gated_deltanet", "preset:vision_attention"]
EXPORT_ROWS = [
    *[(model_id, ATTENTION_TARGETS) for model_id in FAMILIES],
    ("qwen3_5", QWEN3_5_TARGETS),
    ("qwen3_5_moe", QWEN3_5_TARGETS),
]
"""(model id, LoRA targets) of the export test: Qwen3.5's presets cover its Gated DeltaNet projections
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`), the gated attention and the vision attention."""


@pytest.mark.parametrize("model_id, targets", EXPORT_ROWS)
def test_exports_give_our_logits_through_peft_and_merged_weights(tmp_path, model_id, targets):
    from peft import PeftModel

    entry = get_model_entry(model_id)
    config = _save_base(entry, tmp_path / "base")
    lora = _lora(init_lora_weights=False, target_modules=targets)
    model = _build(entry, tmp_path / "base")
    names = apply_lora(model, lora, entry)
    init_lora_adapters(model, lora, seed=1)
    save_checkpoint(
        tmp_path / "ckpt", 1, model=model, trainable_only=True, metadata={"lora": lora_metadata(lora, names)}
    )
    inputs = _inputs(entry, config)
    ours = _logits(model, inputs)

    assert (
        mm_convert(
            ["LoraConverter", "dcp_to_peft", "--load_dir", str(tmp_path / "ckpt"), "--save_dir", str(tmp_path / "peft")]
        )
        == 0
    )
    hf = _hf_class(entry)
    peft_model = PeftModel.from_pretrained(
        hf.from_pretrained(tmp_path / "base", attn_implementation="sdpa"), tmp_path / "peft"
    )
    adapted = {name.removeprefix("base_model.model.") for name, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(names), sorted(adapted ^ set(names))
    assert_close(_logits(peft_model, inputs), ours, TOL, "PEFT logits")

    assert (
        mm_convert(
            [
                "LoraConverter",
                "dcp_to_merged_hf",
                "--load_dir",
                str(tmp_path / "ckpt"),
                "--save_dir",
                str(tmp_path / "merged"),
                "--model_assets_dir",
                str(tmp_path / "base"),
            ]
        )
        == 0
    )
    merged = hf.from_pretrained(tmp_path / "merged", attn_implementation="sdpa")
    assert_close(_logits(merged, inputs), ours, TOL, "merged logits")

    again = _build(entry, tmp_path / "base")
    apply_lora(again, lora, entry)
    init_lora_adapters(again, _lora(), seed=7)
    load_lora_adapter(again, str(tmp_path / "peft"), lora)
    assert torch.equal(_logits(again, inputs), ours)


def test_pretrained_lora_path_with_another_rank_is_refused(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 16, "lora_alpha": 8}')
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="r=16"):
        load_lora_adapter(nn.Linear(2, 2), str(tmp_path), _lora())
