"""The trainer: the one place that knows the order of a run.

    config → mesh → model (meta or CPU) → [LoRA: freeze, inject adapters] → entry.parallelize
           (checkpointing, then FSDP2) → materialise + load → [LoRA: init adapters] → data → train loop
           → checkpoints → eval

With `training.lora` the optimizer holds only the adapters and checkpoints are
adapter-only (`mmfsdp.model.lora`); the frozen base is loaded from the initial
weights on every start, resumed or not (`mmfsdp.train.start`).

One optimizer step takes `gradient_accumulation_steps` micro-batches from the
loader. Before any forward, the loss weights of every token of the step are
computed from the labels of all its micro-batches, with the normalisers reduced
over the data-parallel group (`mmfsdp.model.compute_loss_weights`), so the
summed loss is the global-batch loss whatever the split into ranks and
micro-batches. FSDP2 averages gradients over its shard group, so each
micro-batch's backward uses `loss × world_size` to turn that average into the
sum of the per-rank contributions. Under context parallel every rank of a CP
group sees the same batch; the model splits the sequence after the vision tower
and each rank's loss is its shard's part of the same weighted sum (summed over
all ranks for the log; no CP all-reduce inside the model). The loader pads rows,
and with packing every packed sample, to `required_multiple(ring, ulysses)`.

Around the steps: every `val_interval` steps the validation loss (`Evaluator.validation_loss`),
a torch.profiler trace and a memory snapshot (`tools.memory_profile`, `MemorySnapshot`) of
chosen steps on chosen ranks, and with `save_format: hf` an HF export of each checkpoint. Each logged step's
record (with the step's FLOPs, MFU and TFLOP/s from `FlopMeter`) goes to `metrics.jsonl` and to the sinks of
`tools.report_to` (TensorBoard, W&B) through the `MetricsWriter`.
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mmfsdp.ckpt import (
    CheckpointError, export_checkpoint_hf, finalize_pending, load_checkpoint, load_hf_weights, save_checkpoint,
)
from mmfsdp.ckpt.lora import LORA_METADATA, stored_key
from mmfsdp.config import ConfigError, dump_yaml, get_logger
from mmfsdp.data import DataError, build_dataloader, build_dataset, build_processor
from mmfsdp.model import (
    apply_lora, compute_loss_weights, expert_load_summary, freeze_modules, get_model_entry, init_lora_adapters,
    load_balancing_loss, load_lora_adapter, lora_metadata, model_inputs, shift_labels,
)
from mmfsdp.model.flops import ForwardFlops
from mmfsdp.parallel import (
    build_parallel_dims,
    clip_grad_norm,
    detect_device_type,
    device_for_local_rank,
    init_process_group,
    peak_memory_gb,
    reset_peak_memory,
    use_deterministic,
)
from mmfsdp.parallel.cp import required_multiple
from mmfsdp.train.balance_meter import BalanceMeter
from mmfsdp.train.config import Config, check_world, save_resolved
from mmfsdp.train.evaluate import Evaluator, to_device
from mmfsdp.train.metrics import MetricsWriter
from mmfsdp.train.mfu import FlopMeter
from mmfsdp.train.schedule import Scheduler
from mmfsdp.train.sinks import build_sinks
from mmfsdp.train.supervise import beat, pause
from mmfsdp.train.start import plan_start

log = get_logger("mmfsdp.train")

# FSDP2 warns when the root returns a view (HF slices logits with `logits_to_keep`); the loop never
# modifies model outputs in place, which is the case the warning is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite loss, unusable checkpoint); the message says why and what to do."""


