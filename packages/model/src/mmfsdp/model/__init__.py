"""Model families for mmfsdp: the registry, the shared training forward, chunk loss, loss weights, attention.

- `ModelConfig` (YAML `model:`) and `FeaturesConfig` (YAML `features:`).
- `get_model_entry(model_id)` → the family's spec, a `ModelEntry` (`mmfsdp.model.spec`; docs/families.md):
  its declaration (config and model classes, module patterns, `capabilities`, `data`, `build`,
  `init_non_persistent_buffers`), its hooks (`state_dict_adapter()`, `validate_parallel`, `step_terms`,
  `num_experts`, `parallelize`), and two facets: `costs` (`FamilyCosts`: FLOPs, activation memory) and `testkit`
  (`FamilyTestKit`: `tiny_config(...)`, `test_batch(...)`). The generic machinery takes the spec:
  `mmfsdp.model.parallelize.parallelize(entry, model, parallel_cfg, parallel_dims, features_cfg)` (expert
  parallel, compile, recompute, offload, FSDP2) and `check_data(entry, ...)` (`mmfsdp.model.checks`).
  Families live one folder each under `mmfsdp.model.families` (spec, state-dict adapter, vision patches, test
  helpers) and register through the `mmfsdp.model_families` entry points; most are `HFFamilyEntry` declarations
  whose model class mixes `TrainingForwardMixin` into the HF class.
- MoE families also return `outputs.router_load` from the training forward; `load_balancing_loss`
  and `expert_load_summary` (`mmfsdp.model.router`) turn it into the router aux loss and load statistics.
- `entry.step_terms(loss_cfg)` → `StepTerms`: what a family adds to a training step (extra loss terms,
  statistics for the log; `RouterStepTerms` for a MoE family), none by default.
- The training forward `model(**model_inputs(batch), shift_labels=, loss_weights=)`
  (`mmfsdp.model.training_forward`) returns `.loss = Σ_t w_t · CE_t` (fp32);
  `shift_labels(labels, cu_seq_lens)` and `compute_loss_weights(..., cu_seq_lens=)` make its
  inputs (formulas in `mmfsdp.model.loss`); sample boundaries come from `cu_seq_lens`.
- `freeze_modules(model, patterns)`; attention backends in `mmfsdp.model.attention`.
- LoRA (`mmfsdp.model.lora`): `LoraConfig` (YAML `training.lora`), `apply_lora(model, lora_cfg, entry)` (PEFT's
  injection, before FSDP), `init_lora_adapters(model, lora_cfg, seed)`, `load_lora_adapter`, `lora_metadata`.
- Rollouts for online RL (`mmfsdp.model.rollout`): the `RolloutEngine` interface (`generate(requests, sampling,
  step)` → `Rollout`s with sampling log-probs; `sync_weights`, `weights_version`) and `HFRolloutEngine`, generation
  inside the training processes from the (FSDP2-sharded) model, seeded per (seed, step, prompt, generation).
- `model.enable_context_parallel(parallel_dims)`: the training forward splits the decoder's
  sequence over the CP group after the vision tower (`mmfsdp.model.context_parallel`);
  `entry.validate_parallel(model_cfg, plan)` checks the layout against `config.json`.

Importing the package imports nothing heavy: names load on first use, a family's module (and with it
transformers and the attention backends) when its entry is first asked for (`get_model_entry`).
"""

from mmfsdp.config.lazy import lazy_exports

# Names load on first use (PEP 562): reading a config needs `ModelConfig`, not transformers,
# and a launcher that never builds a model never imports a family.
_LAZY = {
    "Capabilities": "mmfsdp.model.spec",
    "DataNames": "mmfsdp.model.spec",
    "ModelEntry": "mmfsdp.model.spec",
    "StepTerms": "mmfsdp.model.spec",
    "get_model_entry": "mmfsdp.model.spec",
    "register_model": "mmfsdp.model.spec",
    "registered_model_ids": "mmfsdp.model.registry",
    "FamilyCosts": "mmfsdp.model.costs",
    "FamilyTestKit": "mmfsdp.model.testkit",
    "check_data": "mmfsdp.model.checks",
    "AttentionBackend": "mmfsdp.model.attention",
    "npu_layout": "mmfsdp.model.attention",
    "resolve_attention_backend": "mmfsdp.model.attention",
    "ChunkLossPlanConfig": "mmfsdp.model.config",
    "FeaturesConfig": "mmfsdp.model.config",
    "LossConfig": "mmfsdp.model.config",
    "ModelConfig": "mmfsdp.model.config",
    "IGNORE_INDEX": "mmfsdp.model.loss",
    "compute_loss_weights": "mmfsdp.model.loss",
    "sample_starts": "mmfsdp.model.loss",
    "shift_labels": "mmfsdp.model.loss",
    "weighted_cross_entropy": "mmfsdp.model.loss",
    "ChunkLossLinear": "mmfsdp.model.chunk_loss",
    "LinearCrossEntropy": "mmfsdp.model.chunk_loss",
    "chunked_linear_cross_entropy": "mmfsdp.model.chunk_loss",
    "freeze_modules": "mmfsdp.model.freeze",
    "init_rotary_buffers": "mmfsdp.model.meta_init",
    "NON_INPUT_KEYS": "mmfsdp.model.training_forward",
    "TrainingForwardMixin": "mmfsdp.model.training_forward",
    "model_inputs": "mmfsdp.model.training_forward",
    "HFFamilyEntry": "mmfsdp.model.hf_family",
    "safetensors_problem": "mmfsdp.model.hf_family",
    "LoraConfig": "mmfsdp.model.lora",
    "apply_lora": "mmfsdp.model.lora",
    "init_lora_adapters": "mmfsdp.model.lora",
    "load_lora_adapter": "mmfsdp.model.lora",
    "lora_metadata": "mmfsdp.model.lora",
    "resolve_lora_targets": "mmfsdp.model.lora",
    "HFRolloutEngine": "mmfsdp.model.rollout",
    "Rollout": "mmfsdp.model.rollout",
    "RolloutEngine": "mmfsdp.model.rollout",
    "RolloutRequest": "mmfsdp.model.rollout",
    "SamplingParams": "mmfsdp.model.rollout",
    "RouterLoad": "mmfsdp.model.router",
    "load_balancing_loss": "mmfsdp.model.router",
    "expert_load_summary": "mmfsdp.model.router",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = [
    "Capabilities",
    "DataNames",
    "ModelEntry",
    "StepTerms",
    "FamilyCosts",
    "FamilyTestKit",
    "check_data",
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
    "LoraConfig",
    "apply_lora",
    "init_lora_adapters",
    "load_lora_adapter",
    "lora_metadata",
    "resolve_lora_targets",
    "HFRolloutEngine",
    "Rollout",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingParams",
    "RouterLoad",
    "load_balancing_loss",
    "expert_load_summary",
]
