"""The qwen3_omni_moe family (the Qwen3-Omni thinker; fp32, CPU): the training forward against HF's thinker on
rows mixing audio clips and images (loss, router aux loss and every gradient), M-RoPE under packing, the audio
placeholder of micro-batches without audio, and checkpoints — a full Omni checkpoint (thinker, talker, code2wav)
through `mm-convert` HF -> DCP -> HF bitwise, the talker and code2wav copied, and a build from it."""

import json

import pytest
import torch
from transformers.models.qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

from mmfsdp.ckpt import find_state_dict_adapter, get_state_dict_adapter
from mmfsdp.config import build
from mmfsdp.model import ModelConfig, compute_loss_weights, get_model_entry, shift_labels
from mmfsdp.model.families.qwen3_omni_moe.adapter import Qwen3OmniMoeAdapter, Qwen3OmniMoeThinkerAdapter
from mmfsdp.model.families.qwen3_omni_moe.model import Qwen3OmniMoeThinkerForConditionalGenerationFSDP
from mmfsdp.model.families.qwen3_omni_moe.testing import omni_batch, omni_sample, tiny_full_config
from mmfsdp.model.router import load_balancing_loss
from mmfsdp.model.testing import assert_bit_exact, assert_close, mm_convert, model_inputs, model_pair, read_safetensors, rel_diff
from mmfsdp.parallel.patterns import match_module_names
from mmfsdp.parallel.testing import assert_within

TOL = 1e-5
IGNORE = -100
ENTRY = get_model_entry("qwen3_omni_moe")


@pytest.fixture(scope="module")
def config():
    return ENTRY.testkit.tiny_config(text_config=dict(router_aux_loss_coef=0.1))


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _train_forward(model, batch, weights=None):
    targets = shift_labels(batch["labels"], batch.get("cu_seq_lens"))
    if weights is None:
        (weights,) = compute_loss_weights([targets])
    return model(**model_inputs(batch), shift_labels=targets, loss_weights=weights)


def _summed(batch):
    return (shift_labels(batch["labels"], batch.get("cu_seq_lens")) != IGNORE).float()


_ZERO_IN_EXACT = ".self_attn.k_proj.bias"
"""The audio attention's key bias: softmax is invariant to a shift of all of a query's scores, so its gradient is
zero in exact arithmetic and rounding noise in floats; it is bounded relative to its attention module's gradients."""


def _assert_same_grads(actual, expected):
    assert actual.keys() == expected.keys()
    worst = max((rel_diff(actual[n], g), n) for n, g in expected.items() if not n.endswith(_ZERO_IN_EXACT))
    assert_within(worst[0], TOL, f"grad {worst[1]}")
    for name in (n for n in expected if n.endswith(_ZERO_IN_EXACT)):
        module = name.removesuffix("k_proj.bias")
        scale = max(g.abs().max().item() for n, g in expected.items() if n.startswith(module))
        assert_within((actual[name] - expected[name]).abs().max().item() / scale, TOL, f"grad {name}")


def test_registry_plans_and_adapters(config):
    assert ENTRY.model_class is Qwen3OmniMoeThinkerForConditionalGenerationFSDP
    assert isinstance(find_state_dict_adapter({"model_type": "qwen3_omni_moe"}), Qwen3OmniMoeAdapter)
    assert type(find_state_dict_adapter({"model_type": "qwen3_omni_moe_thinker"})) is Qwen3OmniMoeThinkerAdapter
    assert type(get_state_dict_adapter("qwen3_omni_moe")) is Qwen3OmniMoeAdapter
    model = Qwen3OmniMoeThinkerForConditionalGenerationFSDP(config)
    audio, vision, text = config.audio_config, config.vision_config, config.text_config
    groups = audio.encoder_layers + vision.depth + 1 + len(vision.deepstack_visual_indexes) + 1 + text.num_hidden_layers + 1
    assert len(match_module_names(model, list(ENTRY.fsdp_modules))) == groups
    assert len(match_module_names(model, list(ENTRY.recompute_modules))) == audio.encoder_layers + vision.depth + text.num_hidden_layers
    assert ENTRY.vision_modules == ("model.visual", "model.audio_tower")
    assert sorted(match_module_names(model, list(ENTRY.vision_modules))) == ["model.audio_tower", "model.visual"]
    for preset in ENTRY.lora_presets.values():
        assert all(match_module_names(model, [name]) for name in preset)


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_training_forward_equals_hf_loss_aux_loss_and_grads(config, chunk_size):
    """Rows: two images and a clip, a clip of two chunks, one image, text only. Our LM loss + coef × aux loss ==
    HF's `labels=` loss with `output_router_logits`, the aux loss HF's `aux_loss`, and every gradient."""
    ours, reference = model_pair(config)
    ours.set_chunk_loss(chunk_size)
    batch = ENTRY.testkit.test_batch(config, images=True, seed=2)
    assert batch["input_features"].shape[0] == 2 and batch["image_grid_thw"].shape[0] == 3
    hf = reference(**batch, output_router_logits=True)
    hf.loss.backward()
    outputs = _train_forward(ours, batch)
    aux = load_balancing_loss(outputs.router_load)
    assert_close(aux, hf.aux_loss, TOL, "aux loss")
    total = outputs.loss + config.text_config.router_aux_loss_coef * aux
    total.backward()
    assert_close(total, hf.loss.detach(), TOL, "loss + coef x aux")
    expected, actual = _grads(reference), _grads(ours)
    _assert_same_grads(actual, expected)
    assert any(n.startswith("model.audio_tower.") for n in actual) and any(".mlp.experts." in n for n in actual)


