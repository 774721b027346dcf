"""The config files of an exported HF directory: what a server needs besides the weights to generate with it.

An export (`dcp_to_hf`, `training.save_format: hf`, `dcp_to_merged_hf`) copies the config and tokenizer files of
its `--model_assets_dir`, then `write_export_config` completes two of them:

- `config.json` `architectures`: the HF class the exported weights are, from the family's state-dict adapter
  (`StateDictAdapter.architectures`). Servers pick the model class from it: without it vLLM resolves a
  vision-language config by its `model_type` to the bare `...Model` class, which has no `lm_head`, takes it for an
  embedding model and refuses to generate. An assets directory made by hand (the tiny examples') has none; one
  from `save_pretrained` has the same value.
- `config.json` settings the model computes with that the copied config may lack
  (`StateDictAdapter.export_config_defaults`, written only where absent): e.g. a MoE router that always
  renormalises its top-k weights where transformers 5.2x no longer records it (`text_config.norm_topk_prob`),
  a key vLLM's MoE block reads with the default false.
- `generation_config.json` `eos_token_id`: the tokens that end an answer in the chat template the checkpoint was
  trained with, which the trainer records in the checkpoint's metadata (`generation_metadata`, under
  `GENERATION_METADATA`): first those, then any other the assets' own generation config lists; `pad_token_id`
  when the assets give none. Servers stop there (vLLM adds these ids to every request's stop tokens; transformers'
  `generate` reads them). A checkpoint that records none (a `hf_to_dcp` release, an older run) keeps the assets'
  file as it is.

This module names no family and no template: the adapter and the checkpoint say what to write.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from mmfsdp.ckpt.adapters import StateDictAdapter

__all__ = ["GENERATION_METADATA", "generation_metadata", "write_export_config"]

GENERATION_METADATA = "generation_config"
"""The key, in a checkpoint's metadata (`checkpoint.json`), of the `generation_config.json` fields its exports
write (`generation_metadata`)."""
CONFIG_FILENAME = "config.json"
GENERATION_CONFIG_FILENAME = "generation_config.json"


def generation_metadata(stop_token_ids: Sequence[int], pad_token_id: int | None = None) -> dict[str, Any]:
    """The checkpoint metadata entry (`save_checkpoint(metadata=...)`) that makes the checkpoint's HF exports stop
    generating at `stop_token_ids` (the chat template's end of an answer, then the tokenizer's eos)."""
    fields: dict[str, Any] = {"eos_token_id": [int(token) for token in dict.fromkeys(stop_token_ids)]}
    if pad_token_id is not None:
        fields["pad_token_id"] = int(pad_token_id)
    return {GENERATION_METADATA: fields}


def _ids(value: Any) -> list[int]:
    """`eos_token_id` as a list: HF writes one id or a list."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(token) for token in value]


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def write_export_config(out: Path, adapter: StateDictAdapter, checkpoint_metadata: Mapping | None) -> None:
    """Complete the copied `config.json` and `generation_config.json` of the export directory `out` (module
    docstring); a file whose content would not change is left as copied."""
    config_path = out / CONFIG_FILENAME
    if (adapter.architectures or adapter.export_config_defaults) and config_path.is_file():
        config = json.loads(config_path.read_text())
        updated = copy.deepcopy(config)  # nested sections change too
        if adapter.architectures and config.get("architectures") != list(adapter.architectures):
            updated = {"architectures": list(adapter.architectures),
                       **{key: value for key, value in config.items() if key != "architectures"}}
        for dotted, value in adapter.export_config_defaults:
            *parents, key = dotted.split(".")
            section = updated
            for name in parents:
                section = section.get(name) if isinstance(section, dict) else None
            if isinstance(section, dict) and key not in section:
                section[key] = value
        if updated != config:
            _write_json(config_path, updated)

    fields = (checkpoint_metadata or {}).get(GENERATION_METADATA)
    if not fields:
        return
    path = out / GENERATION_CONFIG_FILENAME
    generation = json.loads(path.read_text()) if path.is_file() else {}
    updated = dict(generation)
    stops = [*_ids(fields["eos_token_id"]), *_ids(generation.get("eos_token_id"))]
    updated["eos_token_id"] = list(dict.fromkeys(stops))
    if updated.get("pad_token_id") is None and fields.get("pad_token_id") is not None:
        updated["pad_token_id"] = fields["pad_token_id"]
    if updated != generation:
        _write_json(path, updated)
