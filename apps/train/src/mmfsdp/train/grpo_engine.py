"""The GRPO stage's rollout engine, from `training.grpo.rollout` (docs/rl.md, "Rollout engines"), and what it costs.

- `hf`: `HFRolloutEngine` on the live policy; its KV cache is a term of the memory plan (`kv_cache_term`).
- `vllm`: `StageVLLMEngine`, a `VLLMRolloutEngine` whose server failures stop the run with one line
  (`TrainingError`). With `rollout.vllm.launch`, rank 0 starts the server on an HF directory of the run's starting
  weights: the `training.load` directory when `load_format: hf` and nothing is resumed, else `rollout_start_hf/`
  under the output directory, written from the loaded (or resumed) policy at start (`write_start_export`: one
  tensor whole at a time, every rank in the collectives, rank 0 writes). The first step's sync replaces those
  weights anyway; the directory gives the server its config, processor and a first model to build. Otherwise the
  server at `rollout.vllm.url` is used (its key from `$VLLM_SERVER_AUTHKEY`). The objective's `close` stops a
  launched server at the end of the run, also when the run stops on an error; should the trainer die without it,
  the server exits by itself (`--parent-pid`). A server that cannot start is an error on every rank together.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mmfsdp.ckpt import get_state_dict_adapter
from mmfsdp.model.rollout import HFRolloutEngine, RolloutRequest
from mmfsdp.model.vllm_rollout import VLLMRolloutEngine, VLLMServerError, launch_vllm_server, write_start_export
from mmfsdp.parallel.dtypes import DTYPES
from mmfsdp.train.objective import MemoryTerm
from mmfsdp.train.step import TrainingError

__all__ = ["StageVLLMEngine", "build_rollout_engine", "kv_cache_term", "prompt_request", "sync_stats"]

START_EXPORT = "rollout_start_hf"
"""The HF directory of the starting weights a launched server loads, under the output directory."""


class StageVLLMEngine(VLLMRolloutEngine):
    """A `VLLMRolloutEngine` whose server failures are the run's `TrainingError`: every rank stops with one line."""

    def sync_weights(self, model: torch.nn.Module, version: int) -> None:
        try:
            super().sync_weights(model, version)
        except VLLMServerError as e:
            raise TrainingError(f"rollout.engine vllm: {e}") from None

    def generate(self, requests, sampling, step: int):
        try:
            return super().generate(requests, sampling, step)
        except VLLMServerError as e:
            raise TrainingError(f"rollout.engine vllm: {e}") from None


def prompt_request(item: dict[str, Any], media: dict[str, torch.Tensor], num_generations: int = 1) -> RolloutRequest:
    """The rollout request of a `PromptDataset` item: its ids, its media as the family collator makes them (for the
    hf engine) and its image files' bytes (for an engine in another process, which processes them itself)."""
    return RolloutRequest(prompt_index=item["prompt_index"], prompt_ids=item["input_ids"].tolist(),
                          num_generations=num_generations, media=media,
                          images=tuple(Path(path).read_bytes() for path in item.get("image_paths", ())))


def build_rollout_engine(ctx, media_token_ids: frozenset[int]) -> Any:
    """The engine of `training.grpo.rollout.engine` for the policy of `ctx` (an `ObjectiveContext`)."""
    rollout = ctx.cfg.training.grpo.rollout
    if rollout.engine == "hf":
        return HFRolloutEngine(ctx.model, pad_token_id=ctx.train_dataset.processor.pad_token_id,
                               gather_weights=rollout.gather_weights)
    v, adapter = rollout.vllm, get_state_dict_adapter(ctx.cfg.model.model_id)
    process, address, authkey, error = None, v.url, None, None
    if v.launch:
        model_dir = _start_dir(ctx, adapter)
        if ctx.rank == 0:
            try:
                process, address, authkey = launch_vllm_server(
                    v.python, str(model_dir), architecture=(adapter.architectures or (None,))[0],
                    dtype=str(next(ctx.model.parameters()).dtype).removeprefix("torch."),
                    max_model_len=_max_model_len(ctx.cfg), seed=ctx.cfg.training.seed,
                    startup_timeout_s=v.startup_timeout_s, log_path=Path(ctx.output_dir) / "vllm_server.log")
            except VLLMServerError as e:
                error = str(e)
    elif ctx.rank == 0:
        authkey = bytes.fromhex(os.environ.get("VLLM_SERVER_AUTHKEY", ""))
    engine = None
    if error is None and ctx.rank == 0:
        try:
            engine = StageVLLMEngine(address, authkey, adapter=adapter, media_token_ids=media_token_ids,
                                     process=process, timeout_s=v.request_timeout_s)
        except VLLMServerError as e:
            error = str(e)
            if process is not None:
                process.kill()
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise TrainingError(f"rollout.engine vllm: {error}")
    if engine is None:  # the other ranks: they talk to the server through rank 0
        engine = StageVLLMEngine(None, None, adapter=adapter, media_token_ids=media_token_ids,
                                 timeout_s=v.request_timeout_s)
    return engine