def _assert_packed_equals_alone(ours, packed, samples) -> None:
    """The packed batch's summed loss and gradients equal the sum of each sample's run alone."""
    _train_forward(ours, packed, _summed(packed)).loss.backward()
    grads = _grads(ours)
    loss = _train_forward(ours, packed, _summed(packed)).loss.detach()
    expected_loss, expected_grads = torch.zeros(()), {}
    for sample in samples:
        alone = omni_batch([[sample]], seq_len=len(sample["input_ids"]))
        out = _train_forward(ours, alone, _summed(alone))
        out.loss.backward()
        expected_loss += out.loss.detach()
        for name, grad in _grads(ours).items():
            expected_grads[name] = expected_grads.get(name, 0) + grad
    assert_close(loss, expected_loss, TOL, "loss")
    _assert_same_grads(grads, expected_grads)


def _video_rows(config, track: bool):
    """Four rows: a video (2 temporal groups of 4 tokens; with `track`, its 32-frame audio track interleaved) after
    an image; a clip then a video (its track, if any, the row's second clip); an image and a clip; text only.
    Every clip's frames are a multiple of 8, so that a clip's features do not depend on its call (`_samples`)."""
    frames = 32 if track else 0
    return [
        [omni_sample(config, 40, [(4, 4)], videos=[(2, 4, 4, frames)], seed=11)],
        [omni_sample(config, 44, [], [32], videos=[(2, 4, 2, frames)], seed=12)],
        [omni_sample(config, 30, [(2, 4)], [64], seed=13)],
        [omni_sample(config, 20, seed=14)],
    ]


@pytest.mark.parametrize("track", [False, True], ids=["video", "audio_in_video"])
def test_videos_with_and_without_their_audio_track_equal_hf(config, track):
    """Rows with videos (their audio tracks interleaved by time, `use_audio_in_video`, or not) beside image, clip and
    text-only rows: the loss + coef x aux loss and every gradient equal HF's thinker given the same flag; the
    positions equal HF's `get_rope_index` (ours take the flag from the tokens)."""
    ours, reference = model_pair(config)
    batch = omni_batch(_video_rows(config, track), seq_len=44)
    in_video = (batch["input_ids"] == config.audio_start_token_id) & (batch["input_ids"].roll(1, 1) == config.vision_start_token_id)
    assert int(in_video.sum()) == (2 if track else 0) and batch["video_grid_thw"].shape[0] == 2
    hf = reference(**batch, use_audio_in_video=track, output_router_logits=True)
    hf.loss.backward()
    outputs = _train_forward(ours, batch)
    total = outputs.loss + config.text_config.router_aux_loss_coef * load_balancing_loss(outputs.router_load)
    total.backward()
    assert_close(total, hf.loss.detach(), TOL, "loss + coef x aux")
    _assert_same_grads(_grads(ours), _grads(reference))
    positions = ours.prepare_inputs(model_inputs(batch), None)["position_ids"]
    expected = reference.model.get_rope_index(
        batch["input_ids"], batch["image_grid_thw"], batch["video_grid_thw"], batch["attention_mask"], track,
        batch["feature_attention_mask"].sum(-1), batch["video_second_per_grid"],
    )[0]
    assert torch.equal(positions, expected)


