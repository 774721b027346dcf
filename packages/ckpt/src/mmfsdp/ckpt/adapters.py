"""State-dict adapters: how a model family's HF safetensors tensors become its `state_dict()` tensors and back.

DCP checkpoints always hold the model's `state_dict()` names and tensors. HF
files may name them differently (some families keep an original naming that
`save_pretrained` still writes) or lay them out differently (per-expert MoE
weights stored one tensor per expert, stacked into one `[num_experts, ...]`
tensor in the model). A `StateDictAdapter` says, per key and without touching
any data, how to go from one to the other:

- `from_hf(hf_shapes)` -> `{model key: FromHF(hf_keys, combine)}`: the model
  tensor is `combine([file tensor of each hf key])`; `combine=None` means a
  single key taken as it is (a rename).
- `to_hf(model_shapes)` -> `{model key: ToHF(hf_keys, split)}`: `split(model
  tensor)` returns one tensor per hf key; `split=None` means a single key and
  the tensor as it is.

Both see only names and shapes, so their callers stream: `hf_to_dcp` and
`load_hf_weights` read the file tensors of one model tensor when they need it,
`dcp_to_hf` loads one output shard of model tensors at a time. `plan_from_hf`
and `plan_to_hf` check a plan (every key used exactly once) and find the
shapes and dtypes of its results by running `combine` / `split` on meta
tensors, so both must be plain tensor operations (stack, cat, unbind, chunk,
transpose, ...). `RenameAdapter` covers families that differ only by key
prefixes; its `key_mapping()` is the same table for transformers'
`from_pretrained(key_mapping=...)`.

Discovery keeps this package free of model families. A model package declares
its adapters as entry points of group `mmfsdp.state_dict_adapters`, named by
model id, in its pyproject.toml:

    [project.entry-points."mmfsdp.state_dict_adapters"]
    my_family = "my_package.adapters:MyFamilyAdapter"

`get_state_dict_adapter(model_id)` loads one by model id;
`find_state_dict_adapter(config)` picks the one whose `hf_model_types` holds
`config.json`'s `model_type` (`identity`, built in, when there is no
`model_type`). Nothing matching is a `CheckpointError` naming the registered ones.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable, Mapping, Sequence

import torch

from mmfsdp.ckpt._log import info_rank0
from mmfsdp.ckpt.errors import CheckpointError, preview

__all__ = [
    "ENTRY_POINT_GROUP",
    "IDENTITY",
    "FromHF",
    "ToHF",
    "StateDictAdapter",
    "RenameAdapter",
    "ORIGINAL_VLM_RENAMES",
    "IdentityAdapter",
    "PlannedFromHF",
    "PlannedToHF",
    "plan_from_hf",
    "plan_to_hf",
    "registered_adapter_ids",
    "get_state_dict_adapter",
    "find_state_dict_adapter",
    "resolve_state_dict_adapter",
]

ENTRY_POINT_GROUP = "mmfsdp.state_dict_adapters"

Shape = tuple[int, ...]
Combine = Callable[[list[torch.Tensor]], torch.Tensor]
Split = Callable[[torch.Tensor], Sequence[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class FromHF:
    """One model tensor made from HF file tensors: `combine([tensor of each hf_key])`."""

    hf_keys: tuple[str, ...]
    combine: Combine | None = None
    """None: `hf_keys` is one key whose tensor is the model tensor as it is."""
    rowwise: bool = False
    """`combine` maps each row (dim 0) of the one HF tensor to the same row of the model tensor (e.g. a transpose
    of the other dims, stacked experts): a loader filling a dim-0 shard reads only its rows."""

    def __post_init__(self) -> None:
        if self.combine is None and len(self.hf_keys) != 1:
            raise ValueError(f"FromHF{self.hf_keys}: without combine there must be exactly one HF key")
        if self.rowwise and len(self.hf_keys) != 1:
            raise ValueError(f"FromHF{self.hf_keys}: rowwise needs exactly one HF key")


@dataclass(frozen=True, slots=True)
class ToHF:
    """The HF file tensors one model tensor is written as: `split(model tensor)`, one per hf_key."""

    hf_keys: tuple[str, ...]
    split: Split | None = None
    """None: `hf_keys` is one key that receives the model tensor as it is."""

    def __post_init__(self) -> None:
        if self.split is None and len(self.hf_keys) != 1:
            raise ValueError(f"ToHF{self.hf_keys}: without split there must be exactly one HF key")


class StateDictAdapter:
    """Base class of a family's adapter between HF file tensors and `state_dict()` tensors."""

    model_id: str = ""
    """The model id, the adapter's entry-point name."""
    hf_model_types: tuple[str, ...] = ()
    """The `config.json` `model_type`s whose files this adapter reads."""
    architectures: tuple[str, ...] = ()
    """The HF model class(es) the tensors `to_hf` writes are (a `...ForConditionalGeneration` class): what an
    export's `config.json` names under `architectures`, so that servers (vLLM, transformers' Auto classes) build
    that class (`mmfsdp.ckpt.export_config`). Empty: the export keeps the assets' value."""
    export_config_defaults: tuple[tuple[str, Any], ...] = ()
    """(dotted `config.json` key, value) an export writes where the copied config lacks the key: settings the model
    always computes with that the lock's transformers no longer writes, which other readers of the config (vLLM)
    still look up with another default (`mmfsdp.ckpt.export_config`)."""

    @property
    def name(self) -> str:
        """For messages: the model id, or the class name of an unregistered adapter."""
        return self.model_id or type(self).__name__

    skipped_hf_prefixes: tuple[tuple[str, str], ...] = ()
    """(file key prefix, why) of tensors the published files hold and the model has no place for (e.g. a
    multi-token-prediction head the model class does not build): left out when reading, with a log line; every other file key must be
    used. Written HF directories do not hold them."""
    passthrough_hf_prefixes: tuple[tuple[str, str], ...] = ()
    """(file key prefix, why) of tensors the model does not build but a checkpoint of it must keep (e.g. the speech
    generator beside a trained thinker): not read, as `skipped_hf_prefixes`, and every export (`dcp_to_hf`, so
    `mm-convert` and `training.save_format: hf`) copies them byte for byte from its assets directory's weights."""

    def passes_through(self, hf_key: str) -> bool:
        """Whether the file tensor `hf_key` is one exports copy from the assets (`passthrough_hf_prefixes`)."""
        return any(hf_key.startswith(prefix) for prefix, _ in self.passthrough_hf_prefixes)

    def from_hf(self, hf_shapes: Mapping[str, Shape]) -> dict[str, FromHF]:
        """Model key -> how to make it, for the file tensors `hf_shapes` (key -> shape); use every key once."""
        raise NotImplementedError

    def to_hf(self, model_shapes: Mapping[str, Shape]) -> dict[str, ToHF]:
        """Model key -> the HF keys it is written as, for the model tensors `model_shapes` (key -> shape)."""
        raise NotImplementedError

    def key_mapping(self) -> dict[str, str] | None:
        """`{regex: replacement}` file key -> model key for `from_pretrained(key_mapping=...)`, or None when the
        adapter is not pure renames."""
        return None


