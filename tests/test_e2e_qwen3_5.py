"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`): packed rows and context parallel, and what the family contract does not cover.

- The Gated DeltaNet layers run the packing- and CP-exact operator (`mmfsdp.model.gated_deltanet`), so the families
  declare packing and context parallel: default data settings resolve to padding-free micro-batches, `--check`
  accepts packing and CP, and a packed batch's loss equals the padded one's. A model whose Gated DeltaNet keeps
  HF's forward (`packed_linear_attention = False`) refuses `cu_seq_lens` and context parallel, and an entry
  without the capabilities is refused by `--check` in one line per key. The multi-process parity runs are in
  `tests/test_e2e_qwen3_5_parity.py`.
- A video batch's step-1 loss equals HF's `labels=` loss (the families declare `video`).
- The MoE adapter reads and writes the hub's per-expert layout (what transformers 5's `save_pretrained` writes too;
  `tests/test_e2e_ckpt_convert.py` round-trips it and the fused `state_dict()` layout through `mm-convert`).
"""

from pathlib import Path

import pytest
import torch

from mmfsdp.config import ConfigError
from mmfsdp.model import compute_loss_weights, get_model_entry, shift_labels
from mmfsdp.model.families.qwen3_vl.model import mm_token_types
from mmfsdp.model.spec import Capabilities
from mmfsdp.model.testing import assert_close, model_inputs, model_pair
from mmfsdp.parallel.testing import assert_within

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
CONFIG = """\
data:
  dataset_param:
    dataset_type: synthetic_shapes
    preprocess_parameters:
      model_name_or_path: {path}
    basic_parameters:
      dataset_dir: {tmp}/data
      cache_dir: {tmp}/cache
model:
  model_id: {model_id}
  model_name_or_path: {path}
  random_init: true
training:
  output_dir: {tmp}/out