def sync_stats(engine, seconds: float, device: torch.device) -> dict[str, torch.Tensor]:
    """`time/sync_s` (rank 0's: the ranks sync in lockstep) and, for an engine that copies the weights (vllm),
    `rollout/sync_mb` and `rollout/sync_gbps`: the bytes it sent (after the first sync, the groups that can have
    changed) and over those seconds; 0 on a step that did not sync."""
    stats = {"time/sync_s": torch.tensor(seconds, device=device)}
    last = getattr(engine, "last_sync", None)
    if last is not None:
        stats["rollout/sync_mb"] = torch.tensor(last.get("bytes", 0.0) / 1e6 if seconds else 0.0, device=device)
        stats["rollout/sync_gbps"] = torch.tensor(last.get("gbps", 0.0) if seconds else 0.0, device=device)
    return stats


def _start_dir(ctx, adapter) -> Path:
    """The HF directory the launched server starts from (module docstring)."""
    t = ctx.cfg.training
    if t.load and t.load_format == "hf" and ctx.step == 0:
        return Path(t.load)
    out = Path(ctx.output_dir) / START_EXPORT
    write_start_export(ctx.model, adapter, Path(ctx.cfg.model.model_name_or_path), out)
    return out


def _max_model_len(cfg) -> int:
    return cfg.data.dataset_param.preprocess_parameters.cutoff_len + cfg.training.grpo.max_completion_length


def kv_cache_term(cfg, model: torch.nn.Module) -> list[MemoryTerm]:
    """The hf engine's cache while it generates (none for vllm: its cache is in the server's process): every prompt
    of the rank's step at once, each row repeated per generation, up to prompt + completion tokens; attention
    layers keep K and V per token, linear-attention (Gated DeltaNet) layers a fixed recurrent and convolution state
    per row (fp32)."""
    t, text = cfg.training, model.config.text_config
    if t.grpo.rollout.engine != "hf":
        return []
    rows = t.micro_batch_size * t.gradient_accumulation_steps * t.grpo.num_generations
    tokens = _max_model_len(cfg)
    compute = DTYPES[cfg.parallel.fsdp_plan.param_dtype or cfg.model.dtype].itemsize
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    attention, linear = kinds.count("full_attention"), kinds.count("linear_attention")
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    per_token = 2 * attention * getattr(text, "num_key_value_heads", heads) * head_dim * compute
    per_row = 0
    if linear:
        key_dim = text.linear_num_key_heads * text.linear_key_head_dim
        value_dim = text.linear_num_value_heads * text.linear_value_head_dim
        state = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
        conv = (2 * key_dim + value_dim) * text.linear_conv_kernel_dim * compute
        per_row = linear * (state + conv)
    size = rows * (tokens * per_token + per_row)
    rounds = (f"; dynamic sampling: up to {1 + t.grpo.max_resample_rounds} rounds a step, one at a time"
              if t.grpo.dynamic_sampling else "")
    return [MemoryTerm("kv_cache", "rollout KV cache", size,
                       f"{rows} rows x {tokens} tokens, {attention} attention + {linear} linear layers{rounds}",
                       phase="generation")]
