"""Two gloo processes with FSDP2: exact resume, async save, resharding 2 -> 1 and 1 -> 2, HF loading into shards."""

from __future__ import annotations

import random

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from mmfsdp.ckpt import finalize_pending, list_iterations, load_checkpoint, load_hf_weights, read_tracker, save_checkpoint


class OddNet(torch.nn.Module):
    """Odd row counts, so FSDP2 shards are uneven (7 rows -> 4 + 3, 3 rows -> 2 + 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 7)
        self.down = torch.nn.Linear(7, 3, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.dropout(torch.tanh(self.up(x * self.scale)), 0.2))


def _build(seed: int, shard: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = OddNet()
    if shard:
        fully_shard(model.up)
        fully_shard(model.down)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    x = torch.randn(4, 8) * random.uniform(0.5, 2.0)  # differs per rank: each rank's RNG was seeded apart
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.clone() for k, v in model_sd.items()},
            "optim": {k: {s: t.clone() for s, t in v.items()} for k, v in optim_sd["state"].items()}}


def _assert_full_state_equal(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert a["model"][key].dtype == b["model"][key].dtype and torch.equal(a["model"][key], b["model"][key]), key
    assert a["optim"].keys() == b["optim"].keys()
    for key in a["optim"]:
        for slot in a["optim"][key]:
            assert torch.equal(a["optim"][key][slot], b["optim"][key][slot]), (key, slot)


def run_train_save_continue(rank: int, world_size: int, save_dir: str) -> dict:
    model, optimizer = _build(0, shard=True)
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    for _ in range(2):
        _step(model, optimizer)
    save_checkpoint(save_dir, 2, model=model, optimizer=optimizer, app_state={"step": 2},
                    rank_state={"cursor": torch.tensor([10 * rank + 2])})
    at_save = _full_state(model, optimizer)
    losses = [_step(model, optimizer) for _ in range(2)]
    return {"at_save": at_save, "losses": losses}


def run_resume_continue_async_save(rank: int, world_size: int, save_dir: str) -> dict:
    model, optimizer = _build(7, shard=True)
    loaded = load_checkpoint(save_dir, model=model, optimizer=optimizer)
    assert loaded.iteration == 2 and loaded.app_state == {"step": 2} and loaded.saved_world_size == 2
    assert torch.equal(loaded.rank_state["cursor"], torch.tensor([10 * rank + 2]))
    at_load = _full_state(model, optimizer)
    losses = [_step(model, optimizer) for _ in range(2)]
    handle = save_checkpoint(save_dir, 4, model=model, optimizer=optimizer, async_save=True, keep_last=1)
    at_async_save = _full_state(model, optimizer)
    _step(model, optimizer)  # keeps training while the save is in flight
    finalize_pending()
    assert handle.done()
    assert read_tracker(save_dir) == 4 and list_iterations(save_dir) == [4]
    return {"at_load": at_load, "losses": losses, "at_async_save": at_async_save}


def test_fsdp2_exact_resume_async_save_and_reshard_to_one_process(tmp_path, run_ranks):
    save_dir = str(tmp_path / "ckpt")
    first = run_ranks(run_train_save_continue, 2, save_dir)
    second = run_ranks(run_resume_continue_async_save, 2, save_dir)
    for rank in range(2):
        _assert_full_state_equal(second[rank]["at_load"], first[rank]["at_save"])
        assert second[rank]["losses"] == first[rank]["losses"]  # bitwise: float equality of the loss values

    # 2 -> 1 process: DCP reshards model and optimizer; per-rank state is not restored
    model, optimizer = _build(3, shard=False)
    loaded = load_checkpoint(save_dir, model=model, optimizer=optimizer)
    assert loaded.iteration == 4 and loaded.saved_world_size == 2
    assert loaded.rank_state is None and not loaded.rng_restored
    _assert_full_state_equal(_full_state(model, optimizer), second[0]["at_async_save"])


def run_load_into_shards(rank: int, world_size: int, ckpt_dir: str, hf_dir: str) -> dict:
    model, optimizer = _build(11, shard=True)
    loaded = load_checkpoint(ckpt_dir, model=model, optimizer=optimizer)
    assert loaded.rank_state is None and loaded.saved_world_size == 1
    local_rows = model.up.weight.to_local().shape[0]
    from_ckpt = _full_state(model, optimizer)
    fresh, _ = _build(12, shard=True)
    fresh.to_empty(device="cpu")
    load_hf_weights(fresh, hf_dir)
    from_hf = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in fresh.state_dict().items()}
    return {"from_ckpt": from_ckpt, "from_hf": from_hf, "local_rows": local_rows}


def test_reshard_one_to_two_processes_and_hf_load_into_fsdp2_shards(tmp_path, run_ranks):
    model, optimizer = _build(5, shard=False)
    random.seed(0)
    for _ in range(2):
        _step(model, optimizer)
    save_checkpoint(tmp_path / "ckpt", 2, model=model, optimizer=optimizer)
    expected = _full_state(model, optimizer)

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf_tensors = {k: v.to(torch.bfloat16) if k == "up.weight" else v.clone() for k, v in model.state_dict().items()}
    save_file({k: hf_tensors[k] for k in ("up.weight", "scale")}, hf_dir / "model-00001-of-00002.safetensors")
    save_file({k: hf_tensors[k] for k in ("up.bias", "down.weight")}, hf_dir / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {k: f"model-0000{1 if k in ('up.weight', 'scale') else 2}-of-00002.safetensors" for k in hf_tensors}}
    (hf_dir / "model.safetensors.index.json").write_text(__import__("json").dumps(index))

    results = run_ranks(run_load_into_shards, 2, str(tmp_path / "ckpt"), str(hf_dir))
    assert [r["local_rows"] for r in results] == [4, 3]
    for result in results:
        _assert_full_state_equal(result["from_ckpt"], expected)
        for key, value in hf_tensors.items():
            loaded = result["from_hf"][key]
            assert loaded.dtype == torch.float32 and torch.equal(loaded, value.float()), key
