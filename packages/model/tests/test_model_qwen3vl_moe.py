"""The qwen3_vl_moe family (fp32, CPU): registry and plans, the training forward + router aux loss vs plain HF
`labels=` with `output_router_logits`, router statistics under packing, padding, recompute and context parallel
(Ulysses 2, Ring 2 on 2 gloo ranks), and checkpoints — HF -> DCP -> HF bit-exact in the transformers 5 and the hub
layouts, per-expert exports loading to the fused weights."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3VLMoeForConditionalGeneration

from mmfsdp.ckpt import find_state_dict_adapter, get_state_dict_adapter, load_checkpoint, load_hf_weights
from mmfsdp.config import build
from mmfsdp.model import ModelConfig, compute_loss_weights, get_model_entry, registered_model_ids, shift_labels
from mmfsdp.model.families.qwen3_vl_moe.adapter import Qwen3VLMoeAdapter
from mmfsdp.model.families.qwen3_vl.model import mm_token_types
from mmfsdp.model.families.qwen3_vl_moe.model import Qwen3VLMoeForConditionalGenerationFSDP
from mmfsdp.model.registry import _declared_families
from mmfsdp.model.router import expert_load_summary, load_balancing_loss
from mmfsdp.model.testing import assert_bit_exact, assert_close, mm_convert, model_inputs, model_pair, read_safetensors, rel_diff
from mmfsdp.parallel.testing import assert_within, record_margin
from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_batch, qwen3_vl_sample
from mmfsdp.parallel.patterns import match_module_names

TOL = 1e-5
ENTRY = get_model_entry("qwen3_vl_moe")
IGNORE = -100
EXPERTS = "model.language_model.layers.{}.mlp.experts."


@pytest.fixture
def config():
    return ENTRY.testkit.tiny_config(text_config=dict(router_aux_loss_coef=0.1))


def _samples(config):
    """Sample a: two images (4 and 6 tokens); b: one image; c: text only."""
    return (
        qwen3_vl_sample(config, 24, [(4, 4), (4, 6)], seed=1),
        qwen3_vl_sample(config, 16, [(2, 2)], prompt_len=3, seed=2),
        qwen3_vl_sample(config, 8, prompt_len=1, seed=3),
    )


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _train_forward(model, batch, weights=None):
    targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
    if weights is None:
        (weights,) = compute_loss_weights([targets])
    return model(**model_inputs(batch), shift_labels=targets, loss_weights=weights)


# -- registry and plans -----------------------------------------------------------------------


def test_registry_and_adapter_come_from_entry_points():
    assert "qwen3_vl_moe" in _declared_families() and "qwen3_vl_moe" in registered_model_ids()
    assert ENTRY.model_class is Qwen3VLMoeForConditionalGenerationFSDP
    assert isinstance(get_state_dict_adapter("qwen3_vl_moe"), Qwen3VLMoeAdapter)
    assert isinstance(find_state_dict_adapter({"model_type": "qwen3_vl_moe"}), Qwen3VLMoeAdapter)


def test_plans_name_real_modules(config):
    model = Qwen3VLMoeForConditionalGenerationFSDP(config)
    vision, text = config.vision_config, config.text_config
    deepstack = len(vision.deepstack_visual_indexes)
    num_fsdp = vision.depth + 1 + deepstack + 1 + text.num_hidden_layers + 1
    assert len(match_module_names(model, list(ENTRY.fsdp_modules))) == num_fsdp
    assert len(match_module_names(model, list(ENTRY.recompute_modules))) == vision.depth + text.num_hidden_layers
    experts = match_module_names(model, list(ENTRY.expert_modules))
    assert experts == [EXPERTS.format(i)[:-1] for i in range(text.num_hidden_layers)]
    for name in experts:
        module = model.get_submodule(name)
        assert module.gate_up_proj.shape == (8, 2 * 48, text.hidden_size)
        assert module.down_proj.shape == (8, text.hidden_size, 48)
    assert len(match_module_names(model, list(ENTRY.router_modules))) == text.num_hidden_layers
    assert ENTRY.costs.decoder_values_per_token(text) > 8


# -- the training forward against plain HF ----------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_loss_plus_router_aux_loss_equals_hf(config, chunk_size):
    """Our LM loss + coef × load_balancing_loss == HF's `loss` (CE mean + coef × aux_loss, padding masked), and
    the gradients."""
    ours, reference = model_pair(config)
    ours.set_chunk_loss(chunk_size)
    a, b, _ = _samples(config)
    batch = qwen3_vl_batch([[a], [b]], seq_len=24)
    assert int(batch["attention_mask"].sum()) == 40
    types = mm_token_types(batch["input_ids"], config.image_token_id, config.video_token_id)
    hf = reference(**model_inputs(batch), mm_token_type_ids=types, labels=batch["labels"], output_router_logits=True)
    hf.loss.backward()

    outputs = _train_forward(ours, batch)
    load = outputs.router_load
    assert load.tokens_per_expert.shape == (config.text_config.num_hidden_layers, 8) and float(load.num_tokens) == 40
    assert torch.equal(load.tokens_per_expert.sum(1), torch.full((2,), 40.0 * 2))
    aux = load_balancing_loss(load)
    assert_close(aux, hf.aux_loss, TOL, "aux loss")
    total = outputs.loss + config.text_config.router_aux_loss_coef * aux
    total.backward()
    assert_close(total, hf.loss, TOL, "loss + coef x aux")
    expected = _grads(reference)
    actual = _grads(ours)
    assert actual.keys() == expected.keys()
    worst = max((rel_diff(actual[n], g), n) for n, g in expected.items())
    assert_within(worst[0], TOL, f"grad {worst[1]}")
    assert any(".mlp.gate." in n for n in actual) and any(".mlp.experts." in n for n in actual)


def test_router_statistics_with_packing_and_padding_equal_separate_runs(config):
    """Rows [a | b] and [c | c'] (packed, no padding) and rows [a], [b], [c] (padded, masked) route every real token
    as a, b, c alone do: the counts and probability sums add up, the LM loss sums too, and the aux loss is the
    one of the summed statistics."""
    ours, _ = model_pair(config)
    a, b, c = _samples(config)
    d = qwen3_vl_sample(config, 32, [(2, 4)], seed=4)
    packed = qwen3_vl_batch([[a, b], [c, d]], seq_len=40, packing=True)
    assert packed["cu_seq_lens"].tolist() == [0, 24, 40, 48, 80]
    padded = qwen3_vl_batch([[a], [b], [c], [d]], seq_len=32)

    def summed(batch):
        return (shift_labels(batch["labels"], batch.get("cu_seq_lens")) != IGNORE).float()

    alone = [qwen3_vl_batch([[s]], seq_len=len(s["input_ids"])) for s in (a, b, c, d)]
    with torch.no_grad():
        loads = [_train_forward(ours, batch, summed(batch)) for batch in alone]
        expected_loss = sum(out.loss for out in loads)
        tokens = sum(out.router_load.tokens_per_expert for out in loads)
        probs = sum(out.router_load.probs_per_expert for out in loads)
        for batch in (packed, padded):
            out = _train_forward(ours, batch, summed(batch))
            assert_close(out.loss, expected_loss, TOL, "loss")
            assert torch.equal(out.router_load.tokens_per_expert, tokens)
            assert_close(out.router_load.probs_per_expert, probs, TOL, "router probabilities per expert")
            assert float(out.router_load.num_tokens) == 80
            expected_aux = load_balancing_loss(type(out.router_load)(tokens, probs, torch.tensor(80.0)))
            assert_close(load_balancing_loss(out.router_load), expected_aux, TOL, "load-balancing loss")
    assert expert_load_summary(tokens) == {"max": float(tokens.max()), "mean": 80 * 2 / 8}


def test_router_aux_loss_shares_add_up_to_the_global_batch(config):
    """Two "ranks" with their own micro-batch: each rank's share from the global counts sums to the aux loss of
    the batch of both (what the trainer gets with all-reduced `tokens_per_expert` and `num_tokens`)."""
    ours, _ = model_pair(config)
    a, b, c = _samples(config)
    both = qwen3_vl_batch([[a], [b]], seq_len=24)
    ranks = [qwen3_vl_batch([[a]], seq_len=24), qwen3_vl_batch([[b]], seq_len=24)]
    whole = load_balancing_loss(_train_forward(ours, both).router_load)
    loads = [_train_forward(ours, batch).router_load for batch in ranks]
    counts = sum(load.tokens_per_expert.sum(0) for load in loads)
    num_tokens = sum(load.num_tokens for load in loads)
    shares = [load_balancing_loss(load, tokens_per_expert=counts, num_tokens=num_tokens) for load in loads]
    assert_close(sum(shares), whole, TOL, "sum of the aux shares")


def test_checkpointed_layers_record_once(config):
    """Activation checkpointing recomputes the routers in backward; the statistics are the forward's only."""
    from mmfsdp.parallel.checkpointing import apply_activation_checkpointing

    ours, _ = model_pair(config)
    a, b, _ = _samples(config)
    batch = qwen3_vl_batch([[a], [b]], seq_len=24)
    plain = _train_forward(ours, batch)
    apply_activation_checkpointing(ours, list(ENTRY.recompute_modules))
    out = _train_forward(ours, batch)
    (out.loss + load_balancing_loss(out.router_load)).backward()
    assert torch.equal(out.router_load.tokens_per_expert, plain.router_load.tokens_per_expert)
    assert ours._router_recorder.result() is None


# -- checkpoints -------------------------------------------------------------------------------


def _logits(model, config) -> torch.Tensor:
    a, b, _ = _samples(config)
    batch = model_inputs(qwen3_vl_batch([[a], [b]], seq_len=24))
    batch["mm_token_type_ids"] = mm_token_types(batch["input_ids"], config.image_token_id, config.video_token_id)
    with torch.no_grad():
        return model.eval()(**batch).logits


def _hub_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Qwen/Qwen3-VL-30B-A3B file layout: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""
    return {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in state.items()}


def _write_dir(directory, tensors: dict[str, torch.Tensor], config_dir, num_shards: int = 3) -> None:
    directory.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for index in range(num_shards):
        filename = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[index::num_shards]
        save_file({name: tensors[name] for name in part}, directory / filename)
        weight_map.update({name: filename for name in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_bytes((config_dir / "config.json").read_bytes())


@pytest.fixture
def saved(tmp_path, config):
    """A tiny `Qwen3VLMoeForConditionalGeneration` saved by `save_pretrained` in several shards."""
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration(config)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    return tmp_path / "hf", model


def _meta_model(config) -> torch.nn.Module:
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGenerationFSDP(config)
    model.to_empty(device="cpu")
    ENTRY.init_non_persistent_buffers(model)
    return model


@pytest.mark.parametrize("layout", ["save_pretrained", "hub"])
def test_hf_dcp_hf_round_trip_is_bit_exact_and_from_pretrained_logits(tmp_path, saved, config, layout):
    """save_pretrained (transformers 5: the state_dict() layout) or the hub layout -> mm-convert -> the same files;
    from_pretrained of the export, a meta build + load_hf_weights and the DCP release give the original logits."""
    original, reference = saved
    files = read_safetensors(original)
    assert len(list(original.glob("*.safetensors"))) >= 3
    assert files[EXPERTS.format(0) + "gate_up_proj"].shape == (8, 96, 64)  # what transformers 5 writes
    if layout == "hub":
        hub = tmp_path / "hub"
        _write_dir(hub, _hub_layout(files), original)
        original, files = hub, read_safetensors(hub)
        assert files[EXPERTS.format(0) + "gate_up_proj"].shape == (8, 64, 96)
    expected = _logits(reference, config)

    dcp_dir, out = tmp_path / "dcp", tmp_path / "out"
    assert mm_convert("hf_to_dcp", "--hf_dir", original, "--dcp_dir", dcp_dir) == 0
    export = ("dcp_to_hf", "--load_dir", dcp_dir, "--save_dir", out, "--model_assets_dir", original)
    assert mm_convert(*export, "--max_shard_size", "150KB") == 0
    assert_bit_exact(read_safetensors(out), files)
    assert torch.equal(_logits(Qwen3VLMoeForConditionalGeneration.from_pretrained(out), config), expected)

    for load in (lambda m: load_hf_weights(m, original), lambda m: load_checkpoint(dcp_dir, model=m)):
        model = _meta_model(config)
        load(model)
        assert torch.equal(_logits(model, config), expected)

    model_cfg = build(ModelConfig, {"model_id": "qwen3_vl_moe", "model_name_or_path": str(original)}, "model")
    built = ENTRY.build(model_cfg)
    reference_state = reference.state_dict()
    assert all(torch.equal(value, reference_state[key]) for key, value in built.state_dict().items())


def test_export_without_asset_weights_writes_the_hub_layout(tmp_path, saved, config):
    original, reference = saved
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_bytes((original / "config.json").read_bytes())
    assert mm_convert("hf_to_dcp", "--hf_dir", original, "--dcp_dir", tmp_path / "dcp") == 0
    out = tmp_path / "out"
    assert mm_convert("dcp_to_hf", "--load_dir", tmp_path / "dcp", "--save_dir", out, "--model_assets_dir", assets) == 0
    assert_bit_exact(read_safetensors(out), _hub_layout(read_safetensors(original)))
    exported = Qwen3VLMoeForConditionalGeneration.from_pretrained(out)
    assert torch.equal(_logits(exported, config), _logits(reference, config))


def test_per_expert_export_loads_to_the_fused_weights(tmp_path, saved, config):
    """`experts.N.{gate,up,down}_proj.weight` (nn.Linear [I, H], [I, H], [H, I]) stack into gate_up [E, 2I, H]
    (gate rows first) and down [E, H, I]: load_hf_weights and hf_to_dcp give the fused model's tensors."""
    original, reference = saved
    fused = read_safetensors(original)
    legacy = {}
    for key, value in fused.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            prefix, half = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                legacy[f"{prefix}{e}.gate_proj.weight"] = value[e, :half].clone()
                legacy[f"{prefix}{e}.up_proj.weight"] = value[e, half:].clone()
        elif key.endswith(".mlp.experts.down_proj"):
            prefix = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                legacy[f"{prefix}{e}.down_proj.weight"] = value[e].clone()
        else:
            legacy[key] = value
    assert legacy[EXPERTS.format(1) + "7.up_proj.weight"].shape == (48, 64)
    per_expert = tmp_path / "per_expert"
    _write_dir(per_expert, legacy, original, num_shards=4)

    model = _meta_model(config)
    load_hf_weights(model, per_expert)
    assert_bit_exact(model.state_dict(), reference.state_dict())
    assert torch.equal(_logits(model, config), _logits(reference, config))

    assert mm_convert("hf_to_dcp", "--hf_dir", per_expert, "--dcp_dir", tmp_path / "dcp") == 0
    model = _meta_model(config)
    load_checkpoint(tmp_path / "dcp", model=model)
    assert_bit_exact(model.state_dict(), reference.state_dict())


def test_adapter_refuses_what_it_cannot_read():
    from mmfsdp.ckpt import CheckpointError
    from mmfsdp.ckpt.adapters import plan_from_hf

    f32 = torch.float32
    prefix = EXPERTS.format(0)
    square = {prefix + "gate_up_proj": ((8, 64, 64), f32), prefix + "down_proj": ((8, 64, 64), f32)}
    with pytest.raises(CheckpointError, match="neither the hub layout"):
        plan_from_hf(Qwen3VLMoeAdapter(), square)
    with pytest.raises(CheckpointError, match="not both"):
        plan_from_hf(Qwen3VLMoeAdapter(), {prefix + "gate_up_proj": ((8, 96, 64), f32)})
    with pytest.raises(CheckpointError, match="cover experts"):
        plan_from_hf(
            Qwen3VLMoeAdapter(),
            {prefix + f"{e}.{p}.weight": ((4, 4), f32) for e in (0, 2) for p in ("gate_proj", "up_proj", "down_proj")},
        )


# -- context parallel --------------------------------------------------------------------------


def _cp_step(model, batch, coef, *, group=None, world_size=1):
    """One step as the trainer would run it: LM loss + coef × this rank's aux share (global counts), backward on
    `× world_size`; returns the summed objective and the full gradients."""
    targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
    (weights,) = compute_loss_weights([targets], group=group)
    out = model(**model_inputs(batch), shift_labels=targets, loss_weights=weights)
    load = out.router_load
    counts, num_tokens = load.tokens_per_expert.sum(0).clone(), load.num_tokens.clone()
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(counts)
        dist.all_reduce(num_tokens)
    total = out.loss + coef * load_balancing_loss(load, tokens_per_expert=counts, num_tokens=num_tokens)
    (total * world_size).backward()
    total = total.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    grads = {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for name, p in model.named_parameters()
    }
    return total, grads, counts


_CP_CASES = [dict(name="ulysses2 padded", ulysses=2, packed=False), dict(name="ring2 packed", ring=2, packed=True)]


def _cp_batch(config, packed: bool):
    a, b, c = _samples(config)
    if packed:
        return qwen3_vl_batch([[a, b], [c, qwen3_vl_sample(config, 32, [(2, 4)], seed=4)]], seq_len=40, packing=True)
    return qwen3_vl_batch([[a], [b]], seq_len=24)


def _cp_model(config):
    torch.manual_seed(0)
    return Qwen3VLMoeForConditionalGenerationFSDP._from_config(copy.deepcopy(config), attn_implementation="mmfsdp_sdpa")


def _cp_runs(rank, world_size, cases):
    from mmfsdp.parallel import MeshPlan, ParallelConfig, build_parallel_dims

    config = ENTRY.testkit.tiny_config()
    results = {}
    for case in cases:
        parallel_cfg = ParallelConfig(
            ulysses_parallel_size=case.get("ulysses", 1), ring_attention_size=case.get("ring", 1)
        )
        dims = build_parallel_dims(MeshPlan.from_config(parallel_cfg, world_size), "cpu")
        model = _cp_model(config)
        ENTRY.parallelize(model, parallel_cfg, dims)
        model.enable_context_parallel(dims)
        batch = _cp_batch(config, case["packed"])
        total, grads, counts = _cp_step(model, batch, 0.1, group=dims.dp_group, world_size=world_size)
        results[case["name"]] = {"total": total, "counts": counts, "grads": grads if rank == 0 else {}}
    return results


def test_context_parallel_loss_and_router_aux_loss_equal_one_process():
    """Ulysses 2 (padded rows) and Ring 2 (packed rows): each rank routes its shard, the aux shares from the
    all-reduced counts add up, and loss + coef × aux and every gradient equal the one-process run."""
    from mmfsdp.parallel.testing import run_distributed

    per_rank = run_distributed(_cp_runs, 2, _CP_CASES, timeout=600)
    config = ENTRY.testkit.tiny_config()
    failures = []
    for case in _CP_CASES:
        expected, expected_grads, expected_counts = _cp_step(_cp_model(config), _cp_batch(config, case["packed"]), 0.1)
        got = per_rank[0][case["name"]]
        assert torch.equal(got["counts"], expected_counts)
        worst = max(rel_diff(got["grads"][n], g) for n, g in expected_grads.items())
        record_margin(rel_diff(got["total"], expected), TOL, f"{case['name']}: total")
        record_margin(worst, TOL, f"{case['name']}: gradient")
        if max(rel_diff(got["total"], expected), worst) > TOL:
            failures.append(f"{case['name']}: total {rel_diff(got['total'], expected):.3g}, gradient {worst:.3g}")
    assert not failures, "\n".join(failures)
