"""The qwen3_vl family: training forward vs plain HF, chunk loss, packing, per-image vision attention, the CP
split of M-RoPE positions and deepstack features, build / meta init / plans (fp32, CPU, rel ≤ 1e-5)."""

import copy

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from mmfsdp.config import ConfigError, build
from mmfsdp.model import ModelConfig, compute_loss_weights, get_model_entry, shift_labels
from mmfsdp.model.families.qwen3_vl.model import Qwen3VLForConditionalGenerationFSDP
from mmfsdp.model.chunk_loss import ChunkLossLinear
from mmfsdp.model.context_parallel import CPBatch
from mmfsdp.model.families.qwen3_vl.model import mm_token_types, split_mrope_position_ids, split_visual_embeds
from mmfsdp.model.parallelize import fsdp_groups
from mmfsdp.model.testing import assert_close, model_inputs, model_pair, rel_diff
from mmfsdp.parallel.testing import assert_within
from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_batch, qwen3_vl_sample
from mmfsdp.parallel import MeshPlan, ParallelConfig
from mmfsdp.parallel.cp import CPLayout
from mmfsdp.parallel.patterns import match_module_names

TOL = 1e-5
ENTRY = get_model_entry("qwen3_vl")
IGNORE = -100


@pytest.fixture
def config():
    return ENTRY.testkit.tiny_config()


def _samples(config):
    """Sample a: two images of different sizes (4 and 6 tokens); b: one image; c: text only."""
    return (
        qwen3_vl_sample(config, 24, [(4, 4), (4, 6)], seed=1),
        qwen3_vl_sample(config, 16, [(2, 2)], prompt_len=3, seed=2),
        qwen3_vl_sample(config, 8, prompt_len=1, seed=3),
    )


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(actual: dict, expected: dict):
    assert actual.keys() == expected.keys() and actual
    worst = max((rel_diff(actual[n], g), n) for n, g in expected.items())
    assert_within(worst[0], TOL, f"grad {worst[1]}")


