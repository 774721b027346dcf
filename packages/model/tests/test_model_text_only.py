"""Text-only micro-batches: the vision placeholder of the shared training forward contributes exactly zero.

Every family's forward on a batch without media runs its vision side on the family's smallest input
(`placeholder_vision_inputs`), so that FSDP2's collectives match on every rank. Here, on one process and
without FSDP: the logits and loss are bitwise HF's, the decoder's gradients are bitwise HF's, and every
vision parameter HF's merge would train gets a gradient that is exactly zero (a tensor, not None — the
same parameters take part in the backward as on a rank with images).
"""

import pytest
import torch

from mmfsdp.model import compute_loss_weights, get_model_entry, registered_model_ids, shift_labels
from mmfsdp.model.testing import assert_close, model_inputs, model_pair

FAMILIES = sorted(registered_model_ids())


def _text_only_batch(model_id: str, config) -> dict[str, torch.Tensor]:
    return get_model_entry(model_id).testkit.test_batch(config, images=False, seed=3)


def _vision_parameters(model, model_id: str) -> set[str]:
    entry = get_model_entry(model_id)
    return {name for name, _ in model.named_parameters() if any(name.startswith(m + ".") for m in entry.vision_modules)}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model_id = request.param
    entry = get_model_entry(model_id)
    config = entry.testkit.tiny_config()
    ours, reference = model_pair(config, attn="sdpa", hf_attn="sdpa")
    return model_id, config, ours, reference


def test_every_family_declares_a_placeholder(family):
    model_id, config, ours, _ = family
    inputs = ours.placeholder_vision_inputs(torch.device("cpu"), torch.float32)
    assert inputs, f"{model_id}: no placeholder_vision_inputs"
    features = ours.vision_placeholder_features(torch.device("cpu"), torch.float32)
    assert features and all(torch.isfinite(f).all() for f in features)


def test_text_only_forward_is_bitwise_hf(family):
    model_id, config, ours, reference = family
    batch = _text_only_batch(model_id, config)
    assert not any(key.startswith("pixel_values") for key in batch)
    calls = []
    vision = ours.get_submodule(get_model_entry(model_id).vision_modules[0])
    counter = vision.register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            got = ours(**model_inputs(batch)).logits
            expected = reference(**model_inputs(batch)).logits
    finally:
        counter.remove()
    assert calls, f"{model_id}: the vision side did not run on a text-only batch"
    real = batch["attention_mask"].bool()  # padding positions: M-RoPE positions of padding are not HF's
    assert torch.equal(got[real], expected[real])


def _step(model, batch, *, placeholder: bool):
    """Loss and gradients of one training forward + backward, with or without the vision placeholder."""
    model.zero_grad(set_to_none=True)
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets], loss_type="per_token")
    original = model._missing_media
    if not placeholder:
        model._missing_media = lambda kwargs: ()
    try:
        loss = model(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss
    finally:
        model._missing_media = original
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, weights


def test_text_only_training_step_gradients(family):
    """Bitwise: the step with the placeholder equals the step without it on every parameter the text trains,
    and gives every vision parameter an all-zero gradient; and the step is HF's loss (rel <= 1e-5)."""
    model_id, config, ours, reference = family
    batch = _text_only_batch(model_id, config)
    loss, grads, weights = _step(ours, batch, placeholder=True)
    plain_loss, plain_grads, _ = _step(ours, batch, placeholder=False)
    assert torch.equal(loss, plain_loss)
    vision = _vision_parameters(ours, model_id)
    assert vision and not vision & plain_grads.keys()
    assert grads.keys() - vision == plain_grads.keys()
    for name in plain_grads:
        assert torch.equal(grads[name], plain_grads[name]), f"{model_id}: {name}"
    for name in grads.keys() & vision:
        assert not grads[name].any(), f"{model_id}: {name} has a non-zero gradient"
    logits = reference(**model_inputs(batch)).logits
    targets = shift_labels(batch["labels"])
    per_token = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none"
    )
    expected = (per_token * weights.flatten()).sum()
    assert_close(loss, expected.detach(), 1e-5, "loss")


def test_placeholder_grads_match_the_image_path_parameters(family):
    """The parameters a real image trains are exactly those the placeholder reaches."""
    model_id, config, ours, _ = family
    ours.zero_grad(set_to_none=True)
    features = [f for kind in ours.media_inputs for f in ours.placeholder_features(kind, torch.device("cpu"), torch.float32)]
    sum(f.sum() for f in features).backward()
    reached = {name for name, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad(set_to_none=True)
    batch = get_model_entry(model_id).testkit.test_batch(config, images=True, seed=6)
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets], loss_type="per_token")
    ours(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss.backward()
    trained = {name for name, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad(set_to_none=True)
    assert reached == trained & _vision_parameters(ours, model_id)


def _tower_calls(model, model_id: str, batch) -> tuple[int, torch.Tensor]:
    """How many times the vision tower runs in one training forward of `batch`, and the loss."""
    calls = []
    vision = model.get_submodule(get_model_entry(model_id).vision_modules[0])
    counter = vision.register_forward_hook(lambda *_: calls.append(1))
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets], loss_type="per_token")
    try:
        with torch.no_grad():
            loss = model(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss
    finally:
        counter.remove()
    return len(calls), loss


def test_placeholder_passes_follow_the_media_kinds_of_the_data(family):
    """`set_media_kinds`: one vision-tower pass per kind the data holds that the tower reads (a kind with its own
    encoder, `media_placeholders`, runs that one: tests/test_model_qwen3_omni.py), a placeholder for each kind a call
    lacks, and none for a kind the run's data never holds (no video pass in an image-only run); the loss is unchanged."""
    model_id, config, ours, _ = family
    kinds = list(ours.media_inputs)
    text = _text_only_batch(model_id, config)
    images = get_model_entry(model_id).testkit.test_batch(config, images=True, seed=6)
    present = {kind for kind, key in ours.media_inputs.items() if key in images}  # images (and audio where read)

    def vision_kinds(chosen) -> int:
        return sum(kind not in ours.media_placeholders for kind in chosen)

    try:
        assert _tower_calls(ours, model_id, text)[0] == vision_kinds(kinds)  # default: every kind the family reads
        calls_all, loss_all = _tower_calls(ours, model_id, images)
        assert calls_all == vision_kinds(kinds)
        ours.set_media_kinds(present)
        assert set(ours.media_input_keys) == {ours.media_inputs[kind] for kind in present}
        calls_present, loss_present = _tower_calls(ours, model_id, images)
        assert calls_present == vision_kinds(present) and torch.equal(loss_present, loss_all)
        assert _tower_calls(ours, model_id, text)[0] == vision_kinds(present)
        ours.set_media_kinds(set())  # text-only data: one placeholder pass stays (the tower is in every step)
        assert _tower_calls(ours, model_id, text)[0] == 1
    finally:
        ours.set_media_kinds(kinds)
