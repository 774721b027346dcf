"""LoRA under FSDP2: `training.lora`, PEFT's injection into the built model, and the adapters' initialisation.

The flow in the trainer (`mmfsdp.train.trainable.Trainable`, called from `Trainer._build_model`):

1. `apply_lora(model, lora_cfg, entry)` on the built model (CPU or meta): resolves `target_modules` (module
   patterns or leaf names) to `nn.Linear` modules, freezes every parameter of the model and lets PEFT's
   `inject_adapter_in_model` wrap each target in place. A wrapped `x` keeps its module path: it becomes a LoRA
   layer holding the original as `x.base_layer` plus `x.lora_A.default` (`[r, in]`) and `x.lora_B.default`
   (`[out, r]`), computing `base(h) + (alpha / r) · B(A(dropout(h)))`. The adapters are cast to fp32 (the
   base may be bf16); they are the only trainable parameters.
2. `entry.parallelize`: recompute, offload and FSDP patterns name the same modules as without LoRA, so they
   apply unchanged; each adapter is sharded with the FSDP2 group of the module it sits in. FSDP2 requires one
   dtype of the *trainable* parameters of a group only, so a frozen bf16 base and fp32 adapters share a group
   (with `param_dtype: bf16` both compute in bf16; gradients are reduced in `reduce_dtype`).
3. Materialise and load the base: weights files name the base layer `x.weight`, the model `x.base_layer.weight`
   (`mmfsdp.ckpt.lora.stored_key`, the `key_map` of `load_hf_weights` / `load_checkpoint`); adapters are not
   read from the base weights.
4. `init_lora_adapters(model, lora_cfg, seed)`, after `to_empty` on meta and for the eager build alike: every
   adapter is drawn whole on the CPU from one generator seeded with `training.seed`, in model order, and each
   rank copies its shard. So the adapters do not depend on the number of processes or the init path, and the
   global RNG (data order, dropout) is the same as without LoRA. With `init_lora_weights: true` B is zero, so
   the first forward is the base model's exactly.
5. `load_lora_adapter(model, path)` for `pretrained_lora_path`: a PEFT adapter directory (ours from
   `mm-convert LoraConverter dcp_to_peft`, or PEFT's `save_pretrained`) fills the adapters, each rank its shard.

The optimizer sees only the adapters, so gradients and AdamW state exist only for them; checkpoints are
trainable-only (adapters + optimizer, `mmfsdp.ckpt`), with `lora_metadata` recorded for the exports.

Context parallel and chunk loss need nothing: a LoRA layer acts per token, and `lm_head` (which receives the
loss function under chunk loss) is not a valid target.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from mmfsdp.config import ConfigError, get_logger

if TYPE_CHECKING:
    from mmfsdp.model.spec import ModelEntry

__all__ = [
    "LoraConfig",
    "apply_lora",
    "resolve_lora_targets",
    "init_lora_adapters",
    "lora_layers",
    "load_lora_adapter",
    "lora_metadata",
]

log = get_logger(__name__)

_KEY = "training.lora"


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    enable: bool = False
    """Train low-rank adapters on `target_modules` instead of the model: every other parameter is frozen, checkpoints hold the adapters and their optimizer state only (docs/model.md, LoRA)."""
    rank: int = 8
    """LoRA rank r: A is [r, in], B is [out, r]."""
    alpha: float = 16.0
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout)."""
    target_modules: list[str] = field(default_factory=list)
    """nn.Linear modules to adapt: module patterns ({*} and {a-b} allowed, e.g. model.language_model.layers.{*}.self_attn.q_proj), leaf names (q_proj: every module of that name) or presets (preset:<name>, e.g. preset:attention: the named lists the model family declares, `lora_presets` of its spec; docs/families.md lists them)."""
    init_lora_weights: bool | Literal["gaussian"] = True
    """true: A Kaiming-uniform, B zero (the first step is the base model's); gaussian: A normal with std 1/rank, B zero; false: A and B both random (tests)."""
    pretrained_lora_path: str | None = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start the adapters from; rank and alpha must match."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError("rank", f"must be an integer >= 1, got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ConfigError("alpha", f"must be a positive number, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.enable and not self.target_modules:
            raise ConfigError(
                "target_modules",
                "is empty; name the Linear layers to adapt, e.g. [q_proj, k_proj, v_proj, o_proj]"
                " or model.language_model.layers.{*}.self_attn.q_proj",
            )
        if self.pretrained_lora_path is not None and not self.pretrained_lora_path.strip():
            raise ConfigError("pretrained_lora_path", "is empty; give a PEFT adapter directory or leave it null")


PRESET_PREFIX = "preset:"


def _expand_presets(targets: list[str], key: str, entry: ModelEntry | None) -> list[tuple[str, str]]:
    """`(target, key item)` of every target, presets replaced by the names the family declares for them
    (`entry.lora_presets`), all under the preset's item."""
    presets = entry.lora_presets if entry is not None else {}
    out = []
    for i, target in enumerate(targets):
        item = f"{key}[{i}]"
        if not target.startswith(PRESET_PREFIX):
            out.append((target, item))
            continue
        name = target[len(PRESET_PREFIX) :]
        if name not in presets:
            family = f"model_id {entry.model_id!r}" if entry is not None else "this model"
            known = f"its presets: {', '.join(sorted(presets))}" if presets else "it declares none"
            raise ConfigError(item, f"{target!r} names no LoRA preset of {family}; {known}")
        out.extend((member, f"{item} ({target})") for member in presets[name])
    return out


def _is_leaf_name(target: str) -> bool:
    return "." not in target and "{" not in target


def resolve_lora_targets(
    model: nn.Module, targets: list[str], entry: ModelEntry | None = None, *, key: str = f"{_KEY}.target_modules"
) -> list[str]:
    """The full names of the modules `targets` name, in model order, each once.

    A target with a dot or braces is a module pattern (`mmfsdp.parallel.match_module_names`); a plain name
    (`q_proj`) matches every module whose last name part it is, as in PEFT; `preset:<name>` stands for the names
    the family's spec lists under that name (`entry.lora_presets[name]`), each of which must match. A target
    matching nothing, a matched module that is not an `nn.Linear`, or the model's `lm_head` is a `ConfigError`
    under `key[i]`.
    """
    from mmfsdp.parallel.patterns import match_module_names

    names = [name for name, _ in model.named_modules() if name]
    chosen: set[str] = set()
    for target, item in _expand_presets(targets, key, entry):
        if _is_leaf_name(target):
            found = [name for name in names if name.rsplit(".", 1)[-1] == target]
            if not found:
                leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
                close = difflib.get_close_matches(target, leaves, n=5, cutoff=0.5)
                hint = f"similar names: {', '.join(close)}" if close else f"leaf names include: {', '.join(leaves[:8])}"
                raise ConfigError(item, f"{target!r} is the name of no module of {type(model).__name__}; {hint}")
        else:
            try:
                found = match_module_names(model, [target], key=item)
            except ConfigError as err:
                raise ConfigError(item, err.message) from None
        lm_head = getattr(entry, "lm_head_name", "lm_head")
        for name in found:
            module = model.get_submodule(name)
            if name == lm_head:
                raise ConfigError(
                    item,
                    f"{target!r} matches {name}, the output projection; LoRA adapts layers inside the model, not lm_head",
                )
            if not isinstance(module, nn.Linear):
                raise ConfigError(
                    item,
                    f"{target!r} matches {name}, a {type(module).__name__}; LoRA wraps nn.Linear layers "
                    "(attention projections such as q_proj, k_proj, v_proj, o_proj)",
                )
        chosen.update(found)
    return [name for name in names if name in chosen]


def apply_lora(model: nn.Module, lora_cfg: LoraConfig, entry: ModelEntry | None = None) -> list[str]:
    """Freeze `model` and inject LoRA adapters (fp32) into the modules `lora_cfg.target_modules` names, in place,
    on the CPU or the meta device; return the wrapped module names. Run before `entry.parallelize`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    names = resolve_lora_targets(model, list(lora_cfg.target_modules), entry)
    for param in model.parameters():
        param.requires_grad_(False)
    on_meta = any(param.is_meta for param in model.parameters())
    peft_cfg = PeftLoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=names,
        bias="none",
        init_lora_weights=True,
    )
    # PEFT draws its own init; ours comes later (init_lora_adapters), so the global RNG stays as it was
    with torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(peft_cfg, model, low_cpu_mem_usage=on_meta)
    layers = lora_layers(model)
    if sorted(layers) != sorted(names):
        raise RuntimeError(f"PEFT wrapped {sorted(layers)[:5]}... instead of the {len(names)} target modules")
    for layer in layers.values():
        for part in (layer.lora_A, layer.lora_B):
            part.to(torch.float32)
            for param in part.parameters():
                param.requires_grad_(True)
    num = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "LoRA rank %d alpha %g on %d modules: %.3fM adapter parameters",
        lora_cfg.rank,
        lora_cfg.alpha,
        len(names),
        num / 1e6,
    )
    return names


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA layers of `model` by module name (modules with `base_layer`, `lora_A` and `lora_B`)."""
    return {
        name: module
        for name, module in model.named_modules()
        if hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")
    }


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into `param`, or into this rank's shard of a DTensor `param`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(param.dtype)
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def init_lora_adapters(model: nn.Module, lora_cfg: LoraConfig, seed: int) -> None:
    """Initialise every adapter per `init_lora_weights`, drawn whole on the CPU from a generator seeded with `seed`
    (the same values on any number of processes, eager or meta), each rank copying its shard."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lora_layers(model).values():
        for part, is_b in ((layer.lora_A, False), (layer.lora_B, True)):
            for adapter in part.values():
                weight = adapter.weight
                full = torch.empty(tuple(weight.shape), dtype=torch.float32)
                if is_b and lora_cfg.init_lora_weights is not False:
                    full.zero_()
                elif not is_b and lora_cfg.init_lora_weights == "gaussian":
                    full.normal_(0.0, 1.0 / lora_cfg.rank, generator=generator)
                else:  # PEFT's A init (and nn.Linear's default)
                    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                _copy_full(weight, full)


def load_lora_adapter(
    model: nn.Module, path: str, lora_cfg: LoraConfig, *, key: str = f"{_KEY}.pretrained_lora_path"
) -> None:
    """Fill the adapters of `model` from the PEFT adapter directory `path` (each rank its shard); rank and alpha
    must be `lora_cfg`'s and the adapted modules the same."""
    from mmfsdp.ckpt import CheckpointError, load_hf_weights
    from mmfsdp.ckpt.lora import PeftFileAdapter, is_adapter_key, read_peft_config

    try:
        config = read_peft_config(path)
    except CheckpointError as err:
        raise ConfigError(key, str(err)) from None
    if int(config.get("r", -1)) != lora_cfg.rank or float(config.get("lora_alpha", -1)) != lora_cfg.alpha:
        raise ConfigError(
            key,
            f"{path} has r={config.get('r')} lora_alpha={config.get('lora_alpha')}; training.lora has "
            f"rank={lora_cfg.rank} alpha={lora_cfg.alpha}: set them to the adapter's",
        )
    try:
        load_hf_weights(model, path, adapter=PeftFileAdapter(), key_map=lambda k: k if is_adapter_key(k) else None)
    except CheckpointError as err:
        raise ConfigError(
            key, f"{err} (training.lora.target_modules must name the modules the adapter was trained on)"
        ) from None
    log.info("loaded LoRA adapters from %s", path)


def lora_metadata(lora_cfg: LoraConfig, modules: list[str]) -> dict:
    """The adapter settings a LoRA checkpoint records (`mmfsdp.ckpt.lora.LORA_METADATA`), for the exports."""
    return {
        "r": lora_cfg.rank,
        "alpha": float(lora_cfg.alpha),
        "dropout": float(lora_cfg.dropout),
        "target_modules": list(modules),
    }