@dataclass(slots=True)
class StepResult:
    loss: float
    """The LM loss of the global batch (the router aux loss is not in it)."""
    grad_norm: float
    num_tokens: int
    flops: ForwardFlops = ForwardFlops()
    """Forward FLOPs of the step's global batch (`mmfsdp.model.flops`; MFU from it)."""
    aux_loss: float | None = None
    """MoE families: the router load-balancing loss of the global batch (mean over micro-batches), unscaled."""
    expert_load: dict[str, float] | None = None
    """MoE families: max and mean top-k assignments per expert and layer, over the step's global batch."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_optimizer(model: torch.nn.Module, cfg, device_type: str) -> torch.optim.Optimizer:
    """AdamW (or `adamw_swap`: `mmfsdp.parallel.SwapAdamW`, the same maths with host-resident moments);
    decay on matrices only; fused on CUDA/NPU, foreach on the CPU."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if not groups:
        raise ConfigError("model.freeze", "every parameter is frozen; nothing would be trained")
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
    if device_type in ("cuda", "npu"):
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    if cfg.optimizer == "adamw_swap":
        from mmfsdp.parallel import SwapAdamW

        return SwapAdamW(groups, swap_times=cfg.swap_optimizer_times, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


class Trainer:
    def __init__(self, cfg: Config, device_type: str):
        self.cfg = cfg
        self.device_type = device_type
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.plan = check_world(cfg, self.world_size)
        self.dims = build_parallel_dims(self.plan, device_type)
        self.device = device_for_local_rank(device_type)
        if cfg.training.deterministic:
            use_deterministic(device_type)
        self.output_dir = Path(cfg.training.output_dir)
        if self.rank == 0:
            save_resolved(cfg, self.output_dir)
            log.info("resolved config:\n" + dump_yaml(cfg))
        seed_everything(cfg.training.seed)

        self.entry = get_model_entry(cfg.model.model_id)
        self.lora_modules: list[str] = []
        self.start = plan_start(cfg.training, cfg.model)
        log.info(self.start.describe())
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, cfg.training, device_type)
        t = cfg.training
        self.scheduler = Scheduler(
            self.optimizer, lr=t.lr, lr_min=t.lr_min, total_steps=t.train_iters,
            warmup_ratio=t.lr_warmup_ratio, style=t.lr_decay_style,
        )
        self.processor = build_processor(cfg.data)
        self.train_dataset = build_dataset(cfg.data, self.processor, split="train")
        self.loader = build_dataloader(
            self.train_dataset, cfg.data,
            micro_batch_size=t.micro_batch_size, dp_rank=self.dims.dp_rank, dp_size=self.dims.dp_size,
            seed=t.seed, pad_to_multiple_of=self._pad_multiple(),
            sample_multiple=required_multiple(self.plan.ring, self.plan.ulysses),
            gradient_accumulation_steps=t.gradient_accumulation_steps, micro_batch_tokens=t.micro_batch_tokens,
        )
        self.balance_meter = BalanceMeter(self.device)
        self.step = 0
        self.history: list[StepResult] = []
        self.val_losses: dict[int, float] = {}
        """Validation loss by step (`training.val_interval`)."""
        self.evaluator = Evaluator(
            cfg, model=self.model, processor=self.processor, dims=self.dims, device=self.device,
            pad_multiple=self._pad_multiple(), output_dir=self.output_dir, rank=self.rank,
        )
        self._resume()
        self.flop_meter = FlopMeter(
            self.entry, self.model.config, device=self.device, world_size=self.world_size,
            dtype=_DTYPES[cfg.parallel.fsdp_plan.param_dtype or cfg.model.dtype], recompute=cfg.parallel.recompute,
            peak_tflops=cfg.tools.peak_tflops,
        )
        self.metrics = MetricsWriter(self.output_dir, t.train_iters, start_step=self.step, sinks=self._sinks())

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

    def _pad_multiple(self) -> int:
        configured = self.cfg.data.dataloader_param.collate_param.pad_to_multiple_of
        needed = required_multiple(self.plan.ring, self.plan.ulysses)
        return math.lcm(configured, needed)

    def _build_model(self) -> torch.nn.Module:
        cfg = self.cfg
        on_meta = cfg.training.init_model_with_meta_device
        dtype = _DTYPES[cfg.model.dtype]
        if on_meta and self.start.weights == "random":
            raise ConfigError(
                "training.init_model_with_meta_device",
                "a meta-device build needs weights to load (training.load, or safetensors in model.model_name_or_path); "
                "random_init builds on the CPU: set init_model_with_meta_device: false",
            )
        # Weights that come from elsewhere are not read twice: the eager build is then random.
        model_cfg = cfg.model if self.start.weights == "pretrained" else replace(cfg.model, random_init=True)
        model = self.entry.build(model_cfg, cfg.features, device="meta" if on_meta else "cpu", dtype=dtype)
        lora = cfg.training.lora
        if lora.enable:
            self.lora_modules = apply_lora(model, lora, self.entry)
        if cfg.model.freeze:
            freeze_modules(model, cfg.model.freeze)
        self.entry.parallelize(model, cfg.parallel, self.dims, cfg.features)
        if on_meta:
            model.to_empty(device=self.device)
            self.entry.init_non_persistent_buffers(model)
        else:
            model.to(self.device)
        self._load_initial_weights(model, sharded_empty=on_meta)
        if lora.enable:
            init_lora_adapters(model, lora, seed=cfg.training.seed)
            if lora.pretrained_lora_path:
                load_lora_adapter(model, lora.pretrained_lora_path, lora)
        if self.dims.cp_size > 1:
            model.enable_context_parallel(self.dims, vision_dp=cfg.parallel.vision_dp)
        model.train()
        num_params = sum(p.numel() for p in model.parameters())
        num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info(f"model {cfg.model.model_id}: {num_params / 1e6:.2f}M parameters, {num_trainable / 1e6:.2f}M trainable")
        return model

    def _load_initial_weights(self, model: torch.nn.Module, *, sharded_empty: bool) -> None:
        """Fill the sharded model from the plan's initial weights; a resumed run is filled by `_resume`."""
        start = self.start
        # a LoRA model's base layers are `x.base_layer.*` where the weights say `x.*`; adapters are initialised later
        key_map = stored_key if self.cfg.training.lora.enable else None
        if start.weights == "hf" or (start.weights == "pretrained" and sharded_empty):
            load_hf_weights(model, start.source, key_map=key_map)
            log.info(f"loaded HF weights from {start.source} into the sharded model")
        elif start.weights == "release":
            load_checkpoint(start.source, model=model, optimizer=None, load_optim=False, load_rng=False, key_map=key_map)

    def _resume(self) -> None:
        point = self.start.resume
        if point is None:
            return
        t = self.cfg.training
        loaded = load_checkpoint(
            point.path, model=self.model, optimizer=None if t.no_load_optim else self.optimizer,
            load_optim=not t.no_load_optim, load_rng=not t.no_load_rng,
        )
        self.step = int(loaded.app_state["step"])
        self.scheduler.load_state_dict(loaded.app_state["scheduler"])
        if loaded.rank_state is not None:
            self.loader.load_state_dict(loaded.rank_state["loader"])
        else:
            # Different world size: keep the global sample offset of the epoch (see docs/checkpoints.md).
            self.loader.load_state_dict(loaded.app_state["loader"])
        log.info(f"resumed from {loaded.path} at step {self.step}")

    # -- train -------------------------------------------------------------------------------
    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return to_device(batch, self.device)

    def train_step(self) -> StepResult:
        t = self.cfg.training
        micro_batches = self.loader.next_step(t.gradient_accumulation_steps)
        targets = [shift_labels(mb["labels"], mb.get("cu_seq_lens")) for mb in micro_batches]
        weights = compute_loss_weights(
            targets, loss_type=self.cfg.features.loss_cfg.loss_type,
            cu_seq_lens=[mb.get("cu_seq_lens") for mb in micro_batches],
            group=self.dims.dp_group, num_micro_batches=len(micro_batches),
        )
        passes_started = time.perf_counter()
        local_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        local_aux: torch.Tensor | None = None
        expert_counts: torch.Tensor | None = None
        num_tokens = 0
        flops = ForwardFlops()
        last = len(micro_batches) - 1
        for i, (mb, target, weight) in enumerate(zip(micro_batches, targets, weights)):
            beat(f"step {self.step + 1} micro-batch {i + 1}/{len(micro_batches)}")
            self.model.set_requires_gradient_sync(i == last)
            inputs = self._to_device(model_inputs(mb))
            out = self.model(**inputs, shift_labels=target.to(self.device), loss_weights=weight.to(self.device))
            loss = out.loss
            router = self._router_share(getattr(out, "router_load", None), len(micro_batches))
            if router is not None:
                aux_share, counts = router
                loss = loss + self.cfg.features.loss_cfg.router_aux_loss_coef * aux_share
                local_aux = aux_share.detach() if local_aux is None else local_aux + aux_share.detach()
                expert_counts = counts if expert_counts is None else expert_counts + counts
            (loss * self.world_size).backward()
            local_loss += out.loss.detach().float()
            num_tokens += int(mb["attention_mask"].sum())
            flops = flops + self.flop_meter.count(mb)
        self.balance_meter.observe(micro_batches, time.perf_counter() - passes_started, self.loader.current_step_plan)
        grad_norm = clip_grad_norm([p for p in self.model.parameters() if p.requires_grad], t.clip_grad)
        dist.all_reduce(local_loss)
        # tokens and FLOPs of the data-parallel group in one all-reduce (a CP group holds one batch, counted once)
        counts = torch.tensor([num_tokens, flops.layers, flops.other], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, group=self.dims.dp_group)
        num_tokens, layers, other = counts.tolist()
        result = StepResult(loss=local_loss.item(), grad_norm=float(grad_norm), num_tokens=num_tokens,
                            flops=ForwardFlops(layers, other))
        if local_aux is not None:
            dist.all_reduce(local_aux)
            result.aux_loss = float(local_aux)
            result.expert_load = expert_load_summary(expert_counts)
        return result

    def _router_share(self, load, num_micro_batches: int):
        """This rank's share of a MoE micro-batch's load-balancing loss (divided by the number of micro-batches),
        and the micro-batch's expert counts `[L, E]` summed over every rank; None for a dense model.

        Every rank routes its own tokens (data and context parallel alike), so the counts and the token count
        are summed over the whole world; the shares then add up to the aux loss of the micro-batch's global
        batch (`mmfsdp.model.router`) and take the same `× world_size` backward as the LM loss.
        """
        if load is None:
            return None
        counts = load.tokens_per_expert.detach().clone()
        tokens = load.num_tokens.detach().clone().float()
        dist.all_reduce(counts)
        dist.all_reduce(tokens)
        share = load_balancing_loss(load, tokens_per_expert=counts.sum(0), num_tokens=tokens)
        return share / num_micro_batches, counts

    def train(self) -> None:
        t = self.cfg.training
        last_finite: tuple[int, float] | None = None
        if self.step >= t.train_iters:
            log.info(f"nothing to train: resumed at step {self.step} of {t.train_iters}")
        profiler = self._profiler()
        snapshot = self._memory_snapshot()
        recording = False
        mp = self.cfg.tools.memory_profile
        while self.step < t.train_iters:
            if snapshot is not None and not recording and mp.start_step <= self.step + 1 <= mp.end_step:
                from mmfsdp.parallel.tensor_memory import state_tensors

                snapshot.start(state_tensors(self.model, self.optimizer))
                recording = True
            reset_peak_memory(self.device)
            started = time.perf_counter()
            result = self.train_step()
            if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
                self.optimizer.zero_grad(set_to_none=True)
                last = f"last finite loss {last_finite[1]:.6f} at step {last_finite[0]}" if last_finite else "no finite loss yet"
                raise TrainingError(
                    f"loss {result.loss} / grad norm {result.grad_norm} is not finite at step {self.step + 1} ({last}); "
                    "lower training.lr, check the data, or resume from the last checkpoint"
                )
            lr = self.scheduler.lr
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            beat(f"step {self.step + 1}", arm=True)
            self.history.append(result)
            last_finite = (self.step, result.loss)
            step_time = time.perf_counter() - started
            if profiler is not None:
                profiler.step()
            if recording:
                snapshot.step_done(self.step)
                if self.step == mp.end_step:
                    path = snapshot.dump(self._snapshot_path(snapshot.suffix))
                    log.info(f"memory snapshot of steps {mp.start_step}-{mp.end_step} written to {path}")
                    snapshot = None
                    recording = False
            val_loss = self._validate() if t.val_interval and self.step % t.val_interval == 0 else None
            if self.step % t.log_interval == 0 or self.step == t.train_iters or val_loss is not None:
                self.metrics.log_step({
                    "step": self.step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
                    "num_tokens": result.num_tokens, "tokens_per_s": result.num_tokens / step_time,
                    "step_time_s": step_time, "peak_mem_gb": peak_memory_gb(self.device),
                    **self.flop_meter.scalars(result.flops, step_time),
                    **self._router_metrics(result), **self.balance_meter.scalars(),
                    **({"val_loss": val_loss} if val_loss is not None else {}),
                })
            if t.save and t.save_interval and self.step % t.save_interval == 0:
                self.save()
        if profiler is not None:
            profiler.stop()
        if t.save and (not t.save_interval or self.step % t.save_interval != 0):
            self.save()

    @staticmethod
    def _router_metrics(result: StepResult) -> dict[str, float]:
        if result.aux_loss is None:
            return {}
        return {"aux_loss": result.aux_loss, "expert_load_max": result.expert_load["max"],
                "expert_load_mean": result.expert_load["mean"]}

    def _validate(self) -> float:
        """The validation loss now (collective); kept in `val_losses`."""
        pause(f"validation at step {self.step}")
        loss = self.evaluator.validation_loss()
        self.val_losses[self.step] = loss
        beat(f"step {self.step + 1}", arm=True)
        return loss

    def _profiler(self):
        p = self.cfg.tools.profile
        if not p.enable or (p.ranks is not None and self.rank not in p.ranks):
            return None
        out = p.output_dir or str(self.output_dir / "profile")
        activities = [torch.profiler.ProfilerActivity.CPU] if p.with_cpu or self.device_type != "cuda" else []
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=max(p.start_step - 1 - self.step, 0), warmup=0, active=p.end_step - p.start_step + 1, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(out, worker_name=f"rank{self.rank}"),
            record_shapes=p.record_shapes, profile_memory=p.with_memory, with_stack=p.with_stack,
        )
        prof.start()
        return prof

    def _memory_snapshot(self):
        """A `MemorySnapshot` when this rank records one (`tools.memory_profile`), else None."""
        mp = self.cfg.tools.memory_profile
        if not mp.enable or self.rank not in mp.dump_ranks or self.step >= mp.end_step:
            return None
        from mmfsdp.parallel.memory_snapshot import MemorySnapshot

        return MemorySnapshot(self.device_type, stacks=mp.stacks, max_entries=mp.max_entries)

    def _snapshot_path(self, suffix: str) -> Path:
        mp = self.cfg.tools.memory_profile
        out = Path(mp.save_path) if mp.save_path else self.output_dir / "memory_snapshot"
        return out / f"snapshot_rank{self.rank}_steps{mp.start_step}-{mp.end_step}{suffix}"

    def save(self) -> None:
        t = self.cfg.training
        pause(f"saving the checkpoint of step {self.step}")
        save_checkpoint(
            t.save, self.step, model=self.model, optimizer=None if t.no_save_optim else self.optimizer,
            app_state={"step": self.step, "scheduler": self.scheduler.state_dict(), "loader": self._global_loader_state()},
            rank_state={"loader": self.loader.state_dict()},
            async_save=t.save_async, keep_last=t.save_total_limit,
            # LoRA: adapters and their optimizer state only; the frozen base is the run's initial weights
            trainable_only=t.lora.enable,
            metadata={LORA_METADATA: lora_metadata(t.lora, self.lora_modules)} if t.lora.enable else None,
        )
        log.info(f"saved checkpoint at step {self.step} under {t.save}")
        if t.save_format == "hf":
            self._export_hf()
        beat(f"step {self.step + 1}", arm=True)

    def _export_hf(self) -> None:
        """The checkpoint just saved, as an HF directory (rank 0 converts the published DCP files; an async
        save is waited for first)."""
        finalize_pending()
        if self.rank == 0:
            out = export_checkpoint_hf(self.cfg.training.save, self.step, self.cfg.model.model_name_or_path)
            log.info(f"exported step {self.step} as HF safetensors to {out}")
        dist.barrier()

    def _global_loader_state(self) -> dict[str, Any]:
        """The loader position without this rank's own counters: the same on every rank."""
        state = dict(self.loader.state_dict())
        state.pop("runtime_bad", None)
        return state

    def close(self) -> None:
        from mmfsdp.ckpt import finalize_pending

        finalize_pending()
        self.metrics.close()


