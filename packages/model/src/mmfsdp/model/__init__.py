"""Model families for mmfsdp: the registry, the shared training forward, chunk loss, loss weights, attention.

- `ModelConfig` (YAML `model:`) and `FeaturesConfig` (YAML `features:`).
- `get_model_entry(model_id)` → `ModelEntry`: `config_class`, `model_class`,
  `build(model_cfg, features_cfg, device=, dtype=)`, the default plans (`fsdp_modules`,
  `recompute_modules`, `vision_modules`), `decoder_name`, `lm_head_name`, `hf_key_map`,
  `parallelize(model, parallel_cfg, parallel_dims, features_cfg)`,
  `init_non_persistent_buffers(model)` and `tiny_config(...)`. Families: `mistral3`
  (`mmfsdp.model.mistral3`) and `qwen3_vl` (`mmfsdp.model.qwen3_vl`), both
  `HFFamilyEntry` declarations whose model class mixes `TrainingForwardMixin` into the HF class.
- The training forward `model(**model_inputs(batch), shift_labels=, loss_weights=)`
  (`mmfsdp.model.training_forward`) returns `.loss = Σ_t w_t · CE_t` (fp32);
  `shift_labels(labels, cu_seq_lens)` and `compute_loss_weights(..., cu_seq_lens=)` make its
  inputs (formulas in `mmfsdp.model.loss`); sample boundaries come from `cu_seq_lens`.
- `freeze_modules(model, patterns)`; attention backends in `mmfsdp.model.attention`.
- `model.enable_context_parallel(parallel_dims)`: the training forward splits the decoder's
  sequence over the CP group after the vision tower (`mmfsdp.model.context_parallel`);
  `entry.validate_parallel(model_cfg, plan)` checks the layout against `config.json`.

Importing the package registers the `mistral3` and `qwen3_vl` entries and the attention backends.
"""

from mmfsdp.model.registry import ModelEntry, get_model_entry, register_model, registered_model_ids
from mmfsdp.model.attention import AttentionBackend, npu_layout, resolve_attention_backend, set_attention_backend
from mmfsdp.model.config import ChunkLossPlanConfig, FeaturesConfig, LossConfig, ModelConfig
from mmfsdp.model.loss import IGNORE_INDEX, compute_loss_weights, sample_starts, shift_labels, weighted_cross_entropy
from mmfsdp.model.chunk_loss import ChunkLossLinear, LinearCrossEntropy, chunked_linear_cross_entropy
from mmfsdp.model.freeze import freeze_modules
from mmfsdp.model.meta_init import init_rotary_buffers
from mmfsdp.model.training_forward import NON_INPUT_KEYS, TrainingForwardMixin, model_inputs
from mmfsdp.model.hf_family import HFFamilyEntry, safetensors_problem
from mmfsdp.model.mistral3 import Mistral3Entry, Mistral3ForConditionalGenerationFSDP
from mmfsdp.model.qwen3_vl import Qwen3VLEntry, Qwen3VLForConditionalGenerationFSDP

__all__ = [
    "ModelEntry",
    "HFFamilyEntry",
    "TrainingForwardMixin",
    "NON_INPUT_KEYS",
    "model_inputs",
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
    "sample_starts",
    "shift_labels",
    "weighted_cross_entropy",
    "ChunkLossLinear",
    "LinearCrossEntropy",
    "chunked_linear_cross_entropy",
    "freeze_modules",
    "init_rotary_buffers",
    "Mistral3Entry",
    "Mistral3ForConditionalGenerationFSDP",
    "Qwen3VLEntry",
    "Qwen3VLForConditionalGenerationFSDP",
]
