"""Single-process save/load: exact resume, app/rank state, RNG, async, pruning, interrupted saves, errors."""

from __future__ import annotations

import datetime
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

import mmfsdp.ckpt.save as checkpoint_module
from mmfsdp.ckpt import (
    CheckpointError,
    finalize_pending,
    list_iterations,
    load_checkpoint,
    read_tracker,
    save_checkpoint,
)


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 12)
        self.down = torch.nn.Linear(12, 3, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.dropout(torch.tanh(self.up(x * self.scale)), 0.2))


def _build(seed: int) -> tuple[TinyNet, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyNet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: TinyNet, optimizer: torch.optim.Optimizer) -> float:
    # batch and dropout draw from the global RNGs, so resuming needs them restored
    x = torch.randn(4, 8) * random.uniform(0.5, 2.0)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _assert_same_state(a: TinyNet, b: TinyNet) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def test_exact_resume_losses_bitwise(tmp_path):
    random.seed(0)
    model, optimizer = _build(0)
    reference = [_step(model, optimizer) for _ in range(6)]

    random.seed(0)
    model, optimizer = _build(0)
    first = [_step(model, optimizer) for _ in range(3)]
    save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer,
                    app_state={"step": 3, "lr_scheduler": {"last_epoch": 3}}, rank_state={"cursor": torch.tensor([12])})
    for _ in range(5):  # the "killed" run keeps going and moves every RNG on
        _step(model, optimizer)

    model, optimizer = _build(123)
    loaded = load_checkpoint(tmp_path, model=model, optimizer=optimizer)
    assert loaded.iteration == 3 and loaded.rng_restored and loaded.saved_world_size == 1
    assert loaded.app_state == {"step": 3, "lr_scheduler": {"last_epoch": 3}}
    assert torch.equal(loaded.rank_state["cursor"], torch.tensor([12]))
    resumed = [_step(model, optimizer) for _ in range(3)]
    assert first + resumed == reference


def test_round_trip_mixed_dtypes_and_optimizer_state(tmp_path):
    model, optimizer = _build(1)
    model.down.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    other, _ = _build(2)
    other.down.to(torch.bfloat16)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.5)
    load_checkpoint(tmp_path, model=other, optimizer=other_optimizer)
    _assert_same_state(model, other)
    assert other_optimizer.param_groups[0]["lr"] == 1e-2
    for p, q in zip(model.parameters(), other.parameters()):
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            a, b = optimizer.state[p][slot], other_optimizer.state[q][slot]
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_no_save_optim_and_no_load_optim(tmp_path):
    model, optimizer = _build(0)
    _step(model, optimizer)
    save_checkpoint(tmp_path, 1, model=model)  # no_save_optim
    other, other_optimizer = _build(5)
    with pytest.raises(CheckpointError, match="no optimizer state.*no_load_optim"):
        load_checkpoint(tmp_path, model=other, optimizer=other_optimizer)
    load_checkpoint(tmp_path, model=other, optimizer=other_optimizer, load_optim=False)
    _assert_same_state(model, other)
    assert other_optimizer.state == {}


def test_no_load_rng_leaves_generators_alone(tmp_path):
    model, optimizer = _build(0)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    torch.manual_seed(77)
    expected = torch.get_rng_state()
    loaded = load_checkpoint(tmp_path, model=model, optimizer=optimizer, load_rng=False)
    assert not loaded.rng_restored
    assert torch.equal(torch.get_rng_state(), expected)


def test_state_that_weights_only_cannot_load_is_rejected(tmp_path):
    model, _ = _build(0)

    class Local:
        pass

    with pytest.raises(CheckpointError, match="rank_state .*weights_only=True"):
        save_checkpoint(tmp_path, 1, model=model, rank_state={"sampler": datetime.date(2024, 1, 1)})
    with pytest.raises(CheckpointError, match="app_state .*weights_only=True"):
        save_checkpoint(tmp_path, 1, model=model, app_state={"sampler": Local()})
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()


