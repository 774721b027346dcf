"""The trainer: the one place that knows the order of a run, and the training loop.

    config → mesh → model (meta or CPU) → Trainable.prepare (freeze, LoRA adapters) → entry.parallelize
           (checkpointing, then FSDP2) → materialise + load → Trainable.init_adapters → data → train loop
           → checkpoints → eval

The loop (`Trainer.train`) runs optimizer steps and calls its components at fixed points; each owns its
interval, state and files and decides for itself whether to act on a step (docs/architecture.md, "The
loop and its components"):

- `Profiling` (`mmfsdp.train.profiling`): torch.profiler trace and memory snapshot of chosen steps and ranks;
- `Metrics` (`mmfsdp.train.metrics`): which steps log, their timing and record, `metrics.jsonl` and the sinks,
  and the non-finite check;
- `Evaluator` (`mmfsdp.train.evaluate`): the validation loss every `val_interval` steps, the final accuracy;
- `Checkpointer` (`mmfsdp.train.checkpointer`): resume, the interval and final saves, the HF export;
- `LoopHeartbeat` (`mmfsdp.train.supervise`): the heartbeat's phases;
- `Trainable` (`mmfsdp.train.trainable`): what is trained and saved (frozen modules, LoRA adapters);
- the stage's objective (`training.stage`'s class in `mmfsdp.train.stages`, built from an `ObjectiveContext`): the
  step's loss and statistics, the models it holds beside the policy (DPO's reference), its held-out metrics;
- the family's `StepTerms` (`entry.step_terms`): extra loss terms and step statistics (a MoE's router loss).

One optimizer step (`train_step`) takes `gradient_accumulation_steps` micro-batches from the loader (none when the
objective trains this step on the batch it already holds: `Objective.needs_batch`). Before any
forward, the loss weights of every token of the step are computed from the labels of all its micro-batches,
with the normalisers reduced over the data-parallel group (`mmfsdp.model.compute_loss_weights`), so the summed
loss is the global-batch loss whatever the split into ranks and micro-batches; docs/parallelism.md explains the
`loss × world_size` backward and how context parallel shares the loss. The step's loss, gradient norm and counts
stay on the device (`mmfsdp.train.step`), as does the loss weights' normaliser (`default`, `per_token`): the host
reads them only on logging steps and before a save. The loss and the counts are summed over the ranks by
collectives that no one waits for until then (the normaliser's sum, which the forward needs, and the gradient
norm's, which clipping needs, are the step's only other small collectives).
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mmfsdp.ckpt import CheckpointError, generation_metadata, load_checkpoint, load_hf_weights
from mmfsdp.config import ConfigError, dump_yaml, get_logger
from mmfsdp.data import DataError, build_dataloader, build_dataset, build_processor
from mmfsdp.model import get_model_entry, model_inputs
from mmfsdp.model.flops import ForwardFlops
from mmfsdp.parallel import (
    DTYPES,
    build_parallel_dims,
    clip_grad_norm,
    detect_device_type,
    device_for_local_rank,
    enable_fault_stacks,
    freeze_startup_heap,
    init_process_group,
    use_deterministic,
)
from mmfsdp.parallel.cp import required_multiple
from mmfsdp.train.balance_meter import BalanceMeter
from mmfsdp.train.checkpointer import Checkpointer
from mmfsdp.train.config import Config, check_world, save_resolved
from mmfsdp.train.evaluate import Evaluator, media_kinds, to_device
from mmfsdp.train.metrics import Metrics, MetricsWriter
from mmfsdp.train.objective import ObjectiveContext
from mmfsdp.train.mfu import FlopMeter
from mmfsdp.train.profiling import Profiling
from mmfsdp.train.schedule import Scheduler
from mmfsdp.train.sinks import build_sinks
from mmfsdp.train.stages import objective_class
from mmfsdp.train.start import plan_start
from mmfsdp.train.step import NonFiniteLoss, StepResult, TrainingError
from mmfsdp.train.supervise import LoopHeartbeat
from mmfsdp.train.trainable import Trainable

__all__ = ["Trainer", "TrainingError", "StepResult", "build_optimizer", "start_rank", "run"]

log = get_logger("mmfsdp.train")

# FSDP2 warns when the root returns a view (HF slices logits with `logits_to_keep`); the loop never
# modifies model outputs in place, which is the case the warning is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")



def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_optimizer(model: torch.nn.Module, cfg, device_type: str) -> torch.optim.Optimizer:
    """AdamW over the trained parameters (`Trainable.parameters`), decay on matrices only: `ShardAdamW`, torch's
    AdamW applied to each DTensor's local shard (the same bits as DTensor's dispatch without its per-process
    sharding propagation over the whole parameter list), or `adamw_swap`: `SwapAdamW`, the same maths with
    host-resident moments; torch's fused kernel on every device (on the CPU about 4x faster than foreach for the
    same update: one pass over the parameters and states)."""
    decay, no_decay = [], []
    for param in Trainable.parameters(model):
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if not groups:
        raise ConfigError("model.freeze", "every parameter is frozen; nothing would be trained")
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    kwargs["fused"] = True
    if cfg.optimizer == "adamw_swap":
        from mmfsdp.parallel import SwapAdamW

        return SwapAdamW(groups, swap_times=cfg.swap_optimizer_times, **kwargs)
    from mmfsdp.parallel import ShardAdamW

    return ShardAdamW(groups, **kwargs)


class Trainer:
    def __init__(self, cfg: Config, device_type: str):
        """Build everything of one rank, after `start_rank` (deterministic algorithms, the process group)."""
        self.cfg = cfg
        self.device_type = device_type
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.plan = check_world(cfg, self.world_size)
        self.dims = build_parallel_dims(self.plan, device_type)
        self.device = device_for_local_rank(device_type)
        self.output_dir = Path(cfg.training.output_dir)
        if self.rank == 0:
            save_resolved(cfg, self.output_dir)
            log.info("resolved config:\n" + dump_yaml(cfg))
        seed_everything(cfg.training.seed)

        t = cfg.training
        self.entry = get_model_entry(cfg.model.model_id)
        self.trainable = Trainable(t.lora, freeze=cfg.model.freeze, entry=self.entry, seed=t.seed)
        self.start = plan_start(t, cfg.model)
        log.info(self.start.describe())
        self.model = self._build_model()
        self.trained_params = Trainable.parameters(self.model)
        """The trained parameters (FSDP2's sharded ones, fixed once the model is built): the gradient norm's."""
        self.optimizer = build_optimizer(self.model, t, device_type)
        self.scheduler = Scheduler(
            self.optimizer, lr=t.lr, lr_min=t.lr_min, total_steps=t.train_iters,
            warmup_ratio=t.lr_warmup_ratio, style=t.lr_decay_style,
        )
        self.processor = build_processor(cfg.data)
        self.train_dataset = build_dataset(cfg.data, self.processor, split="train")
        self.loader = self._build_loader()
        self.balance_meter = BalanceMeter(self.device)
        self.step = 0
        self.objective_state: dict[str, Any] | None = None
        """The resumed checkpoint's stage state of this rank (`ObjectiveContext.state`)."""
        self.heartbeat = LoopHeartbeat()
        self.evaluator = Evaluator(
            cfg, model=self.model, processor=self.processor, dims=self.dims, device=self.device,
            pad_multiple=self._pad_multiple(), output_dir=self.output_dir, rank=self.rank, heartbeat=self.heartbeat,
            data=objective_class(t.stage).eval_data(cfg.data),
        )
        # the vision placeholder runs only for the kinds of media the data holds (no video pass without videos);
        # a dataset that cannot say (a user's own type) keeps every kind
        kinds = [media_kinds(self.train_dataset), self.evaluator.media_kinds()]
        if hasattr(self.model, "set_media_kinds") and None not in kinds:
            self.model.set_media_kinds(frozenset().union(*kinds))
        self.checkpointer = Checkpointer(
            t, hf_source=cfg.model.model_name_or_path, model=self.model, optimizer=self.optimizer, state=self,
            trainable=self.trainable, heartbeat=self.heartbeat, rank=self.rank,
            export_metadata=generation_metadata(
                self.train_dataset.encoder.stop_token_ids(), self.processor.pad_token_id,
            ),
        )
        if self.start.resume is not None:
            self.step = self.checkpointer.resume(self.start.resume)
        self.objective = self._build_objective()
        self.evaluator.objective_metrics = self.objective.eval_metrics()
        self.evaluator.stage_validation = self.objective.validation_metrics
        self.flop_meter = FlopMeter(
            self.entry.costs, self.model.config, device=self.device, world_size=self.world_size,
            dtype=DTYPES[cfg.parallel.fsdp_plan.param_dtype or cfg.model.dtype], recompute=cfg.parallel.recompute,
            peak_tflops=cfg.tools.peak_tflops,
        )
        self.metrics = Metrics(
            log_interval=t.log_interval, total_steps=t.train_iters, flop_meter=self.flop_meter, device=self.device,
            writer=MetricsWriter(self.output_dir, t.train_iters, start_step=self.step, sinks=self._sinks()),
            validates=self.evaluator.should_validate, meters=[self.balance_meter],
        )
        self.checkpointer.before_save = self.metrics.check
        self.profiling = Profiling(
            cfg.tools, model=self.model, optimizer=self.optimizer, device_type=device_type, rank=self.rank,
            output_dir=self.output_dir, start_step=self.step,
        )

    @property
    def history(self) -> list[StepResult]:
        """This run's steps, in order (settled up to the last logging step; all of them after `train`)."""
        return self.metrics.history

    @property
    def val_losses(self) -> dict[int, float]:
        """Validation loss by step (`training.val_interval`)."""
        return self.evaluator.val_losses

    # -- build -------------------------------------------------------------------------------
    def _sinks(self) -> list:
        """Rank 0's metrics sinks (`tools.report_to`), opened where the run starts."""
        tools = self.cfg.tools
        if self.rank != 0 or not tools.report_to:
            return []
        return build_sinks(
            tools.report_to, output_dir=self.output_dir, start_step=self.step, config=self.cfg,
            tensorboard_dir=tools.tensorboard_dir, wandb_dir=tools.wandb_dir, wandb_project=tools.wandb_project,
            run_name=tools.run_name,
        )

    def _build_loader(self):
        t = self.cfg.training
        data, budget = objective_class(t.stage).loader_plan(self.cfg)
        return build_dataloader(
            self.train_dataset, data,
            micro_batch_size=t.micro_batch_size, dp_rank=self.dims.dp_rank, dp_size=self.dims.dp_size,
            seed=t.seed, pad_to_multiple_of=self._pad_multiple(),
            sample_multiple=required_multiple(self.plan.ring, self.plan.ulysses),
            gradient_accumulation_steps=t.gradient_accumulation_steps, micro_batch_tokens=budget,
        )

    def _build_objective(self):
        """The objective of `training.stage` (`mmfsdp.train.stages`), with the models it holds beside the policy."""
        return objective_class(self.cfg.training.stage).build(ObjectiveContext(
            cfg=self.cfg, dims=self.dims, device=self.device, rank=self.rank, output_dir=self.output_dir,
            step=self.step, model=self.model, train_dataset=self.train_dataset, evaluator=self.evaluator,
            frozen_copy=self._frozen_copy, train_collator=self.loader.collator, fresh_loader=self._build_loader,
            to_device=self._to_device, state=self.objective_state,
            draw_step=lambda: self.loader.next_step(self.cfg.training.gradient_accumulation_steps),
        ))

    def _frozen_copy(self) -> torch.nn.Module:
        """A frozen copy of the initial model, sharded like the policy: the same build, seed and initial weights
        (the RNG is re-seeded for its build and restored after, so the run's data order and dropout do not change)."""
        states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
        seed_everything(self.cfg.training.seed)
        model = self._build_model(frozen=True)
        if hasattr(self.model, "media_input_keys"):  # the same placeholder passes as the policy's
            model.media_input_keys = self.model.media_input_keys
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        return model

    def _pad_multiple(self) -> int:
        configured = self.cfg.data.dataloader_param.collate_param.pad_to_multiple_of
        needed = required_multiple(self.plan.ring, self.plan.ulysses)
        return math.lcm(configured, needed)

    def _build_model(self, *, frozen: bool = False) -> torch.nn.Module:
        """The policy (trained parameters, LoRA adapters), or with `frozen` a frozen copy of its initial state."""
        cfg = self.cfg
        on_meta = cfg.training.init_model_with_meta_device
        dtype = DTYPES[cfg.model.dtype]
        if on_meta and self.start.weights == "random":
            raise ConfigError(
                "training.init_model_with_meta_device",
                "a meta-device build needs weights to load (training.load, or safetensors in model.model_name_or_path); "
                "random_init builds on the CPU: set init_model_with_meta_device: false",
            )
        # Weights that come from elsewhere are not read twice: the eager build is then random.
        model_cfg = cfg.model if self.start.weights == "pretrained" else replace(cfg.model, random_init=True)
        model = self.entry.build(model_cfg, cfg.features, device="meta" if on_meta else "cpu", dtype=dtype)
        if frozen:
            model.requires_grad_(False)
        else:
            self.trainable.prepare(model)
        self.entry.parallelize(model, cfg.parallel, self.dims, cfg.features)
        if on_meta:
            model.to_empty(device=self.device)
            self.entry.init_non_persistent_buffers(model)
        else:
            model.to(self.device)
        self._load_initial_weights(model, sharded_empty=on_meta, key_map=None if frozen else "trainable")
        if not frozen:
            self.trainable.init_adapters(model)
        if self.dims.cp_size > 1:
            model.enable_context_parallel(self.dims, vision_dp=cfg.parallel.vision_dp)
        model.train()
        if frozen:
            return model
        num_params = sum(p.numel() for p in model.parameters())
        num_trainable = sum(p.numel() for p in self.trainable.parameters(model))
        log.info(f"model {cfg.model.model_id}: {num_params / 1e6:.2f}M parameters, {num_trainable / 1e6:.2f}M trainable")
        return model

    def _load_initial_weights(self, model: torch.nn.Module, *, sharded_empty: bool, key_map: Any = "trainable") -> None:
        """Fill the sharded model from the plan's initial weights; a resumed run is then filled by the checkpointer."""
        start = self.start
        if key_map == "trainable":
            key_map = self.trainable.weights_key_map
        if start.weights == "hf" or (start.weights == "pretrained" and sharded_empty):
            load_hf_weights(model, start.source, key_map=key_map)
            log.info(f"loaded HF weights from {start.source} into the sharded model")
        elif start.weights == "release":
            load_checkpoint(start.source, model=model, optimizer=None, load_optim=False, load_rng=False, key_map=key_map)

    # -- the run's own state (saved with each checkpoint) -------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, scheduler and the loader position without this rank's own counters: the same on every rank."""
        loader = dict(self.loader.state_dict())
        loader.pop("runtime_bad", None)
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "loader": loader}

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's data position and its stage's state between steps (`Objective.state_dict`)."""
        return {"loader": self.loader.state_dict(), "objective": self.objective.state_dict()}

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        self.step = int(state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        if rank_state is not None:
            self.loader.load_state_dict(rank_state["loader"])
            self.objective_state = rank_state.get("objective")
        else:
            # Different world size: keep the global sample offset of the epoch (see docs/checkpoints.md).
            self.loader.load_state_dict(state["loader"])

    # -- train -------------------------------------------------------------------------------
    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return to_device(batch, self.device)

    def train(self) -> None:
        """The loop: steps until `training.train_iters`, each component called at its fixed point."""
        if self.step >= self.cfg.training.train_iters:
            log.info(f"nothing to train: resumed at step {self.step} of {self.cfg.training.train_iters}")
        elif self.step == 0 and self.cfg.training.eval_on_start:
            with self.heartbeat.paused("the evaluation on start", 0):
                self.evaluator.report(0, file_name="eval_start.json")
        try:
            with self.profiling:
                while self.step < self.cfg.training.train_iters:
                    step = self.step + 1
                    with self.profiling.step(step), self.metrics.timed(step):
                        result = self.train_step()
                    self.step = step
                    self.heartbeat.step_done(step)
                    val_loss = self.evaluator.validate(step)
                    self.metrics.step_done(result, val_loss=val_loss, val_stats=self.evaluator.val_stats.get(step))
                    self.checkpointer.save(step)
            self.checkpointer.save(self.step, last=True)
        except NonFiniteLoss as err:
            self.step = err.last_finite_step
            raise

    def train_step(self) -> StepResult:
        """One optimizer step; its numbers stay on the device (`StepResult.pending`)."""
        t = self.cfg.training
        step = self.step + 1
        drawn = self.loader.next_step(t.gradient_accumulation_steps) if self.objective.needs_batch() else []
        micro_batches = self.objective.start_step(drawn)
        terms = self.entry.step_terms(self.cfg.features.loss_cfg)
        local_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        num_tokens = 0
        passes_started = time.perf_counter()
        flops = ForwardFlops()
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            self.heartbeat.micro_batch(step, i + 1, len(micro_batches))
            self.model.set_requires_gradient_sync(i == last)
            inputs = self._to_device(model_inputs(mb))
            out, share = self.objective.micro_batch(self.model, i, inputs)
            extra = terms.loss(out, num_micro_batches=len(micro_batches))
            loss = share if extra is None else share + extra
            (loss * self.world_size).backward()
            local_loss += share.detach().float()
            num_tokens += int(mb["attention_mask"].sum())
            flops = flops + self.flop_meter.count(mb)
        self.balance_meter.observe(micro_batches, time.perf_counter() - passes_started, self.loader.current_step_plan)
        grad_norm = clip_grad_norm(self.trained_params, t.clip_grad)
        # The loss and the tokens and FLOPs of the data-parallel group (a CP group holds one batch, counted once)
        # are summed in the background: only a logging step or a save waits for them (`settle`). Two collectives,
        # not one: the loss is fp32 and the counts int64 (FLOPs pass 2^53, which a float64 would round).
        counts = torch.tensor([num_tokens, flops.layers, flops.other], dtype=torch.int64, device=self.device)
        reductions = [dist.all_reduce(local_loss, async_op=True),
                      dist.all_reduce(counts, group=self.dims.dp_group, async_op=True)]
        objective_stats, objective_reductions = self.objective.stats()
        stats = {**terms.stats(), **objective_stats}
        reductions += objective_reductions
        lr = self.scheduler.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return StepResult.on_device(step, lr, loss=local_loss, grad_norm=grad_norm, counts=counts, stats=stats,
                                    reductions=reductions)

    def close(self) -> None:
        self.checkpointer.close()
        self.metrics.close()


_LOST_PEER_MARKS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
                    "Socket Timeout", "connection refused", "ProcessGroupNCCL's watchdog")


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is a collective that failed because another rank or its host went away."""
    text = str(err)
    return isinstance(err, getattr(dist, "DistNetworkError", ())) or any(mark.lower() in text.lower() for mark in _LOST_PEER_MARKS)