def test_packed_videos_with_their_audio_tracks_equal_separate_runs(config):
    """[row 1 | row 2] and [row 3 | row 4] of the audio-in-video rows packed: per-sample loss sums and gradients equal
    each sample alone."""
    ours, _ = model_pair(config)
    samples = [row[0] for row in _video_rows(config, True)]
    packed = omni_batch([samples[:2], samples[2:]], seq_len=84, packing=True)
    _assert_packed_equals_alone(ours, packed, samples)


def _samples(config):
    """a: two images and a clip; b: text; c: a clip of two chunks and an image.

    HF's audio tower pads every 100-frame chunk of a call to the call's longest, and its stride-2 convolutions let
    a chunk's last token see the padding's `gelu(bias)` unless the chunk's frames are a multiple of 8: a's 64
    frames are, so a's features do not depend on the other clips of the call (c's 30-frame tail chunk is padded to
    100 frames alone too, by its own full chunk)."""
    return (
        omni_sample(config, 40, [(4, 4), (2, 4)], [64], seed=1),
        omni_sample(config, 24, seed=2),
        omni_sample(config, 36, [(4, 2)], [130], seed=3),
    )


def test_packed_samples_equal_separate_runs(config):
    """Rows [a | b] and [c | pad]: per-sample loss sums and gradients equal a, b, c run alone (M-RoPE per sample
    with its own images and clips), and b's positions restart."""
    ours, _ = model_pair(config)
    a, b, c = _samples(config)
    packed = omni_batch([[a, b], [c]], seq_len=64, packing=True)
    assert packed["cu_seq_lens"].tolist() == [0, 40, 64, 100, 128]
    _assert_packed_equals_alone(ours, packed, (a, b, c))
    positions = ours.prepare_inputs(model_inputs(packed), packed["cu_seq_lens"])["position_ids"]
    alone = omni_batch([[c]], seq_len=36)
    own = ours.prepare_inputs(model_inputs(alone), None)["position_ids"]
    assert torch.equal(positions[:, 1, :36], own[:, 0]) and positions[:, 0, 40].tolist() == [0, 0, 0]


def test_a_micro_batch_without_audio_runs_the_audio_tower_once(config):
    """In a run whose data holds audio, a micro-batch of images and text runs the audio tower once (the
    placeholder): loss and gradients bitwise those without it, the audio tower's gradients all zero."""
    ours, _ = model_pair(config)
    rows = [[omni_sample(config, 30, [(4, 4)], seed=5)], [omni_sample(config, 20, seed=6)]]
    batch = omni_batch(rows, seq_len=30)
    assert "input_features" not in batch
    ours.set_media_kinds({"image", "audio"})
    calls = []
    hook = ours.model.audio_tower.register_forward_hook(lambda *_: calls.append(1))
    try:
        loss = _train_forward(ours, batch, _summed(batch)).loss
        loss.backward()
    finally:
        hook.remove()
    grads = _grads(ours)
    assert len(calls) == 1
    original = ours._missing_media
    ours._missing_media = lambda kwargs: ()
    try:
        plain = _train_forward(ours, batch, _summed(batch)).loss
        plain.backward()
    finally:
        ours._missing_media = original
    plain_grads = _grads(ours)
    assert torch.equal(loss, plain)
    audio = {n for n in grads if n.startswith("model.audio_tower.")}
    assert audio == {n for n, p in ours.named_parameters() if n.startswith("model.audio_tower.")}
    assert grads.keys() - audio == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in plain_grads)
    assert not any(grads[n].any() for n in audio)
    ours.set_media_kinds({"image"})  # an image-only run: no audio pass
    calls.clear()
    hook = ours.model.audio_tower.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            _train_forward(ours, batch, _summed(batch))
    finally:
        hook.remove()
    assert not calls


@pytest.fixture(scope="module")
def full_checkpoint(tmp_path_factory, config):
    """A tiny full `Qwen3OmniMoeForConditionalGeneration` (thinker, talker, code2wav) saved by `save_pretrained`."""
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_full_config(config))
    path = tmp_path_factory.mktemp("omni") / "hf"
    model.save_pretrained(path, max_shard_size="200KB")
    return path, model