def test_keep_last_prunes_after_tracker_moves(tmp_path):
    model, optimizer = _build(0)
    for iteration in (1, 2, 3, 4):
        save_checkpoint(tmp_path, iteration, model=model, optimizer=optimizer, keep_last=2)
        assert read_tracker(tmp_path) == iteration
    assert list_iterations(tmp_path) == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "latest_checkpointed_iteration.txt"]


def test_resaving_an_iteration_replaces_it(tmp_path):
    model, optimizer = _build(0)
    save_checkpoint(tmp_path, 1, model=model)
    with torch.no_grad():
        model.up.weight.add_(1.0)
    save_checkpoint(tmp_path, 1, model=model)
    other, _ = _build(9)
    load_checkpoint(tmp_path, model=other)
    _assert_same_state(model, other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]


def test_async_save_stages_a_copy_and_publishes_on_completion(tmp_path):
    model, optimizer = _build(0)
    _step(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    handle = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, async_save=True, keep_last=1)
    with torch.no_grad():  # training goes on while the save runs
        for p in model.parameters():
            p.mul_(3.0)
    assert handle.wait() == tmp_path / "iter_0000001"
    assert handle.done() and read_tracker(tmp_path) == 1
    other, other_optimizer = _build(4)
    load_checkpoint(tmp_path, model=other, optimizer=other_optimizer)
    for key, value in expected.items():
        assert torch.equal(other.state_dict()[key], value), key

    # the next save waits for a pending one; pruning happens when it is published
    save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, async_save=True, keep_last=1)
    assert finalize_pending() == tmp_path / "iter_0000002"
    assert finalize_pending() is None
    assert list_iterations(tmp_path) == [2] and read_tracker(tmp_path) == 2
    load_checkpoint(tmp_path, model=other)
    _assert_same_state(model, other)


class _FailingWriter(dcp.FileSystemWriter):
    """Writes part of the data, then dies like a full disk or a killed node would."""

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        raise OSError("simulated crash during dcp.save")


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer = _build(0)
    save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, optimizer)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_module, "FileSystemWriter", _FailingWriter)
        with pytest.raises(dcp.CheckpointException, match="simulated crash"):
            save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer)
    assert read_tracker(tmp_path) == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("iter_0000002")]
    assert len(leftovers) == 1 and ".tmp-" in leftovers[0]
    other, other_optimizer = _build(3)
    assert load_checkpoint(tmp_path, model=other, optimizer=other_optimizer).iteration == 1
    for key, value in saved.items():
        assert torch.equal(other.state_dict()[key], value)
    # a later save works and clears the partial directory
    save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer)
    assert read_tracker(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]


def test_model_mismatch_is_a_clear_error(tmp_path):
    model, _ = _build(0)
    save_checkpoint(tmp_path, 1, model=model)
    wider = torch.nn.Module()
    wider.up = torch.nn.Linear(8, 16)
    wider.down = torch.nn.Linear(16, 3, bias=False)
    wider.extra = torch.nn.Linear(2, 2)
    wider.register_buffer("scale", torch.ones(8))
    with pytest.raises(CheckpointError, match=r"(?s)2 model keys missing.*extra.weight.*shape mismatches.*up.weight: model \(16, 8\), checkpoint \(12, 8\)"):
        load_checkpoint(tmp_path, model=wider)


def test_load_errors(tmp_path):
    model, _ = _build(0)
    save_checkpoint(tmp_path / "ok", 1, model=model)
    with torch.device("meta"):
        meta_model = TinyNet()
    with pytest.raises(CheckpointError, match="meta device.*to_empty"):
        load_checkpoint(tmp_path / "ok", model=meta_model)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing", model=model)
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt"):
        load_checkpoint(tmp_path, model=model)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(CheckpointError, match="points at 5"):
        load_checkpoint(tmp_path, model=model)


def test_save_into_a_file_path_is_a_clear_error(tmp_path):
    model, _ = _build(0)
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(CheckpointError, match="rank 0 failed while saving a checkpoint: FileExistsError"):
        save_checkpoint(tmp_path / "taken", 1, model=model)
