"""The training loop's components in-process, without a model run: step results settled from device tensors,
which steps log, the non-finite check (also before a save), the checkpointer's save rule, the heartbeat's
phases, validation steps, profiling's memory snapshot, what is trained, and the family step-terms hook (the
MoE router terms against `load_balancing_loss` in a one-process group)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mmfsdp.ckpt import generation_metadata
from mmfsdp.model.flops import ForwardFlops
from mmfsdp.train import supervise
from mmfsdp.train.checkpointer import Checkpointer
from mmfsdp.train.evaluate import Evaluator
from mmfsdp.train.metrics import Metrics
from mmfsdp.train.profiling import Profiling
from mmfsdp.train.step import NonFiniteLoss, StepResult, first_non_finite, settle
from mmfsdp.train.supervise import LoopHeartbeat
from mmfsdp.train.trainable import Trainable


def _result(step: int, loss: float, grad_norm: float = 1.0, stats: dict | None = None) -> StepResult:
    return StepResult.on_device(
        step, 1e-3, loss=torch.tensor(loss, dtype=torch.float32), grad_norm=torch.tensor(grad_norm),
        counts=torch.tensor([10 * step, 100, 7]), stats={k: torch.tensor(v) for k, v in (stats or {}).items()},
    )


def test_train_settle_gives_the_python_numbers_of_the_device_values():
    loss = torch.tensor(2.123456789, dtype=torch.float32)
    results = [_result(1, float(loss), 0.5, {"aux_loss": 0.25, "load": 3.0}), _result(2, 1.5)]
    assert not results[0].settled
    settle(results)
    first, second = results
    assert first.settled and second.settled
    assert first.loss == loss.item() and first.grad_norm == 0.5  # the fp32 value exactly, as .item() gives it
    assert first.num_tokens == 10 and first.flops == ForwardFlops(100, 7)
    assert first.stats == {"aux_loss": 0.25, "load": 3.0} and second.stats == {}
    assert second.loss == 1.5 and second.num_tokens == 20
    settle(results)  # settled results are left as they are
    assert first.loss == loss.item()
    assert first_non_finite(results) is None
    bad = [_result(3, 1.0), _result(4, 2.0, float("inf")), _result(5, float("nan"))]
    settle(bad)
    assert first_non_finite(bad) == 1



def test_train_settle_waits_for_the_reductions_before_reading():
    """The loss and the counts are summed by collectives started without waiting: `settle` waits for each
    handle first, and reads what the reduction wrote."""
    loss, counts = torch.tensor(1.0), torch.tensor([4, 40, 4])

    class _Work:
        def __init__(self, tensor: torch.Tensor):
            self.tensor, self.waited = tensor, False

        def wait(self) -> bool:
            self.tensor.mul_(2)  # what a sum over two ranks of the same values gives
            self.waited = True
            return True

    works = [_Work(loss), _Work(counts)]
    result = StepResult.on_device(3, 1e-3, loss=loss, grad_norm=torch.tensor(0.5), counts=counts, stats={},
                                  reductions=works)
    assert not any(work.waited for work in works)
    settle([result])
    assert all(work.waited for work in works)
    assert result.loss == 2.0 and result.num_tokens == 8 and result.flops == ForwardFlops(80, 8)

class _Writer:
    def __init__(self):
        self.records = []
        self.closed = False

    def log_step(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


class _Flops:
    def scalars(self, flops, step_time_s):
        return {"tflops": flops.model / step_time_s / 1e12, "mfu": 0.5}


def _metrics(log_interval=3, total=10, validates=lambda step: step == 4):
    return Metrics(log_interval=log_interval, total_steps=total, writer=_Writer(), flop_meter=_Flops(),
                   device=torch.device("cpu"), validates=validates)


def _step(metrics: Metrics, result: StepResult, val_loss: float | None = None) -> None:
    with metrics.timed(result.step):
        pass
    metrics.step_done(result, val_loss=val_loss)


def test_train_metrics_log_every_interval_the_last_step_and_validation_steps():
    metrics = _metrics()
    assert [step for step in range(1, 11) if metrics.logs(step)] == [3, 4, 6, 9, 10]
    for step in range(1, 5):
        _step(metrics, _result(step, 5.0 - step, stats={"aux_loss": 0.1}), val_loss=2.5 if step == 4 else None)
    records = metrics.writer.records
    assert [r["step"] for r in records] == [3, 4]
    assert all(r.settled for r in metrics.history) and [r.step for r in metrics.history] == [1, 2, 3, 4]
    assert records[0]["loss"] == 2.0 and records[0]["num_tokens"] == 30 and records[0]["aux_loss"] == pytest.approx(0.1)
    assert "val_loss" not in records[0] and records[1]["val_loss"] == 2.5
    assert records[1]["tokens_per_s"] == pytest.approx(40 / records[1]["step_time_s"])
    assert list(records[0])[:8] == ["step", "loss", "grad_norm", "lr", "num_tokens", "tokens_per_s", "step_time_s",
                                    "peak_mem_gb"]
    metrics.close()
    assert metrics.writer.closed


def test_train_metrics_do_not_read_the_device_between_logging_steps(monkeypatch):
    reads = []
    monkeypatch.setattr("mmfsdp.train.metrics.settle", lambda results: reads.append(len(results)))
    metrics = _metrics(log_interval=5, total=10, validates=lambda step: False)
    for step in range(1, 5):
        metrics.step_done(_result(step, 1.0))
    assert reads == []
    with metrics.timed(5):
        pass
    monkeypatch.undo()
    metrics.step_done(_result(5, 1.0))
    assert all(r.settled for r in metrics.history) and len(metrics.writer.records) == 1


def test_train_metrics_stop_at_the_first_non_finite_step_with_the_last_finite_loss():
    metrics = _metrics(log_interval=4, validates=lambda step: False)
    for step, loss in enumerate([3.0, 2.5, 2.25, 2.0, 1.75, float("nan"), float("nan")], 1):
        _step(metrics, _result(step, loss))
    with pytest.raises(NonFiniteLoss) as caught:
        metrics.check()  # before a save
    err = caught.value
    assert "is not finite at step 6 (last finite loss 1.750000 at step 5)" in str(err)
    assert err.last_finite_step == 5 and [r.step for r in metrics.history] == [1, 2, 3, 4, 5]

    first = _metrics(log_interval=1, validates=lambda step: False)
    with pytest.raises(NonFiniteLoss, match=r"grad norm inf is not finite at step 1 \(no finite loss yet\)") as caught:
        _step(first, _result(1, 1.0, float("inf")))
    assert caught.value.last_finite_step == 0 and first.history == [] and first.writer.records == []


def _checkpointer(tmp_path, monkeypatch, *, save_interval, before_save=lambda: None, save_format="dcp"):
    saved = []
    monkeypatch.setattr("mmfsdp.train.checkpointer.save_checkpoint",
                        lambda root, step, **kw: saved.append((step, kw["trainable_only"], kw["app_state"],
                                                               kw["metadata"])))
    cfg = SimpleNamespace(save=str(tmp_path / "ckpt"), save_interval=save_interval, no_save_optim=False,
                          save_async=False, save_total_limit=None, save_format=save_format, stage="sft")
    state = SimpleNamespace(state_dict=lambda: {"step": "app"}, rank_state_dict=lambda: {"loader": "rank"})
    trainable = Trainable(SimpleNamespace(enable=False), freeze=None, entry=None, seed=0)
    ckpt = Checkpointer(cfg, hf_source=None, model=None, optimizer=None, state=state, trainable=trainable,
                        heartbeat=LoopHeartbeat(), rank=0, before_save=before_save,
                        export_metadata=generation_metadata([7, 2], pad_token_id=0))
    return ckpt, saved


def test_train_checkpointer_saves_on_the_interval_and_at_the_end_once(tmp_path, monkeypatch):
    ckpt, saved = _checkpointer(tmp_path, monkeypatch, save_interval=3)
    for step in range(1, 8):
        ckpt.save(step)
    ckpt.save(7, last=True)
    assert [s[0] for s in saved] == [3, 6, 7]
    assert saved[0][1:3] == (False, {"step": "app"})
    # the stage that trained it, and what its HF exports write in generation_config.json
    assert saved[0][3] == {"stage": "sft", "generation_config": {"eos_token_id": [7, 2], "pad_token_id": 0}}
    ckpt.save(9, last=True)  # the last step on the interval was saved by the loop already
    ckpt.save(9)
    assert [s[0] for s in saved] == [3, 6, 7, 9]

    only_end, saved = _checkpointer(tmp_path, monkeypatch, save_interval=0)
    assert not any(only_end.due(step) for step in range(1, 10)) and only_end.due(10, last=True)
    only_end.cfg.save = None
    assert not only_end.due(10, last=True)


def test_train_checkpointer_never_saves_a_non_finite_step(tmp_path, monkeypatch):
    metrics = _metrics(log_interval=100, validates=lambda step: False)
    ckpt, saved = _checkpointer(tmp_path, monkeypatch, save_interval=2, before_save=metrics.check)
    _step(metrics, _result(1, 1.0))
    ckpt.save(1)
    _step(metrics, _result(2, float("inf")))
    with pytest.raises(NonFiniteLoss, match="not finite at step 2"):
        ckpt.save(2)
    assert saved == []


def test_train_loop_heartbeat_names_the_phases_and_pauses_around_unbounded_ones(tmp_path):
    hb = supervise.start_heartbeat(60, rank=0, output_dir=tmp_path)
    try:
        loop = LoopHeartbeat()
        loop.micro_batch(3, 1, 2)
        assert (hb.phase, hb.armed) == ("step 3 micro-batch 1/2", False)
        loop.step_done(3)
        assert (hb.phase, hb.armed) == ("step 4", True)
        with loop.paused("saving the checkpoint of step 3", 3):
            assert (hb.phase, hb.armed) == ("saving the checkpoint of step 3", False)
        assert (hb.phase, hb.armed) == ("step 4", True)
        loop.pause("the final evaluation")
        assert (hb.phase, hb.armed) == ("the final evaluation", False)
    finally:
        supervise.start_heartbeat(0, rank=0, output_dir=tmp_path)


def test_train_evaluator_validates_on_its_interval_only(monkeypatch):
    cfg = SimpleNamespace(training=SimpleNamespace(val_interval=2))
    evaluator = Evaluator(cfg, model=None, processor=None, dims=None, device=torch.device("cpu"), pad_multiple=1,
                          output_dir=Path("."), rank=0)
    losses = iter([1.5, 1.25])
    monkeypatch.setattr(evaluator, "validation_loss", lambda: next(losses))
    assert [evaluator.validate(step) for step in range(1, 5)] == [None, 1.5, None, 1.25]
    assert evaluator.val_losses == {2: 1.5, 4: 1.25}
    cfg.training.val_interval = 0
    assert not evaluator.should_validate(4)


def test_train_profiling_snapshots_the_chosen_steps_on_the_chosen_rank(tmp_path):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = SimpleNamespace(enable=True, dump_ranks=[0], start_step=2, end_step=3, stacks="python",
                             max_entries=None, save_path=str(tmp_path / "snap"))
    tools = SimpleNamespace(profile=SimpleNamespace(enable=False), memory_profile=memory)

    def run(rank):
        profiling = Profiling(tools, model=model, optimizer=optimizer, device_type="cpu", rank=rank,
                              output_dir=tmp_path, start_step=0)
        with profiling:
            for step in range(1, 5):
                with profiling.step(step):
                    model(torch.ones(2, 4)).sum().backward()

    run(rank=1)
    assert not (tmp_path / "snap").exists()
    run(rank=0)
    assert [p.name for p in (tmp_path / "snap").iterdir()] == ["snapshot_rank0_steps2-3.json"]


def test_train_trainable_freezes_and_saves_everything_without_lora():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    trainable = Trainable(SimpleNamespace(enable=False), freeze=["0"], entry=None, seed=0)
    trainable.prepare(model)
    assert trainable.parameters(model) == list(model[1].parameters())
    assert trainable.weights_key_map is None
    assert trainable.save_options() == {"trainable_only": False, "metadata": None}
    trainable.init_adapters(model)  # nothing to initialise
    assert trainable.lora_modules == []


@pytest.fixture
def one_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_train_family_step_terms_default_to_none_and_moe_adds_the_router_loss(one_process_group):
    from mmfsdp.model import StepTerms, get_model_entry
    from mmfsdp.model.router import RouterLoad, RouterStepTerms, load_balancing_loss

    loss_cfg = SimpleNamespace(router_aux_loss_coef=0.5)
    dense = get_model_entry("mistral3").step_terms(loss_cfg)
    assert type(dense) is StepTerms
    assert dense.loss(SimpleNamespace(), num_micro_batches=2) is None and dense.stats() == {}

    terms = get_model_entry("qwen3_vl_moe").step_terms(loss_cfg)
    assert isinstance(terms, RouterStepTerms)
    assert terms.loss(SimpleNamespace(), num_micro_batches=2) is None and terms.stats() == {}  # no router ran
    probs = torch.tensor([[3.0, 1.0, 0.0, 4.0], [2.0, 2.0, 2.0, 2.0]], requires_grad=True)
    loads = [RouterLoad(torch.tensor([[2.0, 1.0, 0.0, 3.0], [1.0, 2.0, 1.0, 2.0]]), probs, torch.tensor(3.0)),
             RouterLoad(torch.tensor([[0.0, 2.0, 2.0, 0.0], [4.0, 0.0, 0.0, 0.0]]), probs * 0.5, torch.tensor(2.0))]
    extra = [terms.loss(SimpleNamespace(router_load=load), num_micro_batches=2) for load in loads]
    aux = [load_balancing_loss(load) / 2 for load in loads]  # one process: the global counts are its own
    for got, want in zip(extra, aux):
        assert torch.equal(got, 0.5 * want)
    extra[0].backward()
    assert probs.grad is not None
    stats = terms.stats()
    assert set(stats) == {"aux_loss", "expert_load_max", "expert_load_mean"}
    assert torch.equal(stats["aux_loss"], aux[0].detach() + aux[1].detach())
    counts = loads[0].tokens_per_expert + loads[1].tokens_per_expert
    assert float(stats["expert_load_max"]) == float(counts.max()) == 5.0
    assert float(stats["expert_load_mean"]) == float(counts.mean())