def _train_forward(model, batch, weights=None):
    targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
    if weights is None:
        (weights,) = compute_loss_weights([targets])
    model.zero_grad(set_to_none=True)
    loss = model(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss
    loss.backward()
    return loss.detach(), _grads(model)


# -- the training forward against plain HF ----------------------------------------------------


@pytest.mark.parametrize("with_types", [False, True])
def test_training_forward_equals_hf_loss_and_grads(config, with_types):
    """Default weights (1 / trained tokens) make the weighted sum HF's mean CE; M-RoPE from the batch's own ids."""
    ours, reference = model_pair(config)
    a, b, _ = _samples(config)
    batch = qwen3_vl_batch([[a], [b]], seq_len=24)
    types = mm_token_types(batch["input_ids"], config.image_token_id, config.video_token_id)
    assert int((types == 1).sum()) == 4 + 6 + 1
    expected = reference(**model_inputs(batch), mm_token_type_ids=types, labels=batch["labels"]).loss
    expected.backward()
    if with_types:
        batch["mm_token_type_ids"] = types
    loss, grads = _train_forward(ours, batch)
    assert loss.dtype == torch.float32
    assert_close(loss, expected, TOL, "loss")
    _assert_same_grads(grads, _grads(reference))


@pytest.mark.parametrize("chunk_size", [1, 5, 4096])
def test_chunk_loss_equals_no_chunk_loss(config, chunk_size):
    ours, _ = model_pair(config)
    a, b, _ = _samples(config)
    batch = qwen3_vl_batch([[a], [b]], seq_len=24)
    plain_loss, plain_grads = _train_forward(ours, batch)
    ours.set_chunk_loss(chunk_size)
    loss, grads = _train_forward(ours, batch)
    assert_close(loss, plain_loss, TOL, "loss vs plain loss")
    _assert_same_grads(grads, plain_grads)


def test_packed_samples_equal_separate_runs(config):
    """Rows [a | b] and [c | pad]: per-sample loss sums and gradients equal a, b, c run alone,
    so M-RoPE restarts per sample and varlen attention keeps the samples apart."""
    ours, _ = model_pair(config)
    a, b, c = _samples(config)
    packed = qwen3_vl_batch([[a, b], [c]], seq_len=40, packing=True)
    assert packed["cu_seq_lens"].tolist() == [0, 24, 40, 48, 80]

    def summed(batch):
        return (shift_labels(batch["labels"], batch.get("cu_seq_lens")) != IGNORE).float()

    loss, grads = _train_forward(ours, packed, summed(packed))
    expected_loss, expected_grads = torch.zeros(()), {}
    for sample in (a, b, c):
        alone = qwen3_vl_batch([[sample]], seq_len=len(sample["input_ids"]))
        sample_loss, sample_grads = _train_forward(ours, alone, summed(alone))
        expected_loss += sample_loss
        for name, grad in sample_grads.items():
            expected_grads[name] = expected_grads.get(name, 0) + grad
    assert_close(loss, expected_loss, TOL, "loss")
    _assert_same_grads(grads, expected_grads)

    # the positions themselves: sample b's restart where it starts, equal to b's own
    positions = ours.prepare_inputs(model_inputs(packed), packed["cu_seq_lens"])["position_ids"]
    alone = qwen3_vl_batch([[b]], seq_len=16)
    own = ours.prepare_inputs(model_inputs(alone), None)["position_ids"]
    assert positions.shape == (3, 2, 40)
    assert torch.equal(positions[:, 0, 24:40], own[:, 0]) and positions[:, 0, 24].tolist() == [0, 0, 0]
    # and the leak the check would catch: without cu_seq_lens sample b attends to a (and its positions run on)
    leaky = {key: value for key, value in packed.items() if key not in ("cu_seq_lens", "max_length")}
    leaky_loss, _ = _train_forward(ours, leaky, summed(packed))
    assert rel_diff(leaky_loss, expected_loss) > 1e-3


def test_images_of_one_sample_do_not_attend_to_each_other(config):
    """HF's tower builds per-image lengths from image_grid_thw: image a's output ignores image b's pixels."""
    ours, _ = model_pair(config)
    a, _, _ = _samples(config)
    pixels, grid = a["pixel_values"], a["image_grid_thw"]
    first = int(grid[0].prod())
    changed = pixels.clone()
    changed[first:] = torch.randn_like(changed[first:])
    with torch.no_grad():
        before = ours.model.visual(pixels, grid_thw=grid)
        after = ours.model.visual(changed, grid_thw=grid)
    assert torch.equal(before.last_hidden_state[:first], after.last_hidden_state[:first])
    assert rel_diff(after.last_hidden_state[first:], before.last_hidden_state[first:]) > 1e-2
    for feature_before, feature_after in zip(before.deepstack_features, after.deepstack_features):
        assert torch.equal(feature_before[: first // 4], feature_after[: first // 4])


# -- the CP split as pure functions -----------------------------------------------------------


def _cp_batches(seq_len: int, cu_seq_lens, ring: int, ulysses: int, batch_size: int) -> list[CPBatch]:
    total = batch_size * seq_len if cu_seq_lens is not None else seq_len
    return [
        CPBatch(CPLayout.create(total, cu_seq_lens, ring_size=ring, ring_rank=r, ulysses_size=ulysses, ulysses_rank=u), cu_seq_lens is not None)
        for r in range(ring)
        for u in range(ulysses)
    ]


CP_CASES = [
    dict(ring=2, ulysses=1, cu=None),
    dict(ring=1, ulysses=2, cu=None),
    dict(ring=2, ulysses=2, cu=None),
    dict(ring=2, ulysses=2, cu=[0, 8, 24, 32]),
]


@pytest.mark.parametrize("case", CP_CASES)
def test_cp_split_of_mrope_positions_follows_the_token_split(case):
    B, S = 2, 16
    position_ids = torch.arange(3 * B * S).reshape(3, B, S)
    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32)
    for batch in _cp_batches(S, cu, case["ring"], case["ulysses"], B):
        local = split_mrope_position_ids(position_ids, batch)
        for row in range(3):  # every one of t, h, w is split exactly like a [B, S] tensor
            assert torch.equal(local[row], batch.split(position_ids[row]))
        assert local.shape[-1] == (B * S if cu is not None else S) // (case["ring"] * case["ulysses"])
    four = torch.arange(4 * B * S).reshape(4, B, S)  # text positions first
    assert torch.equal(split_mrope_position_ids(four, batch)[1:], split_mrope_position_ids(four[1:], batch))


@pytest.mark.parametrize("case", CP_CASES)
def test_cp_split_of_deepstack_features_selects_the_ranks_visual_tokens(case):
    B, S, H = 2, 16, 3
    generator = torch.Generator().manual_seed(0)
    mask_BS = torch.rand(B, S, generator=generator) < 0.4
    num_visual = int(mask_BS.sum())
    embeds = [torch.randn(num_visual, H, generator=generator) for _ in range(2)]
    cu = None if case["cu"] is None else torch.tensor(case["cu"], dtype=torch.int32)
    seen = 0
    for batch in _cp_batches(S, cu, case["ring"], case["ulysses"], B):
        local_mask, local_embeds = split_visual_embeds(mask_BS, embeds, batch)
        assert torch.equal(local_mask, batch.split(mask_BS))
        for full, local in zip(embeds, local_embeds):
            # the features placed at their tokens, then split like any [B, S, H] tensor
            placed_BSH = torch.zeros(B, S, H)
            placed_BSH[mask_BS] = full
            assert torch.equal(local, batch.split(placed_BSH)[local_mask])
        seen += int(local_mask.sum())
    assert seen == num_visual


# -- entry: plans, build, meta init, checks ---------------------------------------------------


def test_plans_name_real_modules(config):
    model = Qwen3VLForConditionalGenerationFSDP(config)
    vision, text = config.vision_config, config.text_config
    deepstack = len(vision.deepstack_visual_indexes)
    assert len(match_module_names(model, list(ENTRY.fsdp_modules))) == vision.depth + 1 + deepstack + 1 + text.num_hidden_layers + 1
    assert len(match_module_names(model, list(ENTRY.recompute_modules))) == vision.depth + text.num_hidden_layers
    assert match_module_names(model, list(ENTRY.vision_modules)) == ["model.visual"]
    assert isinstance(model.get_submodule(ENTRY.lm_head_name), ChunkLossLinear)
    assert ENTRY.decoder_name == "model.language_model"
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.fixture
def saved(tmp_path, config):
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, model


def test_build_loads_safetensors_and_meta_build_gives_the_hf_logits(saved, config):
    path, reference = saved
    model_cfg = build(ModelConfig, {"model_id": "qwen3_vl", "model_name_or_path": str(path)}, "model")
    loaded = ENTRY.build(model_cfg)
    ref_state = reference.state_dict()
    assert isinstance(loaded, Qwen3VLForConditionalGenerationFSDP)
    assert all(torch.equal(value, ref_state[key]) for key, value in loaded.state_dict().items())

    model = ENTRY.build(model_cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    missing, unexpected = model.load_state_dict(ref_state, strict=False)
    assert not missing and not unexpected
    ENTRY.init_non_persistent_buffers(model)
    a, b, _ = _samples(config)
    batch = model_inputs(qwen3_vl_batch([[a], [b]], seq_len=24))
    types = mm_token_types(batch["input_ids"], config.image_token_id, config.video_token_id)
    with torch.no_grad():
        assert_close(model(**batch).logits, reference(**batch, mm_token_type_ids=types).logits, TOL, "logits")


def test_a_mistral3_directory_is_refused(tmp_path):
    get_model_entry("mistral3").testkit.tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="not 'qwen3_vl'"):
        ENTRY.build(build(ModelConfig, {"model_id": "qwen3_vl", "model_name_or_path": str(tmp_path), "random_init": True}, "model"))


def test_validate_parallel_checks_ulysses_against_heads(tmp_path, config):
    config.save_pretrained(tmp_path)
    model_cfg = build(ModelConfig, {"model_id": "qwen3_vl", "model_name_or_path": str(tmp_path), "random_init": True}, "model")
    ENTRY.validate_parallel(model_cfg, MeshPlan(dp_replicate=1, dp_shard=2, ring=1, ulysses=2))
    with pytest.raises(ConfigError, match="ulysses"):
        ENTRY.validate_parallel(model_cfg, MeshPlan(dp_replicate=1, dp_shard=8, ring=1, ulysses=8))


def test_default_fsdp_groups_and_override():
    class Dims:
        fsdp_mesh = object()

    parallel_cfg = build(ParallelConfig, {}, "parallel")
    (group,) = fsdp_groups(ENTRY, parallel_cfg, Dims)
    assert group.patterns == ENTRY.fsdp_modules and group.mesh is Dims.fsdp_mesh
    parallel_cfg.fsdp_plan.apply_modules = ["model.language_model.layers.{*}"]
    (group,) = fsdp_groups(ENTRY, parallel_cfg, Dims)
    assert group.patterns == ("model.language_model.layers.{*}",) and group.key == "parallel.fsdp_plan.apply_modules"


def test_model_copies_keep_their_own_decoder_hook(config):
    """The decoder hook belongs to each instance (deepcopy, as the tests' model pairs do)."""
    ours, _ = model_pair(config)
    twin = copy.deepcopy(ours)
    a, b, _ = _samples(config)
    batch = qwen3_vl_batch([[a, b]], seq_len=40, packing=True)
    assert_close(_train_forward(twin, batch)[0], _train_forward(ours, batch)[0], TOL, "copy vs original training forward")


def test_compiled_layers_train_compiled_and_generate_eagerly(config):
    """`features.compile`'s blocks: a KV-cached call (generation: evaluation's answers, the RL stage's embedded
    engine) runs the original forward, so `generate` compiles nothing and returns the eager model's tokens; the
    training forward (no cache) runs the compiled graph, with the eager model's loss."""
    from torch._dynamo.utils import counters

    from mmfsdp.parallel.compile import apply_compile

    torch.manual_seed(0)
    model = ENTRY.model_class._from_config(config, attn_implementation="mmfsdp_sdpa").eval()
    ids = torch.stack([qwen3_vl_sample(config, 12, seed=seed)["input_ids"] for seed in (1, 2)])  # text only
    expected_tokens = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    expected_loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert apply_compile(model, ["model.language_model.layers.{*}"], backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=5, do_sample=False), expected_tokens)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert counters["stats"]["unique_graphs"] >= 1
    assert rel_diff(loss, expected_loss) <= TOL
