"""Two processes with FSDP2: meta-device Mistral3 loaded from HF shards, trained, saved, exported, reloaded by HF.

Each rank builds the model on the meta device, shards it, materialises only its
shards, recomputes rotary `inv_freq`, and reads only its slice of each tensor
(`load_hf_weights`); its logits equal `from_pretrained`'s. After one AdamW step
the run saves a DCP checkpoint; `dcp_to_hf` exports it and `from_pretrained` on
the export has the trained weights and gives the same logits as an HF model
holding them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import Mistral3ForConditionalGeneration

from mmfsdp.ckpt import dcp_to_hf, load_hf_weights, save_checkpoint
from mmfsdp.parallel.testing import run_distributed


def _convert_helpers():
    # the sibling e2e test defines the tiny model; load it by path (tests are not a package)
    path = Path(__file__).with_name("test_e2e_ckpt_convert.py")
    name = "_e2e_ckpt_convert_helpers"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_meta_load_train_save(rank: int, world_size: int, hf_dir: str, save_dir: str) -> dict:
    helpers = _convert_helpers()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Mistral3ForConditionalGeneration(helpers.tiny_config())
    for layer in [*model.model.language_model.layers, *model.model.vision_tower.transformer.layers]:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    helpers.init_rotary_buffers(model)
    load_hf_weights(model, hf_dir)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    # before any forward: FSDP2 keeps the root's parameters unsharded after a no-grad forward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loaded_logits = helpers.logits_of(model)

    model.train()
    batch = helpers.inputs()
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    optimizer.step()
    save_checkpoint(save_dir, 1, model=model, optimizer=optimizer)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"loaded_logits": loaded_logits, "local_numel": local_numel,
            "trained": {k: v.clone() for k, v in full.items()}}


def test_fsdp2_meta_load_then_training_checkpoint_exports_to_hf(tmp_path):
    helpers = _convert_helpers()
    hf_dir = tmp_path / "hf"
    helpers.save_tiny(hf_dir, torch.float32)
    reference = Mistral3ForConditionalGeneration.from_pretrained(hf_dir)
    expected = helpers.logits_of(reference)
    total_numel = sum(p.numel() for p in reference.parameters())

    results = run_distributed(run_meta_load_train_save, 2, str(hf_dir), str(tmp_path / "train"))
    for result in results:
        assert torch.equal(result["loaded_logits"], expected)
        assert result["local_numel"] <= total_numel // 2 + 64  # each rank holds about half
    trained = results[0]["trained"]

    dcp_to_hf(tmp_path / "train", tmp_path / "out", hf_dir, max_shard_size="100KB", progress=False)
    exported = Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "out")
    state = exported.state_dict()
    assert state.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(state[key], value), key
    holder = Mistral3ForConditionalGeneration(helpers.tiny_config())
    holder.load_state_dict(trained)
    assert torch.equal(helpers.logits_of(exported), helpers.logits_of(holder))
    assert not torch.equal(helpers.logits_of(exported), expected)  # the step changed the weights