class RenameAdapter(StateDictAdapter):
    """An adapter that only renames key prefixes; keys no prefix matches pass through unchanged."""

    renames: tuple[tuple[str, str], ...] = ()
    """(HF file prefix, `state_dict()` prefix) pairs; the first matching pair applies, in either direction."""

    def model_key(self, hf_key: str) -> str:
        return _rename(hf_key, self.renames)

    def hf_key(self, model_key: str) -> str:
        return _rename(model_key, tuple((model, hf) for hf, model in self.renames))

    def from_hf(self, hf_shapes: Mapping[str, Shape]) -> dict[str, FromHF]:
        return {name: FromHF((key,)) for name, key in _unique(hf_shapes, self.model_key, "file keys").items()}

    def to_hf(self, model_shapes: Mapping[str, Shape]) -> dict[str, ToHF]:
        hf_names = _unique(model_shapes, self.hf_key, "model keys")
        return {name: ToHF((hf,)) for hf, name in hf_names.items()}

    def key_mapping(self) -> dict[str, str]:
        return {"^" + re.escape(hf): model for hf, model in self.renames}


ORIGINAL_VLM_RENAMES: tuple[tuple[str, str], ...] = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)
"""`RenameAdapter.renames` of the vision-language models whose files keep the original layout (a vision tower, a
projector and a causal LM side by side; the Hub's files and `save_pretrained`'s `save_original_format=True`) while
transformers 5 nests them under `model.` in `state_dict()` (its conversion mapping for these models):

| file (original)               | `state_dict()` (new)              |
| ----------------------------- | --------------------------------- |
| `language_model.model.*`      | `model.language_model.*`          |
| `language_model.lm_head.*`    | `lm_head.*`                       |
| `vision_tower.*`              | `model.vision_tower.*`            |
| `multi_modal_projector.*`     | `model.multi_modal_projector.*`   |

Names already new pass through, so files in either naming load; an export writes the original naming."""


class IdentityAdapter(RenameAdapter):
    """File names are `state_dict()` names (the built-in `identity` adapter)."""

    model_id = "identity"


IDENTITY = IdentityAdapter()


def _rename(key: str, table: tuple[tuple[str, str], ...]) -> str:
    for source, target in table:
        if key.startswith(source):
            return target + key[len(source) :]
    return key


