"""`--check`: the checkpoints a run would load fit the model it would build — from metadata, before any rank starts.

`plan_start` (the trainer's own rule, `mmfsdp.train.start`) says what the run
loads; `checkpoint_check` compares each of those checkpoints with the model
built on the meta device, through `mmfsdp.ckpt.match` (DCP `.metadata`,
safetensors headers; never tensor data):

- resuming a whole checkpoint (`training.save`, or a DCP `training.load`): its
  `model.*` entries against the model's state dict (optimizer entries are not
  the model's and are not compared);
- resuming an adapter-only checkpoint (`training.lora`): its entries against the
  LoRA-wrapped model's trainable parameters and buffers (with `model.freeze`),
  and the frozen base against the initial weights below;
- initial weights: a DCP `release` (`training.load`), an HF directory
  (`training.load` with `load_format: hf`, or `model.model_name_or_path`) read
  through the family's state-dict adapter (HF names, transposed or per-expert
  MoE tensors); under `training.lora` the base layers by their stored names
  (`mmfsdp.ckpt.lora.stored_key`);
- `training.lora.pretrained_lora_path` (a PEFT adapter directory, loaded at
  every start): its adapters against the LoRA model's.

Sharded saves (FSDP2, expert parallel) store global shapes, so the unsharded
meta model is the reference whatever the parallel layout. Each checkpoint that
does not fit is one summary line, then one line per missing key, unexpected key
and shape mismatch (the first `MAX_LINES`, then a count of the rest), all under
the config key that named the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from mmfsdp.config import ConfigError

__all__ = ["MAX_LINES", "checkpoint_check"]

MAX_LINES = 20
"""Problem lines shown per checkpoint; the rest are counted."""


def checkpoint_check(cfg, plan, entry, model) -> list[ConfigError]:
    """Problems of the checkpoints `plan` (a `StartPlan`) loads into `model` (family `entry`, on meta).

    Under `training.lora` `model` is wrapped here (`apply_lora`, `model.freeze`), as the trainer does.
    """
    from mmfsdp.ckpt.lora import stored_key
    from mmfsdp.ckpt.match import check_dcp, check_hf, expected_shapes

    t = cfg.training
    key_map = None
    if t.lora.enable:
        from mmfsdp.model import apply_lora, freeze_modules

        try:
            apply_lora(model, t.lora, entry)
            if cfg.model.freeze:
                freeze_modules(model, cfg.model.freeze)
        except ConfigError:
            return []  # the LoRA targets or freeze patterns are reported by the pattern checks
        key_map = stored_key
    errors: list[ConfigError] = []
    if plan.resume is not None:
        key = "training.save" if _under(plan.resume.path, t.save) else "training.load"
        adapter_only = plan.weights != "checkpoint"
        shapes, aliases = expected_shapes(model, trainable_only=adapter_only)
        what = "adapter-only checkpoint (training.lora)" if adapter_only else "checkpoint"
        hint = _LORA_HINT if adapter_only else _MODEL_HINT
        errors += _report(key, f"the {what} {plan.resume.path} the run resumes from",
                          lambda: check_dcp(plan.resume.path, shapes, aliases), cfg, hint)
    if plan.weights in ("release", "hf", "pretrained"):
        key = "model.model_name_or_path" if plan.weights == "pretrained" else "training.load"
        shapes, aliases = expected_shapes(model, key_map=key_map)
        if plan.weights == "release":
            errors += _report(key, f"the released weights {plan.source}",
                              lambda: check_dcp(plan.source, shapes, aliases), cfg, _MODEL_HINT)
        else:
            errors += _report(key, f"the HF weights {plan.source}",
                              lambda: check_hf(plan.source, shapes, aliases), cfg, _MODEL_HINT)
    if t.lora.enable and t.lora.pretrained_lora_path:
        errors += _peft_adapter(t.lora.pretrained_lora_path, model, cfg)
    return errors


def _peft_adapter(path: str, model, cfg) -> list[ConfigError]:
    """`training.lora.pretrained_lora_path`: its adapters against the LoRA model's (every start loads them)."""
    from mmfsdp.ckpt import CheckpointError
    from mmfsdp.ckpt.lora import PeftFileAdapter, is_adapter_key, read_peft_config
    from mmfsdp.ckpt.match import check_hf, expected_shapes

    try:
        read_peft_config(path)
    except CheckpointError:
        return []  # not an adapter directory: reported by the pattern checks
    shapes, aliases = expected_shapes(model, key_map=lambda key: key if is_adapter_key(key) else None)
    return _report("training.lora.pretrained_lora_path", f"the PEFT adapter {path}",
                   lambda: check_hf(path, shapes, aliases, adapter=PeftFileAdapter()), cfg, _PEFT_HINT)


def _under(path: Path, directory: str | None) -> bool:
    return directory is not None and Path(directory).resolve() in Path(path).resolve().parents


_MODEL_HINT = ("it holds another model: point at a checkpoint of this model, or set model.model_name_or_path to the "
               "model it was saved from")
_LORA_HINT = ("its run trained other adapters: use that run's training.lora (rank, target_modules) and model.freeze, "
              "or start a new training.save")

_PEFT_HINT = "it adapts other modules or another rank: set training.lora.target_modules and rank to the adapter's"


def _report(key: str, what: str, compare, cfg, hint: str) -> list[ConfigError]:
    from mmfsdp.ckpt import CheckpointError

    try:
        report = compare()
    except CheckpointError as err:
        return [ConfigError(key, f"{what} cannot be compared with the model: {err}")]
    if report.ok:
        return []
    summary = ConfigError(key, (
        f"{what} does not fit model {cfg.model.model_id} of {cfg.model.model_name_or_path} ({report.counts()}); {hint}"
    ))
    return [summary] + [ConfigError(key, line) for line in report.lines(MAX_LINES)]
