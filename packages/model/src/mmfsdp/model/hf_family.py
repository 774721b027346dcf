"""`HFFamilyEntry`: the build, checks and meta-init every HF `*ForConditionalGeneration` family shares.

A family module declares a subclass (a `mmfsdp.model.spec.ModelEntry`) with `config_class`, `model_class` (a
`TrainingForwardMixin` subclass of the HF class) and its default plans (its
checkpoint names and layouts are its state-dict adapter's, `mmfsdp.model.adapters`);
`build` then follows one set of rules for all families:
- on the meta device, or with `model.random_init`, only `config.json` is read
  (and must describe `config_class`) and the model is built from it;
- otherwise the model is built from `config.json` on the meta device,
  materialised on the target device and filled from the safetensors weights of
  `model.model_name_or_path` by `mmfsdp.ckpt.load_hf_weights` through the
  family's state-dict adapter (`state_dict_adapter()`) — the same reader as a meta-device run, so both
  read a checkpoint alike (transformers' own conversions guess some layouts
  from shapes: the hub's transposed MoE `down_proj` `[E, I, H]` is taken as it
  is when I == H). A key that does not fit is a `ConfigError`, never a silent
  random init;
- the attention backend is `model.attn_implementation` resolved for the device,
  and chunk loss is switched on from `features`.
After a meta build and `to_empty`, `init_non_persistent_buffers` recomputes the
rotary `inv_freq` buffers of the text and vision towers (`mmfsdp.model.meta_init`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from mmfsdp.ckpt import CheckpointError, load_hf_weights
from mmfsdp.config import ConfigError
from mmfsdp.model.attention import resolve_attention_backend
from mmfsdp.model.config import FeaturesConfig, ModelConfig
from mmfsdp.model.meta_init import init_rotary_buffers
from mmfsdp.model.spec import ModelEntry
from mmfsdp.parallel.cp import validate_ulysses_heads
from mmfsdp.parallel.device import detect_device_type
from mmfsdp.parallel.expert_parallel import check_expert_parallel_size
from mmfsdp.parallel.dtypes import DTYPES

if TYPE_CHECKING:
    from mmfsdp.parallel import MeshPlan

__all__ = ["HFFamilyEntry", "safetensors_problem", "model_dir"]


class HFFamilyEntry(ModelEntry):
    """A model family whose `model_class` is an HF `PreTrainedModel` (with the training forward)."""

    def build(
        self,
        model_cfg: ModelConfig,
        features_cfg: FeaturesConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """Build on `device`: "meta" reads only config.json; otherwise load safetensors weights (or random ones)."""
        features_cfg = FeaturesConfig() if features_cfg is None else features_cfg
        device = torch.device(device)
        dtype = DTYPES[model_cfg.dtype] if dtype is None else dtype
        path = model_dir(model_cfg)
        backend = resolve_attention_backend(model_cfg.attn_implementation, detect_device_type())
        config = self.read_config(model_cfg)
        pretrained = device.type != "meta" and not model_cfg.random_init
        if pretrained and (problem := safetensors_problem(path)) is not None:
            raise ConfigError("model.model_name_or_path", f"{problem}; give a directory with the weights, or set model.random_init: true")
        with torch.device("meta" if pretrained else device):
            model = self.model_class._from_config(config, attn_implementation=backend.hf_name, dtype=dtype)
        if pretrained:
            model.to_empty(device=device)
            self.init_non_persistent_buffers(model)
            try:
                load_hf_weights(model, path, adapter=self.state_dict_adapter())
            except CheckpointError as err:
                message = f"{err}\nCheck the checkpoint, or use random_init"
                raise ConfigError("model.model_name_or_path", message) from None
        model.set_chunk_loss(features_cfg.chunkloss_plan.chunk_size if features_cfg.enable_chunk_loss else None)
        return model

    def read_config(self, model_cfg: ModelConfig) -> PretrainedConfig:
        """The config of the model class from the config.json of `model.model_name_or_path` (`model_config`); a
        `ConfigError` unless it describes `config_class`."""
        path = model_dir(model_cfg)
        config = self.model_config(AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code))
        if not isinstance(config, self.config_class):
            raise ConfigError(
                "model.model_name_or_path",
                f"{path}/config.json describes model_type {getattr(config, 'model_type', '?')!r}, not "
                f"{self.config_class.model_type!r}; set model.model_id to the matching family",
            )
        return config

    def model_config(self, config: PretrainedConfig) -> PretrainedConfig:
        """The config the model class takes, from a directory's `config.json`: itself by default; a family that
        trains one part of a composite model takes that part's (Qwen3-Omni: the thinker of the full config)."""
        return config

    def validate_parallel(self, model_cfg: ModelConfig, plan: MeshPlan) -> None:
        """Checks against config.json: expert parallel (a MoE model whose experts it divides); context parallel
        (Ulysses size vs. heads, no sliding window)."""
        super().validate_parallel(model_cfg, plan)
        if plan.cp == 1 and plan.ep == 1:
            return
        config = self.read_config(model_cfg)
        if plan.ep > 1:
            check_expert_parallel_size(self.num_experts(config), plan.ep)
        if plan.cp == 1:
            return
        text = config.text_config
        validate_ulysses_heads(text.num_attention_heads, text.num_key_value_heads, plan.ulysses)
        if getattr(text, "sliding_window", None) is not None:
            raise ConfigError(
                "model.model_name_or_path",
                f"text_config.sliding_window is {text.sliding_window}, but context parallel computes full causal attention; "
                "use a model without a sliding window or set ring_attention_size and ulysses_parallel_size to 1",
            )

    def init_non_persistent_buffers(self, model: nn.Module) -> None:
        """After `to_empty`: recompute the text and vision rotary `inv_freq` buffers."""
        init_rotary_buffers(model)


def safetensors_problem(path: str | Path) -> str | None:
    """None when HF directory `path` holds its safetensors weights (one file, an index and every shard it
    names, or `*.safetensors`); else what is missing, in words."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{index} is not a valid safetensors index ({type(e).__name__})"
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            return f"{path} is missing {len(missing)} of the {len(shards)} shards its index names (first: {missing[0]})"
        return None
    if (path / "model.safetensors").is_file() or any(path.glob("*.safetensors")):
        return None
    found = "a .bin/.pt checkpoint (only safetensors are loaded)" if any(path.glob("*.bin")) or any(path.glob("*.pt")) else "no weight files"
    return f"{path} has config.json but no safetensors weights (model.safetensors or model.safetensors.index.json): found {found}"


def model_dir(model_cfg: ModelConfig) -> str:
    """`model.model_name_or_path`, which must be a local directory holding config.json."""
    path = model_cfg.model_name_or_path
    if path is None:
        raise ConfigError("model.model_name_or_path", "is required: the directory holding config.json (and the weights unless random_init)")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError("model.model_name_or_path", f"{path!r} has no config.json (downloads are not done here; give a local directory)")
    return path
