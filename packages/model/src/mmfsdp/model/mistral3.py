"""Magistral / Mistral-Small-3.x (HF `Mistral3ForConditionalGeneration`) as model id `mistral3`.

`Mistral3ForConditionalGenerationFSDP` subclasses the HF model — we wrap, we
don't fork. It adds three things:
- `lm_head` gets the `ChunkLossLinear` class (same parameters; called with one
  argument it is the same `nn.Linear`), so under chunk loss it can receive the
  loss function and return the loss;
- the vision tower gets the per-image attention hook (`mmfsdp.model.vision`);
- `forward` accepts the training keywords `shift_labels`, `loss_weights`,
  `cu_seq_lens`, `max_length`.

`forward` without `loss_weights` is the upstream HF forward, unchanged
(`cu_seq_lens` / `max_length`, if given, become the HF varlen keywords).
With `loss_weights` (the training contract) the output's `.loss` is
`Σ_t loss_weights[t] · CE(logits[t], shift_labels[t])` in fp32 over all local
tokens: without chunk loss the HF forward computes the logits and
`weighted_cross_entropy` the loss; with chunk loss the HF decoder stops at the
final hidden states and `lm_head` computes the loss chunk by chunk
(`mmfsdp.model.chunk_loss`), and the output has no logits.
With `cu_seq_lens` the attention mask is not used: the cumulative lengths
alone say which tokens attend to which.
After `enable_context_parallel(parallel_dims)` the training forward runs the
decoder and the loss on this rank's shard of the sequence and returns the
shard's loss sum (`mmfsdp.model.context_parallel`).
"""

from __future__ import annotations

import json

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, Mistral3Config, Mistral3ForConditionalGeneration
from transformers.modeling_outputs import CausalLMOutputWithPast

from mmfsdp.config import ConfigError
from mmfsdp.model.attention import resolve_attention_backend
from mmfsdp.model.chunk_loss import LinearCrossEntropy, use_chunk_loss_head
from mmfsdp.model.config import FeaturesConfig, ModelConfig
from mmfsdp.model.context_parallel import ContextParallel
from mmfsdp.model.loss import weighted_cross_entropy
from mmfsdp.model.meta_init import init_rotary_buffers
from mmfsdp.model.registry import ModelEntry, register_model
from mmfsdp.model.vision import install_per_image_attention
from mmfsdp.parallel.cp import validate_ulysses_heads
from mmfsdp.parallel.device import detect_device_type

