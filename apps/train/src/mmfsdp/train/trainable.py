"""What is trained and what is saved (`Trainable`): frozen modules (`model.freeze`) and LoRA adapters
(`training.lora`, `mmfsdp.model.lora`).

The trainer asks it at four points and has no LoRA branch of its own:

1. `prepare(model)` on the built, unsharded model: inject the adapters (freezing the base), freeze `model.freeze`.
2. `weights_key_map` when the initial weights are loaded: a LoRA model's base layers are `x.base_layer.*` where
   the weights files say `x.*` (`mmfsdp.ckpt.lora.stored_key`); adapters are not read from them.
3. `init_adapters(model)` after loading: the adapters drawn from `training.seed`, then `pretrained_lora_path`.
4. `parameters(model)` (what the optimizer holds and gradient clipping sees: the parameters that require grad),
   and `save_options()` for each checkpoint: with LoRA adapter-only (`trainable_only`) with the adapter settings in
   its metadata; the frozen base is the run's initial weights, loaded again on every start (`mmfsdp.train.start`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from mmfsdp.ckpt.lora import LORA_METADATA, stored_key
from mmfsdp.model import apply_lora, freeze_modules, init_lora_adapters, load_lora_adapter, lora_metadata

if TYPE_CHECKING:
    from mmfsdp.model import LoraConfig, ModelEntry

__all__ = ["Trainable"]


class Trainable:
    """The trained parameters of one run (module docstring)."""

    def __init__(self, lora_cfg: LoraConfig, *, freeze: list[str] | None, entry: ModelEntry, seed: int):
        self.lora_cfg = lora_cfg
        self.freeze = freeze
        self.entry = entry
        self.seed = seed
        self.lora_modules: list[str] = []
        """The modules that received adapters (after `prepare`)."""

    @property
    def lora(self) -> bool:
        return bool(self.lora_cfg.enable)

    def prepare(self, model: torch.nn.Module) -> None:
        """Adapters and frozen modules, on the built model before it is parallelised."""
        if self.lora:
            self.lora_modules = apply_lora(model, self.lora_cfg, self.entry)
        if self.freeze:
            freeze_modules(model, self.freeze)

    @property
    def weights_key_map(self) -> Callable[[str], str | None] | None:
        """The `key_map` of the initial weights' loaders (None: the model's keys are the files' keys)."""
        return stored_key if self.lora else None

    def init_adapters(self, model: torch.nn.Module) -> None:
        """The adapters' initial values, after the weights are loaded (nothing without LoRA)."""
        if not self.lora:
            return
        init_lora_adapters(model, self.lora_cfg, seed=self.seed)
        if self.lora_cfg.pretrained_lora_path:
            load_lora_adapter(model, self.lora_cfg.pretrained_lora_path, self.lora_cfg)

    @staticmethod
    def parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters that are trained (the optimizer's, the gradient norm's)."""
        return [p for p in model.parameters() if p.requires_grad]

    def save_options(self) -> dict[str, Any]:
        """`save_checkpoint` keywords: with LoRA the adapters and their optimizer state only, and their settings."""
        if not self.lora:
            return {"trainable_only": False, "metadata": None}
        return {"trainable_only": True, "metadata": {LORA_METADATA: lora_metadata(self.lora_cfg, self.lora_modules)}}