def test_full_checkpoint_round_trip_keeps_the_talker_and_code2wav(tmp_path, full_checkpoint):
    """hf_to_dcp holds the thinker only; dcp_to_hf with the checkpoint as assets gives every file tensor back
    bitwise (the thinker's from the DCP, the talker's and code2wav's copied) and the full config."""
    original, _ = full_checkpoint
    files = read_safetensors(original)
    assert any(k.startswith("talker.") for k in files) and any(k.startswith("code2wav.") for k in files)
    assert any(".mlp.experts.0.gate_proj.weight" in k and k.startswith("thinker.") for k in files)
    dcp_dir, out = tmp_path / "dcp", tmp_path / "out"
    assert mm_convert("hf_to_dcp", "--hf_dir", original, "--dcp_dir", dcp_dir) == 0
    assert mm_convert("dcp_to_hf", "--load_dir", dcp_dir, "--save_dir", out, "--model_assets_dir", original,
                      "--max_shard_size", "150KB") == 0
    assert_bit_exact(read_safetensors(out), files)
    exported = json.loads((out / "config.json").read_text())
    assert exported["model_type"] == "qwen3_omni_moe" and exported["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "code2wav_config"} <= exported.keys()


def test_build_from_a_full_checkpoint_trains_its_thinker(full_checkpoint, config):
    """`model_name_or_path` a full Omni directory: the family builds the thinker from `thinker_config` and loads the
    thinker's tensors (the talker's are not read), on meta too."""
    original, reference = full_checkpoint
    model_cfg = build(ModelConfig, {"model_id": "qwen3_omni_moe", "model_name_or_path": str(original)}, "model")
    assert type(ENTRY.read_config(model_cfg)) is type(config)
    built = ENTRY.build(model_cfg)
    expected = reference.thinker.state_dict()
    state = built.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(value, expected[key]) for key, value in state.items())
    meta = ENTRY.build(model_cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())


def _fsdp_audio_vs_images(rank: int, world_size: int, _) -> tuple[float, float, list[str]]:
    """One step of FSDP2: rank 0 a clip, rank 1 an image (1 process: both micro-batches); the loss, the grad norm
    and the order in which this rank ran its encoders."""
    from mmfsdp.parallel import MeshPlan, ParallelConfig, build_parallel_dims, clip_grad_norm

    config = ENTRY.testkit.tiny_config()
    parallel_cfg = ParallelConfig()
    dims = build_parallel_dims(MeshPlan.from_config(parallel_cfg, world_size), "cpu")
    torch.manual_seed(0)
    model = ENTRY.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
    order: list[str] = []
    for name in ENTRY.vision_modules:
        model.get_submodule(name).register_forward_pre_hook(lambda *_, name=name: order.append(name))
    ENTRY.parallelize(model, parallel_cfg, dims)
    model.set_media_kinds({"image", "audio"})
    batches = [omni_batch([[omni_sample(config, 30, [], [60], seed=1)]], seq_len=30),
               omni_batch([[omni_sample(config, 30, [(4, 4)], [], seed=2)]], seq_len=30)]
    mine = batches if world_size == 1 else [batches[rank]]
    targets = [shift_labels(b["labels"]) for b in mine]
    weights = compute_loss_weights(targets, group=dims.dp_group, num_micro_batches=len(mine))
    total = torch.zeros(())
    for i, (batch, target, weight) in enumerate(zip(mine, targets, weights, strict=True)):
        model.set_requires_gradient_sync(i == len(mine) - 1)
        loss = model(**model_inputs(batch), shift_labels=target, loss_weights=weight).loss
        (loss * world_size).backward()
        total += loss.detach()
    if world_size > 1:
        torch.distributed.all_reduce(total)
    return float(total), float(clip_grad_norm(list(model.parameters()), 1e9)), order


@pytest.mark.slow  # two spawned gloo processes (~7 s): the full suite runs it, the quick tier does not
def test_fsdp2_ranks_with_a_clip_and_with_an_image_run_their_encoders_in_one_order():
    """A rank with a clip and no image and a rank with an image and no clip run the audio tower, then the vision
    tower (a real pass or a placeholder), and two processes give one process's loss and grad norm."""
    from mmfsdp.parallel.testing import run_distributed

    (one,) = run_distributed(_fsdp_audio_vs_images, 1, None)
    two = run_distributed(_fsdp_audio_vs_images, 2, None)
    assert two[0][2] == two[1][2] == ["model.audio_tower", "model.visual"]
    assert_within(abs(two[0][0] - one[0]) / abs(one[0]), TOL, "loss")
    assert_within(abs(two[0][1] - one[1]) / one[1], TOL, "grad norm")