"""
"""A config that leaves every data choice to the family: template, collator, padding-free, FSDP plan."""


@pytest.fixture(scope="module", params=FAMILIES)
def saved_config(request, tmp_path_factory) -> tuple[str, Path]:
    """A model directory with the tiny config.json only (what `--check` reads for a random-init run)."""
    path = tmp_path_factory.mktemp(request.param)
    get_model_entry(request.param).testkit.tiny_config().save_pretrained(path)
    return request.param, path


def _config(model_id: str, path: Path, *overrides: str):
    from mmfsdp.train.config import load_config

    file = path / "run.yaml"
    file.write_text(CONFIG.format(model_id=model_id, path=path, tmp=path))
    return load_config(file, list(overrides))


def test_default_data_settings_resolve_to_padding_free_rows(saved_config):
    from mmfsdp.train.check import model_check

    model_id, path = saved_config
    cfg = _config(model_id, path)
    loader = cfg.data.dataloader_param
    assert loader.padding_free is True and not cfg.data.dataset_param.basic_parameters.packing
    assert cfg.data.dataset_param.preprocess_parameters.template == "qwen3_5"
    assert loader.collate_param.model_name == "qwen3_vl"
    assert not model_check(cfg)


PACKED = [
    ("data.dataloader_param.padding_free=true", "data.dataloader_param.padding_free"),
    ("data.dataset_param.basic_parameters.packing=true", "data.dataset_param.basic_parameters.packing"),
]


@pytest.mark.parametrize("override, key", PACKED)
def test_check_accepts_packed_rows(saved_config, override, key):
    from mmfsdp.train.check import model_check

    model_id, path = saved_config
    assert not [e for e in model_check(_config(model_id, path, override)) if e.key == key]


@pytest.mark.parametrize("override, key", PACKED)
def test_check_refuses_packed_rows_without_the_capability(saved_config, override, key, monkeypatch):
    """The refusal for a Gated DeltaNet that cannot honour boundaries: an entry declaring no packing."""
    from mmfsdp.train.check import model_check

    model_id, path = saved_config
    monkeypatch.setattr(type(get_model_entry(model_id)), "capabilities", Capabilities(video=True))
    errors = [e for e in model_check(_config(model_id, path, override)) if e.key == key]
    assert len(errors) == 1 and f"model_id {model_id!r} does not support packed rows" in str(errors[0])


CP_KEYS = ["parallel.ulysses_parallel_size", "parallel.ring_attention_size"]


@pytest.mark.parametrize("key", CP_KEYS)
def test_check_accepts_context_parallel(saved_config, key):
    from mmfsdp.train.config import check_world

    model_id, path = saved_config
    check_world(_config(model_id, path, f"{key}=2"), 2)


@pytest.mark.parametrize("key", CP_KEYS)
def test_check_refuses_context_parallel_without_the_capability(saved_config, key, monkeypatch):
    from mmfsdp.train.config import check_world

    model_id, path = saved_config
    monkeypatch.setattr(type(get_model_entry(model_id)), "capabilities", Capabilities(video=True))
    with pytest.raises(ConfigError, match=rf"^{key}: 2 needs context parallel, which model_id '{model_id}' "):
        check_world(_config(model_id, path, f"{key}=2"), 2)


def _video_batch(config, *, frames: int = 2, height: int = 4, width: int = 4, length: int = 40, seed: int = 0):
    """One row with a video of `frames` frames (each `<vision_start>`, its tokens, `<vision_end>`, as the processor
    lays frames out) and one text-only row; right-padded, labels on the text after the video."""
    vision = config.vision_config
    generator = torch.Generator().manual_seed(seed)
    tokens_per_frame = height * width // vision.spatial_merge_size**2
    ids = torch.randint(config.vision_end_token_id + 1, config.text_config.vocab_size, (2, length), generator=generator)
    at = 2
    for _ in range(frames):
        ids[0, at] = config.vision_start_token_id
        ids[0, at + 1 : at + 1 + tokens_per_frame] = config.video_token_id
        ids[0, at + 1 + tokens_per_frame] = config.vision_end_token_id
        at += tokens_per_frame + 2
    labels = ids.clone()
    labels[0, :at] = -100
    attention_mask = torch.ones_like(ids)
    attention_mask[1, length - 7 :] = 0
    labels[1, length - 7 :] = -100
    labels[1, :3] = -100
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(frames * height * width, patch_dim, generator=generator)
    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "pixel_values_videos": pixels,
        "video_grid_thw": torch.tensor([[frames, height, width]]),
        "mm_token_type_ids": mm_token_types(ids, config.image_token_id, config.video_token_id),
    }


@pytest.mark.parametrize("model_id", FAMILIES)
def test_video_step1_loss_equals_hf_labels_loss(model_id):
    config = get_model_entry(model_id).testkit.tiny_config()
    ours, reference = model_pair(config)
    batch = _video_batch(config)
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets])
    with torch.no_grad():
        expected = reference(**batch).loss
        loss = ours(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss
    assert torch.isfinite(expected)
    assert_close(loss, expected, 1e-5, "loss")


def _packed(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """The padded rows' inputs laid end to end in one row, their `cu_seq_lens` and longest length."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    keep = batch["attention_mask"].bool()
    inputs = model_inputs(batch)
    packed = {key: value for key, value in inputs.items() if key not in ("attention_mask", "input_ids", "labels")}
    packed["input_ids"] = batch["input_ids"][keep][None]
    packed["mm_token_type_ids"] = batch["mm_token_type_ids"][keep][None]
    cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return packed, cu_seq_lens, int(max(lengths))


@pytest.mark.parametrize("model_id", FAMILIES)
def test_packed_rows_loss_and_grads_equal_padded(model_id):
    """Three samples (two with images) in one packed row: loss and gradient equal the padded batch's (HF's fallback).

    The gradient is compared as one vector (max difference over max magnitude): a few parameters (`dt_bias`) get
    gradients ~1e-6 of the largest, sums with cancellation, where the two fp32 algorithms differ in the last bits
    (in fp64 the packed operator and HF's fallback, which computes the delta rule in fp32, agree to 2e-7)."""
    entry = get_model_entry(model_id)
    config = entry.testkit.tiny_config()
    torch.manual_seed(0)
    ours = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    batch = entry.testkit.test_batch(config, images=True, seed=1)
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets])
    keep = batch["attention_mask"].bool()
    padded = ours(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss
    padded.backward()
    expected = {name: p.grad.clone() for name, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad(set_to_none=True)
    inputs, cu_seq_lens, max_length = _packed(batch)
    loss = ours(
        **inputs,
        cu_seq_lens=cu_seq_lens,
        max_length=max_length,
        shift_labels=targets[keep][None],
        loss_weights=weights[keep][None],
    ).loss
    loss.backward()
    assert_close(loss, padded, 1e-5, "loss vs padded")
    params = dict(ours.named_parameters())
    got = torch.cat([params[name].grad.flatten() for name in expected])
    assert_close(got, torch.cat([grad.flatten() for grad in expected.values()]), 1e-5, "gradients")


@pytest.mark.parametrize("model_id", FAMILIES)
def test_unrouted_gated_deltanet_refuses_packed_rows_and_context_parallel(model_id):
    entry = get_model_entry(model_id)
    unrouted = type("Unrouted", (entry.model_class,), {"packed_linear_attention": False})
    config = entry.testkit.tiny_config()
    model = unrouted._from_config(config, attn_implementation="mmfsdp_sdpa")
    batch = entry.testkit.test_batch(config, images=False)
    inputs = {key: value for key, value in model_inputs(batch).items() if key != "attention_mask"}
    rows, seq_len = batch["input_ids"].shape
    cu_seq_lens = torch.arange(rows + 1, dtype=torch.int32) * seq_len
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets])
    with pytest.raises(ValueError, match="ignores sample boundaries"):
        model(**inputs, cu_seq_lens=cu_seq_lens, max_length=seq_len, shift_labels=targets, loss_weights=weights)
    with pytest.raises(ValueError, match="ignores sample boundaries"):
        model.enable_context_parallel(None)