def _unique(keys: Sequence[str] | Mapping[str, Shape], rename: Callable[[str], str], what: str) -> dict[str, str]:
    """new name -> key; two keys renamed to one name (both namings present) is an error."""
    out: dict[str, str] = {}
    for key in keys:
        name = rename(key)
        if name in out:
            raise CheckpointError(
                f"{what} {out[name]} and {key} both map to {name}; they hold both namings of one tensor"
            )
        out[name] = key
    return out


@dataclass(frozen=True, slots=True)
class PlannedFromHF:
    """A checked `FromHF` with the shape and dtype of the model tensor it makes."""

    source: FromHF
    shape: Shape
    dtype: torch.dtype

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The model tensor, reading each file tensor with `read(hf_key)`."""
        tensors = [read(key) for key in self.source.hf_keys]
        if self.source.combine is None:
            return tensors[0]
        return self.source.combine(tensors).contiguous()


@dataclass(frozen=True, slots=True)
class PlannedToHF:
    """A checked `ToHF` with the shape and dtype of each HF tensor it writes."""

    target: ToHF
    specs: dict[str, tuple[Shape, torch.dtype]]

    def pieces(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF key -> tensor for the model tensor `tensor`."""
        if self.target.split is None:
            return {self.target.hf_keys[0]: tensor}
        return dict(zip(self.target.hf_keys, self.target.split(tensor), strict=True))


