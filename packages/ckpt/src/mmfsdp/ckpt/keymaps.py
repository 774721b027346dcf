"""Pure renames between the key names of HF safetensors files and the model's `state_dict()` names.

transformers 5 keeps two namings for some families. For `mistral3`
(`Mistral3ForConditionalGeneration`, e.g. Magistral-Small-2509) the files on the
Hub, and what `save_pretrained` still writes (its `save_original_format=True`
default), use the original layout; the module's `state_dict()` uses the new one:

| file (original)               | `state_dict()` (new)              |
| ----------------------------- | --------------------------------- |
| `language_model.model.*`      | `model.language_model.*`          |
| `language_model.lm_head.*`    | `lm_head.*`                       |
| `vision_tower.*`              | `model.vision_tower.*`            |
| `multi_modal_projector.*`     | `model.multi_modal_projector.*`   |

`legacy_mistral3_key_map` maps file names to `state_dict()` names and leaves
names that are already new unchanged, so it reads either kind of file;
`mistral3_to_legacy_key_map` is its inverse, used when exporting. DCP
checkpoints always use the `state_dict()` names. `key_maps_for(model_type)`
returns the `(to_model, to_hf)` pair for a config's `model_type`, identity
renames for families without a table here.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["legacy_mistral3_key_map", "mistral3_to_legacy_key_map", "identity_key_map", "key_maps_for", "KeyMap"]

KeyMap = Callable[[str], str]

_MISTRAL3_LEGACY_TO_MODEL = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def _rename(key: str, table: tuple[tuple[str, str], ...]) -> str:
    for source, target in table:
        if key.startswith(source):
            return target + key[len(source):]
    return key


def identity_key_map(key: str) -> str:
    return key


def legacy_mistral3_key_map(key: str) -> str:
    """Original Mistral3 file name -> `state_dict()` name (new names pass through)."""
    return _rename(key, _MISTRAL3_LEGACY_TO_MODEL)


def mistral3_to_legacy_key_map(key: str) -> str:
    """`state_dict()` name -> original Mistral3 file name (as `save_pretrained` writes it)."""
    return _rename(key, tuple((target, source) for source, target in _MISTRAL3_LEGACY_TO_MODEL))


_KEY_MAPS: dict[str, tuple[KeyMap, KeyMap]] = {
    "mistral3": (legacy_mistral3_key_map, mistral3_to_legacy_key_map),
}


def key_maps_for(model_type: str | None) -> tuple[KeyMap, KeyMap]:
    """(file -> state_dict, state_dict -> file) renames for a HF config `model_type`."""
    return _KEY_MAPS.get(model_type or "", (identity_key_map, identity_key_map))