_LOST_PEER_MARKS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
                    "Socket Timeout", "connection refused", "ProcessGroupNCCL's watchdog")


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is a collective that failed because another rank or its host went away."""
    text = str(err)
    return isinstance(err, getattr(dist, "DistNetworkError", ())) or any(mark.lower() in text.lower() for mark in _LOST_PEER_MARKS)


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__


def run(cfg: Config) -> int:
    """Body of one rank: process group, save lock, heartbeat, train, evaluate, close. Returns the exit code."""
    from mmfsdp.train import supervise

    device_type = detect_device_type()
    if cfg.training.deterministic:
        use_deterministic(device_type)  # before the process group: HCCL reads its switch when it starts
    init_process_group(device_type, timeout_s=cfg.parallel.collective_timeout_s)
    rank = dist.get_rank()
    supervise.start_heartbeat(cfg.parallel.heartbeat_timeout_s, rank=rank, output_dir=cfg.training.output_dir)
    trainer = None
    try:
        supervise.lock_save_dir_for_job(cfg.training.save)
        trainer = Trainer(cfg, device_type)
        trainer.train()
        pause("the final evaluation")
        trainer.close()
        trainer.evaluator.report(trainer.step)
    except (TrainingError, ConfigError, CheckpointError, DataError) as err:
        # Exit at once: torch's launcher ends the other ranks instead of leaving them in a collective.
        # Only the first rank to fail prints, so an error every rank hits is printed once.
        supervise.report_once(f"error: {err}", rank=rank)
        os._exit(1)
    except Exception as err:
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
