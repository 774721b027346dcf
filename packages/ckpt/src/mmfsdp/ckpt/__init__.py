"""mmfsdp.ckpt: DCP save/resume, the tracker file, HF safetensors loading, and the `mm-convert` CLI.

- `save_checkpoint` / `load_checkpoint` / `finalize_pending`: training
  checkpoints under `<save>/iter_NNNNNNN/` with an atomically moved
  `latest_checkpointed_iteration.txt` (see `checkpoint` and `layout`).
- `load_hf_weights`: HF safetensors directory -> (FSDP2) model, one tensor at a time.
- `hf_to_dcp` / `dcp_to_hf`: the conversions behind `mm-convert`.
- `SaveDirLock`: `<save>/.mmfsdp.lock`, so two runs never write one save directory (see `lock`).
- Key renames for HF file naming: `legacy_mistral3_key_map` and friends.

This package imports only torch, safetensors, tqdm and the standard library.
"""

from mmfsdp.ckpt.checkpoint import (
    LoadedCheckpoint,
    ResumePoint,
    SaveHandle,
    finalize_pending,
    find_resume_point,
    load_checkpoint,
    load_tensor_file,
    save_checkpoint,
    verify_checkpoint,
)
from mmfsdp.ckpt.convert import dcp_to_hf, hf_to_dcp
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.hf import HFLoadResult, SafetensorsDir, load_hf_weights, parse_size
from mmfsdp.ckpt.keymaps import identity_key_map, key_maps_for, legacy_mistral3_key_map, mistral3_to_legacy_key_map
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
from mmfsdp.ckpt.lock import LOCK_FILENAME, SaveDirLock
from mmfsdp.ckpt.rng import capture_rng_state, restore_rng_state

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
    "load_hf_weights",
    "HFLoadResult",
    "SafetensorsDir",
    "hf_to_dcp",
    "dcp_to_hf",
    "parse_size",
    "CheckpointError",
    "legacy_mistral3_key_map",
    "mistral3_to_legacy_key_map",
    "identity_key_map",
    "key_maps_for",
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
