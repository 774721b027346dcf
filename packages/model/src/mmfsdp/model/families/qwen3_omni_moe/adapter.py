"""Qwen3-Omni's state-dict adapters: HF safetensors file names <-> the thinker's `state_dict()` names.

A hub checkpoint (Qwen/Qwen3-Omni-30B-A3B-*, and HF `save_pretrained` of `Qwen3OmniMoeForConditionalGeneration`)
holds the whole model: the thinker under `thinker.`, in transformers 4.57's module names, and the talker
(`talker.*`) and the codec decoder (`code2wav.*`), which this family does not train. A bare thinker
(`save_pretrained` of `Qwen3OmniMoeThinkerForConditionalGeneration`) holds the thinker's names without `thinker.`:

| file (after an optional `thinker.`)        | `state_dict()`                           |
| ------------------------------------------ | ---------------------------------------- |
| `audio_tower.*`                            | `model.audio_tower.*`                    |
| `visual.*`                                 | `model.visual.*`                         |
| `model.*` (the text decoder)               | `model.language_model.*`                 |
| `lm_head.*`                                | `lm_head.*`                              |
| `...mlp.experts.N.{gate,up,down}_proj.weight` | fused `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]` (`mmfsdp.model.expert_files`) |

The routed experts are per expert in both (transformers 5 converts them on load, `qwen2_moe`'s mapping) and
written back so; fused files (a `state_dict()` save) are read as they are. `talker.*` and `code2wav.*` are
`passthrough_hf_prefixes`: not read, and every export copies them from its assets directory, so a trained
checkpoint keeps its speech output. Two adapters, picked by `config.json`'s `model_type`: `Qwen3OmniMoeAdapter`
(`qwen3_omni_moe`, the model id's: writes `thinker.*`, `architectures` the full class) and
`Qwen3OmniMoeThinkerAdapter` (`qwen3_omni_moe_thinker`: writes the bare names, the thinker class). Both read
either naming.
"""

from __future__ import annotations

from typing import Mapping

from mmfsdp.ckpt.adapters import FromHF, StateDictAdapter, ToHF
from mmfsdp.model.expert_files import EXPERT_KEY, sort_expert_keys, stack_per_expert, unstack_per_expert

__all__ = ["Qwen3OmniMoeAdapter", "Qwen3OmniMoeThinkerAdapter"]

Shape = tuple[int, ...]

_THINKER = "thinker."
_RENAMES = (
    ("audio_tower.", "model.audio_tower."),
    ("visual.", "model.visual."),
    ("model.", "model.language_model."),
    ("lm_head.", "lm_head."),
)
"""(thinker file prefix, `state_dict()` prefix), the first match applies in either direction."""
_NOT_TRAINED = "not trained by this family (the thinker); exports copy it from the assets directory"


def _rename(key: str, table: tuple[tuple[str, str], ...]) -> str:
    for source, target in table:
        if key.startswith(source):
            return target + key[len(source):]
    raise KeyError(f"{key} is not a Qwen3-Omni thinker tensor")


class Qwen3OmniMoeThinkerAdapter(StateDictAdapter):
    """A bare thinker's files (module docstring); reads a full checkpoint's `thinker.*` too."""

    model_id = "qwen3_omni_moe_thinker"
    hf_model_types = ("qwen3_omni_moe_thinker",)
    architectures = ("Qwen3OmniMoeThinkerForConditionalGeneration",)
    passthrough_hf_prefixes = (("talker.", f"the talker: {_NOT_TRAINED}"), ("code2wav.", f"the codec decoder: {_NOT_TRAINED}"))
    file_prefix = ""
    """What `to_hf` writes before the thinker's file names."""

    def model_key(self, hf_key: str) -> str:
        return _rename(hf_key.removeprefix(_THINKER), _RENAMES)

    def hf_key(self, model_key: str) -> str:
        return self.file_prefix + _rename(model_key, tuple((model, hf) for hf, model in _RENAMES))

    def from_hf(self, hf_shapes: Mapping[str, Shape]) -> dict[str, FromHF]:
        keys = sort_expert_keys(hf_shapes)
        plans = {self.model_key(key): FromHF((key,)) for key in keys.others}
        plans.update({self.model_key(key): FromHF((key,)) for names in keys.fused.values() for key in names.values()})
        plans.update({self.model_key(key): plan for key, plan in stack_per_expert(keys.per_expert).items()})
        return plans

    def to_hf(self, model_shapes: Mapping[str, Shape]) -> dict[str, ToHF]:
        plans: dict[str, ToHF] = {}
        for key, shape in model_shapes.items():
            match = EXPERT_KEY.match(key)
            fused = match is not None and match["fused"]
            plans[key] = unstack_per_expert(self.hf_key(key), shape[0]) if fused else ToHF((self.hf_key(key),))
        return plans


class Qwen3OmniMoeAdapter(Qwen3OmniMoeThinkerAdapter):
    """A full Qwen3-Omni checkpoint: the thinker under `thinker.`, the talker and code2wav passed through."""

    model_id = "qwen3_omni_moe"
    hf_model_types = ("qwen3_omni_moe",)
    architectures = ("Qwen3OmniMoeForConditionalGeneration",)
    file_prefix = _THINKER
