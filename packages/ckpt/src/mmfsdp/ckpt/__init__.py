"""mmfsdp.ckpt: DCP save/resume, the tracker file, HF safetensors loading, and the `mm-convert` CLI.

- `save_checkpoint` / `load_checkpoint` / `finalize_pending`: training
  checkpoints under `<save>/iter_NNNNNNN/` with an atomically moved
  `latest_checkpointed_iteration.txt` (modules `save`, `load`, `state_files`, `layout`);
  `find_resume_point` / `verify_checkpoint`: which checkpoint a run continues from (`resume`).
- `load_hf_weights`: HF safetensors directory -> (FSDP2) model, one tensor at a time.
- `hf_to_dcp` / `dcp_to_hf`: the conversions behind `mm-convert`; `export_checkpoint_hf`: a training
  checkpoint `<save>/iter_N` exported as HF to `<save>/hf/iter_N` (`training.save_format: hf`). Exports name
  the family's HF class in `config.json` and the stop tokens the checkpoint records (`generation_metadata`) in
  `generation_config.json`, so that servers generate with them (`export_config`).
- `mmfsdp.ckpt.lora`: the names of PEFT-wrapped layers (`stored_key`, the `key_map` that loads a base into a
  LoRA model), trainable-only checkpoints exported as a PEFT adapter directory or merged HF weights.
- `mmfsdp.ckpt.match`: whether a checkpoint (DCP `.metadata`, safetensors headers through the state-dict
  adapter) fits a model built on the meta device — missing, unexpected and mismatched keys, no tensor data read
  (what `apps/train --check` reports).
- `SaveDirLock`: `<save>/.mmfsdp.lock`, so two runs never write one save directory (see `lock`).
- `StateDictAdapter` (`FromHF` / `ToHF`, `RenameAdapter`, `IDENTITY`): how a family's HF file
  tensors map to its `state_dict()` tensors (renames, experts stacked into one tensor); found by
  model id or `config.json` `model_type` through entry points of group `mmfsdp.state_dict_adapters`
  that model packages declare (see `adapters`). This package names no model family.

This package imports only torch, safetensors, tqdm and the standard library.
"""

from mmfsdp.ckpt.adapters import (
    ENTRY_POINT_GROUP,
    IDENTITY,
    FromHF,
    IdentityAdapter,
    RenameAdapter,
    StateDictAdapter,
    ToHF,
    find_state_dict_adapter,
    get_state_dict_adapter,
    registered_adapter_ids,
)
from mmfsdp.ckpt.convert import HF_EXPORT_DIRNAME, dcp_to_hf, export_checkpoint_hf, hf_to_dcp
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.export_config import GENERATION_METADATA, generation_metadata
from mmfsdp.ckpt.hf import HFLoadResult, SafetensorsDir, load_hf_weights, parse_size
from mmfsdp.ckpt.layout import (
    COMPLETE_FILENAME,
    RELEASE,
    TRACKER_FILENAME,
    find_checkpoint,
    iteration_dirname,
    list_iterations,
    prune_checkpoints,
    read_tracker,
    resolve_checkpoint,
    write_tracker,
)
from mmfsdp.ckpt.load import LoadedCheckpoint, load_checkpoint
from mmfsdp.ckpt.lock import LOCK_FILENAME, SaveDirLock
from mmfsdp.ckpt.resume import ResumePoint, find_resume_point, verify_checkpoint
from mmfsdp.ckpt.rng import capture_rng_state, restore_rng_state
from mmfsdp.ckpt.save import SaveHandle, finalize_pending, save_checkpoint
from mmfsdp.ckpt.state_files import load_tensor_file, read_checkpoint_info

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "finalize_pending",
    "SaveHandle",
    "LoadedCheckpoint",
    "ResumePoint",
    "find_resume_point",
    "verify_checkpoint",
    "load_tensor_file",
    "read_checkpoint_info",
    "load_hf_weights",
    "HFLoadResult",
    "SafetensorsDir",
    "hf_to_dcp",
    "dcp_to_hf",
    "export_checkpoint_hf",
    "HF_EXPORT_DIRNAME",
    "GENERATION_METADATA",
    "generation_metadata",
    "parse_size",
    "CheckpointError",
    "StateDictAdapter",
    "RenameAdapter",
    "IdentityAdapter",
    "IDENTITY",
    "FromHF",
    "ToHF",
    "ENTRY_POINT_GROUP",
    "registered_adapter_ids",
    "get_state_dict_adapter",
    "find_state_dict_adapter",
    "capture_rng_state",
    "restore_rng_state",
    "TRACKER_FILENAME",
    "COMPLETE_FILENAME",
    "RELEASE",
    "iteration_dirname",
    "read_tracker",
    "write_tracker",
    "resolve_checkpoint",
    "find_checkpoint",
    "list_iterations",
    "prune_checkpoints",
    "SaveDirLock",
    "LOCK_FILENAME",
]