def test_moe_adapter_reads_and_writes_the_hub_per_expert_layout():
    from mmfsdp.ckpt.adapters import plan_from_hf, plan_to_hf

    entry = get_model_entry("qwen3_5_moe")
    config = entry.testkit.tiny_config()
    ours, _ = model_pair(config)
    state = ours.state_dict()
    adapter = entry.state_dict_adapter()
    plans = plan_to_hf(adapter, {key: (tuple(t.shape), t.dtype) for key, t in state.items()})
    hub = {hf_key: t.clone() for key, plan in plans.items() for hf_key, t in plan.pieces(state[key]).items()}
    prefix = "model.language_model.layers.0.mlp.experts"
    num_experts, size = config.text_config.num_experts, config.text_config.moe_intermediate_size
    assert f"{prefix}.gate_up_proj" not in hub and f"{prefix}.down_proj" not in hub
    gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]
    for e in range(num_experts):
        assert torch.equal(hub[f"{prefix}.{e}.gate_proj.weight"], gate_up[e, :size])
        assert torch.equal(hub[f"{prefix}.{e}.up_proj.weight"], gate_up[e, size:])
        assert torch.equal(hub[f"{prefix}.{e}.down_proj.weight"], down[e])
    assert "model.language_model.layers.0.mlp.shared_expert_gate.weight" in hub
    back = plan_from_hf(adapter, {key: (tuple(t.shape), t.dtype) for key, t in hub.items()})
    assert back.keys() == state.keys()
    for key, plan in back.items():
        assert torch.equal(plan.build(hub.__getitem__), state[key]), key


def test_moe_loss_plus_router_aux_loss_equals_hf():
    """Our LM loss + coef × `load_balancing_loss(outputs.router_load)` equals HF's `loss` with
    `output_router_logits=True` (padding masked), and the aux loss HF's `aux_loss`."""
    from mmfsdp.model.router import load_balancing_loss

    entry = get_model_entry("qwen3_5_moe")
    config = entry.testkit.tiny_config()
    ours, reference = model_pair(config)
    batch = entry.testkit.test_batch(config, images=True, seed=2)
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets])
    with torch.no_grad():
        hf = reference(**batch, output_router_logits=True)
        outputs = ours(**model_inputs(batch), shift_labels=targets, loss_weights=weights)
    load = outputs.router_load
    text = config.text_config
    assert load.tokens_per_expert.shape == (text.num_hidden_layers, text.num_experts)
    assert float(load.num_tokens) == float(batch["attention_mask"].sum())
    aux = load_balancing_loss(load)
    assert_close(aux, hf.aux_loss, 1e-5, "aux loss")
    assert_close(outputs.loss + text.router_aux_loss_coef * aux, hf.loss, 1e-5, "loss + coef x aux")


