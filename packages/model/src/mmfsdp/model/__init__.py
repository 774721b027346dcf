"""Model families for mmfsdp: the registry, the Mistral3 FSDP wrapper, chunk loss, loss weights, attention.

- `ModelConfig` (YAML `model:`) and `FeaturesConfig` (YAML `features:`).
- `get_model_entry(model_id)` → `ModelEntry`: `build(model_cfg, features_cfg, device=, dtype=)`,
  the default plans (`fsdp_modules`, `recompute_modules`, `vision_modules`), `lm_head_name`,
  `hf_key_map`, `init_non_persistent_buffers(model)` and, for `mistral3`, `tiny_config(...)`.
- The training forward `model(..., shift_labels=, loss_weights=, [cu_seq_lens=, max_length=])`
  returns `.loss = Σ_t w_t · CE_t` (fp32); `shift_labels(labels, position_ids)` and
  `compute_loss_weights(...)` make its inputs (formulas in `mmfsdp.model.loss`).
- `freeze_modules(model, patterns)`; attention backends in `mmfsdp.model.attention`.
- `model.enable_context_parallel(parallel_dims)`: the training forward splits the decoder's
  sequence over the CP group after the vision tower (`mmfsdp.model.context_parallel`);
  `entry.validate_parallel(model_cfg, plan)` checks the layout against `config.json`.

Importing the package registers the `mistral3` entry and the attention backends.
"""

from mmfsdp.model.registry import ModelEntry, get_model_entry, register_model, registered_model_ids
from mmfsdp.model.attention import AttentionBackend, npu_layout, resolve_attention_backend, set_attention_backend
from mmfsdp.model.config import ChunkLossPlanConfig, FeaturesConfig, LossConfig, ModelConfig
from mmfsdp.model.loss import IGNORE_INDEX, compute_loss_weights, shift_labels, weighted_cross_entropy
from mmfsdp.model.chunk_loss import ChunkLossLinear, LinearCrossEntropy, chunked_linear_cross_entropy
from mmfsdp.model.freeze import freeze_modules
from mmfsdp.model.meta_init import init_rotary_buffers
from mmfsdp.model.mistral3 import Mistral3Entry, Mistral3ForConditionalGenerationFSDP, safetensors_problem

__all__ = [
    "ModelEntry",
    "safetensors_problem",
    "get_model_entry",
    "register_model",
    "registered_model_ids",
    "AttentionBackend",
    "npu_layout",
    "resolve_attention_backend",
    "set_attention_backend",
    "ModelConfig",
    "FeaturesConfig",
    "ChunkLossPlanConfig",
    "LossConfig",
    "IGNORE_INDEX",
    "compute_loss_weights",
    "shift_labels",
    "weighted_cross_entropy",
    "ChunkLossLinear",
    "LinearCrossEntropy",
    "chunked_linear_cross_entropy",
    "freeze_modules",
    "init_rotary_buffers",
    "Mistral3Entry",
    "Mistral3ForConditionalGenerationFSDP",
]
