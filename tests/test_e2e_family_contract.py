"""The family contract: what every registered model family must do, checked the same way for each.

Parametrised over `registered_model_ids()` — the installed families and the test-only LLaVA family
(`tests/families/llava`, registered by importing it) — so registering a family is what gives it this coverage.
Each family provides `tiny_config()` and `test_batch(config, images=, seed=)` on its entry; nothing here names a
family. Per family:

- the training forward's step-1 loss equals HF's `labels=` loss (rel <= 1e-5), on a batch with images (of
  several sizes where the tower allows, rows with none) and on one without any;
- a meta-device build, materialised, with its non-persistent buffers filled and loaded from the files HF's
  `save_pretrained` writes (through the family's state-dict adapter), has bitwise the eager model's parameters
  and buffers;
- the state-dict adapter round trip HF -> ours -> HF is bitwise, and the adapter's `architectures` (what exports
  write in `config.json`, so that servers build the generating class) is what HF's `save_pretrained` writes;
- FSDP2 on 2 processes equals 1 process with 2 micro-batches (loss and grad norm of 2 AdamW steps, rel <= 1e-5),
  one micro-batch with images and one text-only, so the ranks hold different media;
- the FLOP count of its entry (`flop_shape`, `image_patches`; MFU) equals the matmul FLOPs torch's FlopCounterMode
  measures in its forward on the padded batch with images, within 1 % (attention and the patch convolution
  aside; the family's glue, e.g. a class token or the weighting of the experts' outputs, is within that);
- context parallel (Ulysses, Ring) is refused by the pre-start check unless the family declares it, and passes
  the capability check where it does; the data pieces of other families are refused.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import families.llava  # noqa: F401  (registers the test-only family)
from mmfsdp.ckpt.adapters import plan_from_hf, plan_to_hf
from mmfsdp.config import ConfigError
from mmfsdp.data.collators import collator_names
from mmfsdp.data.plugins import get_plugin, plugin_names
from mmfsdp.data.templates import template_names
from mmfsdp.model import (
    ModelConfig, check_data, compute_loss_weights, get_model_entry, registered_model_ids, shift_labels,
)
from mmfsdp.model.testing import assert_close, model_inputs, model_pair
from mmfsdp.parallel.testing import assert_within, run_distributed

FAMILIES = registered_model_ids()
TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "config.yaml"
TOL = 1e-5
STEPS = 2


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    entry = get_model_entry(request.param)
    config = entry.testkit.tiny_config()
    ours, reference = model_pair(config, attn="mmfsdp_sdpa", hf_attn="sdpa")
    return entry, config, ours, reference


@pytest.fixture(scope="module")
def saved(family, tmp_path_factory):
    """The HF model's `save_pretrained` directory (config.json and safetensors in the family's HF layout)."""
    entry, _, _, reference = family
    path = tmp_path_factory.mktemp(f"hf_{entry.model_id}")
    reference.save_pretrained(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("images", [True, False], ids=["images", "text_only"])
def test_contract_step1_loss_equals_hf_labels_loss(family, images):
    entry, config, ours, reference = family
    batch = entry.testkit.test_batch(config, images=images, seed=1)
    assert any(key.startswith("pixel_values") for key in batch) == images
    targets = shift_labels(batch["labels"])
    (weights,) = compute_loss_weights([targets])
    with torch.no_grad():
        expected = reference(**batch).loss
        loss = ours(**model_inputs(batch), shift_labels=targets, loss_weights=weights).loss
    assert torch.isfinite(expected), entry.model_id
    assert_close(loss, expected, TOL, f"{entry.model_id} loss")


def test_contract_meta_init_equals_eager_build(family, saved):
    """The trainer's meta path: build on meta, `to_empty`, fill the non-persistent buffers, load the HF files."""
    from mmfsdp.ckpt import load_hf_weights

    entry, _, ours, _ = family
    model_cfg = ModelConfig(model_id=entry.model_id, model_name_or_path=str(saved))
    model = entry.build(model_cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    entry.init_non_persistent_buffers(model)
    load_hf_weights(model, saved, adapter=entry.state_dict_adapter())
    for kind in ("named_parameters", "named_buffers"):
        got, expected = dict(getattr(model, kind)()), dict(getattr(ours, kind)())
        assert got.keys() == expected.keys(), (entry.model_id, kind)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (entry.model_id, name)


def test_contract_state_dict_adapter_round_trip(family, saved):
    """HF -> ours -> HF through the adapter is bitwise, and the files `save_pretrained` wrote read as `state_dict()`."""
    from mmfsdp.model.testing import read_safetensors

    entry, _, ours, _ = family
    adapter = entry.state_dict_adapter()
    state = {key: value for key, value in ours.state_dict().items()}

    def from_hf(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plans = plan_from_hf(adapter, {key: (tuple(t.shape), t.dtype) for key, t in hf.items()})
        return {key: plan.build(hf.__getitem__) for key, plan in plans.items()}

    def to_hf(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plans = plan_to_hf(adapter, {key: (tuple(t.shape), t.dtype) for key, t in model_state.items()})
        return {hf_key: t for key, plan in plans.items() for hf_key, t in plan.pieces(model_state[key]).items()}

    files = read_safetensors(saved)
    from_files = from_hf(files)
    assert from_files.keys() <= state.keys() and set(state) - set(from_files) <= _tied_keys(ours), entry.model_id
    for key, tensor in from_files.items():
        assert torch.equal(tensor, state[key]), (entry.model_id, key)
    hf = to_hf(from_files)
    back = to_hf(from_hf(hf))
    assert hf.keys() == back.keys()
    for key in hf:
        assert hf[key].dtype == back[key].dtype and torch.equal(hf[key], back[key]), (entry.model_id, key)


def test_contract_state_dict_adapter_names_the_hf_class(family, saved):
    entry = family[0]
    architectures = list(entry.state_dict_adapter().architectures)
    assert architectures == json.loads((saved / "config.json").read_text())["architectures"], entry.model_id


def _tied_keys(model) -> set[str]:
    """State-dict keys that share storage with an earlier key (tied weights, which the files hold once)."""
    seen, tied = set(), set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            tied.add(key)
        seen.add(tensor.data_ptr())
    return tied


def _fsdp_steps(rank: int, world_size: int, model_ids: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Per family: (loss, grad norm) of `STEPS` AdamW steps of 2 micro-batches (the first with images, the second
    text-only) — 1 process runs both, 2 processes one each — FSDP2 through the entry's `parallelize`."""
    from mmfsdp.parallel import MeshPlan, ParallelConfig, ShardAdamW, build_parallel_dims, clip_grad_norm

    parallel_cfg = ParallelConfig()
    dims = build_parallel_dims(MeshPlan.from_config(parallel_cfg, world_size), "cpu")
    per_rank = 2 // world_size
    out = {}
    for model_id in model_ids:
        entry = get_model_entry(model_id)
        config = entry.testkit.tiny_config()
        torch.manual_seed(0)
        model = entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")
        entry.parallelize(model, parallel_cfg, dims)
        optimizer = ShardAdamW(model.parameters(), lr=1e-3, foreach=True)  # the trainer's AdamW, on local shards
        history = []
        for step in range(STEPS):
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
            norm = clip_grad_norm([p for p in model.parameters()], 1.0)
            dist.all_reduce(total)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            history.append((total.item(), float(norm)))
        out[model_id] = history
    return out


@pytest.fixture(scope="module")
def fsdp_runs():
    """Every family's steps on 1 and on 2 processes (each world size spawned once)."""
    return {size: run_distributed(_fsdp_steps, size, FAMILIES)[0] for size in (1, 2)}


@pytest.mark.slow  # every family on 1 and 2 processes
def test_contract_fsdp2_two_processes_equal_one(family, fsdp_runs):
    entry = family[0]
    one, two = fsdp_runs[1][entry.model_id], fsdp_runs[2][entry.model_id]
    assert len(one) == len(two) == STEPS
    for step, ((loss_1, norm_1), (loss_2, norm_2)) in enumerate(zip(one, two, strict=True), start=1):
        assert math.isfinite(loss_1) and norm_1 > 0, (entry.model_id, step)
        assert_within(abs(loss_2 - loss_1) / abs(loss_1), TOL, f"{entry.model_id} step {step} loss {loss_1} vs {loss_2}")
        assert_within(abs(norm_2 - norm_1) / norm_1, TOL, f"{entry.model_id} step {step} grad norm {norm_1} vs {norm_2}")


@pytest.mark.parametrize("key", ["parallel.ulysses_parallel_size", "parallel.ring_attention_size"])
def test_contract_context_parallel_only_where_declared(family, saved, key):
    """The pre-start check (`check_world`: `--check` and the trainer) refuses CP on a family that does not declare
    it, in one line naming the key; a family that declares it passes."""
    from mmfsdp.train.config import check_world, load_config

    entry = family[0]
    cfg = load_config(TINY, [f"model.model_id={entry.model_id}", f"model.model_name_or_path={saved}", f"{key}=2"])
    if entry.capabilities.context_parallel:
        assert check_world(cfg, 2).cp == 2
        return
    with pytest.raises(ConfigError, match=rf"^{key}: 2 needs context parallel, which model_id '{entry.model_id}' "):
        check_world(cfg, 2)


def test_contract_data_pieces_are_the_familys_own(family):
    """The family's own data pieces pass the check; every other registered one is refused, naming its key."""
    entry = family[0]
    own = entry.data
    assert not check_data(
        entry,
        template=own.templates[0] if own.templates else None,
        image_plugin=own.image_plugins[0] if own.image_plugins else None,
        collator=own.collators[0] if own.collators else None,
        packing=entry.capabilities.packing,
    )
    for names, declared, field in (
        (template_names(), own.templates, "template"),
        (plugin_names(), own.image_plugins, "image_plugin"),
        (collator_names(), own.collators, "collator"),
    ):
        for name in set(names) - set(declared):
            errors = check_data(
                entry, **{"template": None, "image_plugin": None, "collator": None, field: name}, packing=False
            )
            assert len(errors) == 1 and f"{name!r} is not for model_id {entry.model_id!r}" in str(errors[0]), name
    if not entry.capabilities.packing:
        (error,) = check_data(entry, template=None, image_plugin=None, collator=None, packing=True)
        assert error.key == "data.dataset_param.basic_parameters.packing"
        (error,) = check_data(entry, template=None, image_plugin=None, collator=None, packing=False, padding_free=True)
        assert error.key == "data.dataloader_param.padding_free"
    else:
        assert not check_data(entry, template=None, image_plugin=None, collator=None, packing=False, padding_free=True)
    if entry.capabilities.video:  # a family declaring video reads it with its own image plugin
        assert own.image_plugins and get_plugin(own.image_plugins[0]).supports_video
    else:
        (error,) = check_data(entry, template=None, image_plugin=None, collator=None, packing=False, videos=True)
        assert error.key == "data.dataset_param.attr.videos" and "\n" not in str(error)


_MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm")


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """`_grouped_mm` of `[T, K]` tokens by `[G, K, N]` weights (tokens in groups by `offs`): 2·T·K·N."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def test_contract_flop_count_equals_the_measured_matmuls(family):
    import dataclasses

    from torch.utils import flop_counter

    from mmfsdp.model.flops import tower_forward

    entry, config, ours, _ = family
    if torch.ops.aten._grouped_mm not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)
    batch = entry.testkit.test_batch(config, images=True)
    with flop_counter.FlopCounterMode(display=False) as counter, torch.no_grad():
        ours(**model_inputs(batch))
    measured = sum(v for op, v in counter.get_flop_counts()["Global"].items() if str(op) in _MATMULS)
    shape = entry.costs.flop_shape(config)
    rows, seq_len = batch["input_ids"].shape
    # the model computes every padded position; attention and the convolution are left out of both sides
    counted = tower_forward(dataclasses.replace(shape.decoder, attention_dim=0), [seq_len] * rows)
    patches = entry.costs.image_patches(config, batch)
    assert patches, "the test batch has images"
    # a placeholder pass of the vision tower for each kind of media it reads that the batch lacks (Qwen3-VL: videos)
    missing = sum(kind not in ours.media_placeholders for kind in ours._missing_media(model_inputs(batch)))
    if missing:
        placeholder = ours.placeholder_vision_inputs(torch.device("cpu"), torch.float32)
        patches = patches + entry.costs.image_patches(config, placeholder) * missing
    if entry.vision_modules:
        assert shape.vision is not None, "a family with a vision tower describes it (vision_flops)"
        counted = counted + tower_forward(dataclasses.replace(shape.vision, attention_dim=0, params_outside=0), patches)
    windows = entry.costs.audio_windows(config, batch)
    if shape.audio is not None and windows:  # an audio tower's layers and projections (its convolutions aside)
        counted = counted + tower_forward(dataclasses.replace(shape.audio, attention_dim=0), windows)
    total = counted.layers + counted.other
    assert abs(total - measured) <= 0.01 * measured, (entry.model_id, total, measured)