def _ep_steps(rank: int, world_size: int) -> list[tuple[float, float]]:
    """(loss, grad norm) of 2 AdamW steps of `qwen3_5_moe`'s tiny model on 2 micro-batches (the first with images,
    the second text-only): 1 process runs both, 2 processes one each with expert parallel 2."""
    import torch.distributed as dist

    from mmfsdp.parallel import MeshPlan, ParallelConfig, ShardAdamW, build_parallel_dims, clip_grad_norm

    parallel_cfg = ParallelConfig(expert_parallel_size=world_size)
    dims = build_parallel_dims(MeshPlan.from_config(parallel_cfg, world_size), "cpu")
    entry = get_model_entry("qwen3_5_moe")
    config = entry.testkit.tiny_config()
    torch.manual_seed(0)
    model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    entry.parallelize(model, parallel_cfg, dims)
    optimizer = ShardAdamW(model.parameters(), lr=1e-3, foreach=True)  # the trainer's AdamW
    per_rank, history = 2 // world_size, []
    for step in range(2):
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        batches = [entry.testkit.test_batch(config, images=i == 0, seed=10 * step + i) for i in mine]
        targets = [shift_labels(b["labels"]) for b in batches]
        weights = compute_loss_weights(targets, group=dims.dp_group, num_micro_batches=per_rank)
        total = torch.zeros(())
        for i, (batch, target, weight) in enumerate(zip(batches, targets, weights, strict=True)):
            model.set_requires_gradient_sync(i == per_rank - 1)
            loss = model(**model_inputs(batch), shift_labels=target, loss_weights=weight).loss
            (loss * world_size).backward()
            total += loss.detach()
        norm = clip_grad_norm(list(model.parameters()), 1.0)
        dist.all_reduce(total)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append((total.item(), float(norm)))
    return history


@pytest.mark.slow
def test_moe_expert_parallel_two_processes_equal_one():
    from mmfsdp.parallel.testing import run_distributed

    one, two = (run_distributed(_ep_steps, size)[0] for size in (1, 2))
    for (loss_1, norm_1), (loss_2, norm_2) in zip(one, two, strict=True):
        assert_within(abs(loss_2 - loss_1) / abs(loss_1), 1e-5, f"EP 2 vs 1 loss {loss_1} vs {loss_2}")
        assert_within(abs(norm_2 - norm_1) / norm_1, 1e-5, f"EP 2 vs 1 grad norm {norm_1} vs {norm_2}")


PRESETS = ["preset:gated_deltanet", "preset:attention", "preset:vision_attention"]


@pytest.mark.parametrize("model_id", FAMILIES)
def test_lora_presets_cover_gated_deltanet_attention_and_vision(model_id):
    from mmfsdp.model import resolve_lora_targets

    entry = get_model_entry(model_id)
    config = entry.testkit.tiny_config()
    with torch.device("meta"):
        model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    names = set(resolve_lora_targets(model, PRESETS, entry))
    layers = config.text_config.layer_types
    expected = set()
    for i, kind in enumerate(layers):
        if kind == "linear_attention":
            parts = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
            expected |= {f"model.language_model.layers.{i}.linear_attn.{part}" for part in parts}
        else:
            expected |= {f"model.language_model.layers.{i}.self_attn.{p}_proj" for p in "qkvo"}
    for block in range(config.vision_config.depth):
        expected |= {f"model.visual.blocks.{block}.attn.{part}" for part in ("qkv", "proj")}
    assert names == expected


def test_lora_preset_matching_no_module_is_an_error():
    from mmfsdp.model import resolve_lora_targets

    entry = get_model_entry("qwen3_5")
    config = entry.testkit.tiny_config(text_config={"layer_types": ["full_attention"] * 3})
    with torch.device("meta"):
        model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    key = "training.lora.target_modules"
    with pytest.raises(ConfigError, match=rf"^{key}\[1\] \(preset:gated_deltanet\): 'in_proj_qkv' is the name of no"):
        resolve_lora_targets(model, ["q_proj", "preset:gated_deltanet"], entry)
    with pytest.raises(ConfigError, match=rf"^{key}\[0\]: 'preset:deltanet' names no LoRA preset"):
        resolve_lora_targets(model, ["preset:deltanet"], entry)


def test_check_refuses_a_lora_preset_that_matches_nothing(tmp_path):
    from mmfsdp.train.check import model_check

    entry = get_model_entry("qwen3_5")
    entry.testkit.tiny_config(text_config={"layer_types": ["full_attention"] * 3}).save_pretrained(tmp_path)
    targets = "training.lora.target_modules=[preset:gated_deltanet]"
    cfg = _config("qwen3_5", tmp_path, "training.lora.enable=true", targets)
    errors = [e for e in model_check(cfg) if e.key.startswith("training.lora.target_modules[0]")]
    assert len(errors) == 1 and "'in_proj_qkv' is the name of no module" in str(errors[0]), errors