def _meta(shape: Shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def plan_from_hf(
    adapter: StateDictAdapter, hf_specs: Mapping[str, tuple[Shape, torch.dtype]]
) -> dict[str, PlannedFromHF]:
    """Model key -> checked plan for the file tensors `hf_specs` (key -> (shape, dtype)), using each key once
    (less the adapter's `skipped_hf_prefixes` and `passthrough_hf_prefixes`)."""
    for prefix, why in (*adapter.skipped_hf_prefixes, *adapter.passthrough_hf_prefixes):
        skipped = [key for key in hf_specs if key.startswith(prefix)]
        if skipped:
            info_rank0(f"state-dict adapter {adapter.name}: {len(skipped)} file tensor(s) {prefix}* not read: {why}")
            hf_specs = {key: spec for key, spec in hf_specs.items() if not key.startswith(prefix)}
    plans = adapter.from_hf({key: shape for key, (shape, _) in hf_specs.items()})
    user: dict[str, str] = {}
    unknown = []
    for name, source in plans.items():
        for key in source.hf_keys:
            if key not in hf_specs:
                unknown.append(f"{key} (for {name})")
            elif key in user:
                raise CheckpointError(
                    f"state-dict adapter {adapter.name}: file key {key} feeds both {user[key]} and {name}"
                )
            user[key] = name
    unused = [key for key in hf_specs if key not in user]
    if unknown or unused:
        lines = [f"asks for file keys the files do not have: {preview(unknown)}"] if unknown else []
        lines += [f"leaves file keys unused: {preview(unused)}"] if unused else []
        raise CheckpointError(f"state-dict adapter {adapter.name} does not fit these files: " + "; ".join(lines))
    planned = {}
    for name, source in plans.items():
        if source.combine is None:
            shape, dtype = hf_specs[source.hf_keys[0]]
        else:
            try:
                out = source.combine([_meta(*hf_specs[key]) for key in source.hf_keys])
            except (RuntimeError, ValueError, IndexError, TypeError) as e:
                raise CheckpointError(
                    f"state-dict adapter {adapter.name} cannot make {name} from {preview(list(source.hf_keys))}: {e}"
                ) from None
            shape, dtype = tuple(out.shape), out.dtype
        planned[name] = PlannedFromHF(source, tuple(shape), dtype)
    return planned


def plan_to_hf(
    adapter: StateDictAdapter, model_specs: Mapping[str, tuple[Shape, torch.dtype]]
) -> dict[str, PlannedToHF]:
    """Model key -> checked plan for the model tensors `model_specs` (key -> (shape, dtype)); HF keys are unique."""
    plans = adapter.to_hf({key: shape for key, (shape, _) in model_specs.items()})
    missing = [name for name in model_specs if name not in plans]
    unknown = [name for name in plans if name not in model_specs]
    if missing or unknown:
        lines = [f"writes no HF key for {preview(missing)}"] if missing else []
        lines += [f"plans model keys the checkpoint does not have: {preview(unknown)}"] if unknown else []
        raise CheckpointError(f"state-dict adapter {adapter.name} does not fit this checkpoint: " + "; ".join(lines))
    writer: dict[str, str] = {}
    planned = {}
    for name, target in plans.items():
        for key in target.hf_keys:
            if key in writer:
                raise CheckpointError(
                    f"state-dict adapter {adapter.name}: {writer[key]} and {name} both write HF key {key}"
                )
            writer[key] = name
        if target.split is None:
            specs = {target.hf_keys[0]: model_specs[name]}
        else:
            try:
                pieces = list(target.split(_meta(*model_specs[name])))
            except (RuntimeError, ValueError, IndexError, TypeError) as e:
                raise CheckpointError(f"state-dict adapter {adapter.name} cannot split {name}: {e}") from None
            if len(pieces) != len(target.hf_keys):
                raise CheckpointError(
                    f"state-dict adapter {adapter.name} splits {name} into {len(pieces)} tensors "
                    f"for {len(target.hf_keys)} HF keys"
                )
            specs = {key: (tuple(piece.shape), piece.dtype) for key, piece in zip(target.hf_keys, pieces)}
        planned[name] = PlannedToHF(target, specs)
    return planned


def _entry_points() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            raise CheckpointError(
                f"two installed packages register state-dict adapter {ep.name!r} "
                f"({found[ep.name].value} and {ep.value}, entry-point group {ENTRY_POINT_GROUP})"
            )
        found[ep.name] = ep
    found.pop(IDENTITY.model_id, None)
    return found


def _load(ep: EntryPoint) -> StateDictAdapter:
    try:
        obj = ep.load()
    except Exception as e:  # a broken plugin fails in many ways while importing
        raise CheckpointError(
            f"state-dict adapter {ep.name!r} = {ep.value} (entry-point group {ENTRY_POINT_GROUP}) "
            f"does not load: {type(e).__name__}: {e}"
        ) from None
    adapter = obj() if isinstance(obj, type) else obj
    if not isinstance(adapter, StateDictAdapter):
        raise CheckpointError(
            f"entry point {ep.name!r} = {ep.value} (group {ENTRY_POINT_GROUP}) is a "
            f"{type(adapter).__name__}, not a StateDictAdapter"
        )
    return adapter


def registered_adapter_ids() -> list[str]:
    """The model ids with a state-dict adapter: `identity` and the installed entry points (none is loaded)."""
    return [IDENTITY.model_id, *sorted(_entry_points())]


def get_state_dict_adapter(model_id: str) -> StateDictAdapter:
    """The adapter registered under `model_id`; an unknown id is a `CheckpointError` naming the registered ones."""
    if model_id == IDENTITY.model_id:
        return IDENTITY
    found = _entry_points()
    if model_id not in found:
        close = difflib.get_close_matches(model_id, registered_adapter_ids(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise CheckpointError(
            f"no state-dict adapter for model id {model_id!r}{hint}; registered: "
            f"{', '.join(registered_adapter_ids())} (entry-point group {ENTRY_POINT_GROUP})"
        )
    return _load(found[model_id])


def find_state_dict_adapter(config: Mapping | None) -> StateDictAdapter:
    """The adapter for a `config.json`: the one whose `hf_model_types` holds its `model_type`.

    No config or no `model_type`: `identity`. A `model_type` no adapter claims is a
    `CheckpointError` naming the registered adapters and their model types.
    """
    model_type = config.get("model_type") if config else None
    if not model_type:
        return IDENTITY
    found = _entry_points()
    if model_type in found:  # the usual case, model id == model_type: load only that one
        adapter = _load(found[model_type])
        if model_type in adapter.hf_model_types:
            return adapter
    adapters = {name: _load(ep) for name, ep in sorted(found.items())}
    matches = [name for name, adapter in adapters.items() if model_type in adapter.hf_model_types]
    if len(matches) > 1:
        raise CheckpointError(
            f"config.json model_type {model_type!r} is claimed by several state-dict adapters "
            f"({', '.join(matches)}); choose one by model id"
        )
    if not matches:
        known = ", ".join(
            f"{name} (model_type {', '.join(adapter.hf_model_types) or '-'})" for name, adapter in adapters.items()
        )
        raise CheckpointError(
            f"no state-dict adapter for config.json model_type {model_type!r}; registered: identity (any names as "
            f"they are){', ' + known if known else ''}. Install the model package that registers it (entry-point group "
            f"{ENTRY_POINT_GROUP}), or choose one by model id (mm-convert --model_id; identity keeps the file names)"
        )
    return adapters[matches[0]]


def resolve_state_dict_adapter(adapter: StateDictAdapter | str | None, config: Mapping | None) -> StateDictAdapter:
    """`adapter` itself, the one registered under a model id, or (None) the one for `config`'s `model_type`."""
    if isinstance(adapter, StateDictAdapter):
        return adapter
    if adapter is None:
        return find_state_dict_adapter(config)
    return get_state_dict_adapter(adapter)