def _close_objective(trainer: Trainer | None) -> None:
    """On the way out after an error: the objective releases what it holds outside the processes (no orphan server);
    a failure there is logged, never hides the error being reported."""
    objective = getattr(trainer, "objective", None)
    if objective is not None:
        try:
            objective.close()
        except Exception as err:  # noqa: BLE001
            log.warning(f"closing the stage's objective after an error failed: {_first_line(err)}")


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__


def set_intra_op_threads() -> int:
    """Apply `OMP_NUM_THREADS` (the launcher sets 1 per rank, as torchrun does; a user's value wins) to torch's
    intra-op thread pool, which reads the variable only when torch loads: a rank forked from the launcher, or a
    process that imported torch before the variable was set, would otherwise keep one thread per core in every
    rank (on a 2-core host, 2 ranks x 2 threads competing for 2 cores). Returns the threads in use."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0 and torch.get_num_threads() != int(value):
        torch.set_num_threads(int(value))
    return torch.get_num_threads()


def start_rank(cfg: Config) -> str:
    """This rank's device type, with deterministic algorithms when `training.deterministic` asks (before the
    process group: HCCL reads its switch when it starts) and the process group joined (an existing one is kept);
    torch's intra-op threads as `OMP_NUM_THREADS` says (`set_intra_op_threads`). What the rank has imported so far
    is moved out of the garbage collector's sight (`freeze_startup_heap`). A rank that dies on a signal prints
    every thread's Python stack into the launcher's log first (`enable_fault_stacks`)."""
    enable_fault_stacks()
    freeze_startup_heap()
    log.info("torch intra-op threads per rank: %d (OMP_NUM_THREADS=%s)", set_intra_op_threads(),
             os.environ.get("OMP_NUM_THREADS", "unset"))
    device_type = detect_device_type()
    if cfg.training.deterministic:
        use_deterministic(device_type)
    init_process_group(device_type, timeout_s=cfg.parallel.collective_timeout_s)
    return device_type


def run(cfg: Config) -> int:
    """Body of one rank: process group, save lock, heartbeat, train, evaluate, close. Returns the exit code."""
    from mmfsdp.train import supervise

    device_type = start_rank(cfg)
    rank = dist.get_rank()
    supervise.start_heartbeat(cfg.parallel.heartbeat_timeout_s, rank=rank, output_dir=cfg.training.output_dir)
    trainer = None
    try:
        supervise.lock_save_dir_for_job(cfg.training.save)
        trainer = Trainer(cfg, device_type)
        trainer.train()
        trainer.heartbeat.pause("the final evaluation")
        trainer.close()
        trainer.evaluator.report(trainer.step)
        trainer.objective.close()
    except (TrainingError, ConfigError, CheckpointError, DataError) as err:
        # Exit at once: torch's launcher ends the other ranks instead of leaving them in a collective.
        # Only the first rank to fail prints, so an error every rank hits is printed once.
        supervise.report_once(f"error: {err}", rank=rank)
        _close_objective(trainer)
        os._exit(1)
    except Exception as err:
        _close_objective(trainer)
        if not lost_peer(err):
            raise
        # Another rank or node is gone (killed, crashed, its host lost): every surviving rank's collective
        # fails at once; one line for the job instead of a traceback per rank.
        supervise.report_once(
            f"error: lost contact with another rank ({_first_line(err)}); the job stops. The first failing rank's "
            "output (or the heartbeat line) says why; restart with the same command to resume from the last checkpoint",
            rank=rank,
        )
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()
    return 0