__all__ = ["Mistral3ForConditionalGenerationFSDP", "Mistral3Entry", "packed_attention_kwargs", "DTYPES"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def packed_attention_kwargs(cu_seq_lens: torch.Tensor, max_length: int | torch.Tensor | None) -> dict[str, Any]:
    """The HF varlen keywords for packed sequences over the flattened `B·S` tokens."""
    cu_seq_lens = cu_seq_lens.reshape(-1).to(torch.int32)
    if max_length is None:
        max_length = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    max_length = int(max_length)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": max_length, "max_length_k": max_length}


class _Uncast:
    """Carries a tensor past FSDP2's input casting, which only looks into tensors and standard containers."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class Mistral3ForConditionalGenerationFSDP(Mistral3ForConditionalGeneration):
    """HF `Mistral3ForConditionalGeneration` plus the training forward, chunk loss and per-image vision attention."""

    def __init__(self, config: Mistral3Config):
        super().__init__(config)
        use_chunk_loss_head(self.lm_head)
        install_per_image_attention(self.model.vision_tower)
        self.chunk_loss_size: int | None = None
        self._context_parallel: ContextParallel | None = None

    def enable_context_parallel(self, parallel_dims: Any) -> None:
        """Split the decoder's sequence over `parallel_dims`' CP group in the training forward (`mmfsdp.model.context_parallel`)."""
        self._context_parallel = ContextParallel(self.model.language_model, parallel_dims)

    def set_chunk_loss(self, chunk_size: int | None) -> None:
        """Compute the training loss inside `lm_head`, `chunk_size` tokens at a time (None: plain logits + CE)."""
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_loss_size = chunk_size

    def __call__(self, *args: Any, loss_weights: torch.Tensor | None = None, **kwargs: Any):
        # FSDP2's root pre-forward hook casts every floating tensor argument to its param_dtype;
        # the loss weights must reach the loss in fp32, so they pass the hooks in an opaque holder.
        if loss_weights is not None:
            kwargs["loss_weights"] = _Uncast(loss_weights)
        return super().__call__(*args, **kwargs)

    def forward(
        self,
        *args: Any,
        shift_labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        cu_seq_lens: torch.Tensor | None = None,
        max_length: int | torch.Tensor | None = None,
        **kwargs: Any,
    ):
        if isinstance(loss_weights, _Uncast):
            loss_weights = loss_weights.tensor
        if cu_seq_lens is not None:
            if len(args) > 2:
                raise TypeError("with cu_seq_lens pass the inputs by keyword (the attention mask is replaced)")
            kwargs.update(packed_attention_kwargs(cu_seq_lens, max_length))
            kwargs["attention_mask"] = None
        if loss_weights is None:
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            return super().forward(*args, **kwargs)
        if args:
            raise TypeError("the training forward (with loss_weights) takes its inputs by keyword")
        if shift_labels is None:
            raise ValueError("loss_weights needs shift_labels (the next-token target of every position)")
        if kwargs.get("labels") is not None:
            raise ValueError("pass either labels (HF loss) or shift_labels + loss_weights (weighted loss), not both")
        kwargs.pop("labels", None)
        kwargs.setdefault("use_cache", False)
        split_decoder = contextlib.nullcontext()
        if self._context_parallel is not None:
            split_decoder, shift_labels, loss_weights = self._context_parallel.split_batch(kwargs, shift_labels, loss_weights, cu_seq_lens)
        with split_decoder:
            if self.chunk_loss_size is None:
                outputs = super().forward(**kwargs)
                outputs.loss = weighted_cross_entropy(outputs.logits, shift_labels, loss_weights)
                return outputs
            kwargs.pop("logits_to_keep", None)
            outputs = self.model(**kwargs)
        loss_function = LinearCrossEntropy(shift_labels, loss_weights, self.chunk_loss_size)
        loss = self.lm_head(outputs.last_hidden_state, loss_function=loss_function)
        return CausalLMOutputWithPast(loss=loss)


@register_model("mistral3")
class Mistral3Entry(ModelEntry):
    """Pixtral vision tower + patch-merging projector + Mistral decoder."""

    model_class = Mistral3ForConditionalGenerationFSDP
    fsdp_modules = (
        "model.vision_tower.transformer.layers.{*}",
        "model.multi_modal_projector",
        "model.language_model.embed_tokens",
        "model.language_model.layers.{*}",
        "lm_head",
    )
    recompute_modules = ("model.vision_tower.transformer.layers.{*}", "model.language_model.layers.{*}")
    vision_modules = ("model.vision_tower", "model.multi_modal_projector")
    lm_head_name = "lm_head"
    hf_key_map = (
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^language_model\.model\.", "model.language_model."),
        (r"^vision_tower\.", "model.vision_tower."),
        (r"^multi_modal_projector\.", "model.multi_modal_projector."),
    )

    def build(
        self,
        model_cfg: ModelConfig,
        features_cfg: FeaturesConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> Mistral3ForConditionalGenerationFSDP:
        """Build on `device`: "meta" reads only config.json; otherwise load safetensors weights (or random ones)."""
        features_cfg = FeaturesConfig() if features_cfg is None else features_cfg
        device = torch.device(device)
        dtype = DTYPES[model_cfg.dtype] if dtype is None else dtype
        path = _model_dir(model_cfg)
        backend = resolve_attention_backend(model_cfg.attn_implementation, detect_device_type())
        if device.type == "meta" or model_cfg.random_init:
            config = _read_config(model_cfg)
            with torch.device(device):
                model = self.model_class._from_config(config, attn_implementation=backend.hf_name, dtype=dtype)
        else:
            problem = safetensors_problem(path)
            if problem is not None:
                raise ConfigError("model.model_name_or_path", f"{problem}; give a directory with the weights, or set model.random_init: true")
            model, info = self.model_class.from_pretrained(
                path,
                dtype=dtype,
                attn_implementation=backend.hf_name,
                use_safetensors=True,
                trust_remote_code=model_cfg.trust_remote_code,
                # transformers applies its own renames only to its own classes; this subclass passes them explicitly
                key_mapping=dict(self.hf_key_map),
                output_loading_info=True,
            )
            _check_loading_info(path, info)
            model.to(device)
        model.set_chunk_loss(features_cfg.chunkloss_plan.chunk_size if features_cfg.enable_chunk_loss else None)
        return model

    def validate_parallel(self, model_cfg: ModelConfig, plan: Any) -> None:
        """Context-parallel checks against config.json: Ulysses size vs. heads, no sliding window."""
        if plan.cp == 1:
            return
        text = _read_config(model_cfg).text_config
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

    def tiny_config(self, *, vocab_size: int = 256, image_token_index: int = 10, **overrides: Any) -> Mistral3Config:
        """A Mistral3 config of ~0.1M parameters for tests and examples (fp32, untied lm_head).

        `text_config` / `vision_config` overrides are dicts merged into the tiny
        defaults; other keywords are top-level `Mistral3Config` fields.
        """
        text = dict(
            model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, max_position_embeddings=1024,
            rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False,
        )
        vision = dict(
            model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            head_dim=16, patch_size=8, image_size=64, num_channels=3, hidden_act="silu",
        )
        text.update(overrides.pop("text_config", {}))
        vision.update(overrides.pop("vision_config", {}))
        settings = dict(
            text_config=text, vision_config=vision, image_token_index=image_token_index, spatial_merge_size=2,
            projector_hidden_act="gelu", multimodal_projector_bias=False, tie_word_embeddings=False,
        )
        settings.update(overrides)
        return Mistral3Config(**settings)


def _check_loading_info(path: str, info: dict[str, Any]) -> None:
    problems = {kind: sorted(info.get(kind) or []) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {kind: keys for kind, keys in problems.items() if keys}
    if problems:
        detail = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(map(str, keys[:5]))}{' ...' if len(keys) > 5 else ''}" for kind, keys in problems.items())
        raise ConfigError("model.model_name_or_path", f"the weights in {path} do not fit the model ({detail}); check the checkpoint or use random_init")


def _read_config(model_cfg: ModelConfig) -> Mistral3Config:
    path = _model_dir(model_cfg)
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    if not isinstance(config, Mistral3Config):
        raise ConfigError(
            "model.model_name_or_path",
            f"{path}/config.json describes model_type {getattr(config, 'model_type', '?')!r}, not 'mistral3'; "
            "set model.model_id to the matching family",
        )
    return config


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


def _model_dir(model_cfg: ModelConfig) -> str:
    path = model_cfg.model_name_or_path
    if path is None:
        raise ConfigError("model.model_name_or_path", "is required: the directory holding config.json (and the weights unless random_init)")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError("model.model_name_or_path", f"{path!r} has no config.json (downloads are not done here; give a local directory)")
    return path
