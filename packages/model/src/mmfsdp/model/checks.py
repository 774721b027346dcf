"""Checks of a config's choices against a family's declarations (`mmfsdp.model.spec.ModelEntry`), before any
process starts; the parallel layout's are the spec's `validate_parallel` hook (`Capabilities.check_parallel` by
default)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmfsdp.config import ConfigError

if TYPE_CHECKING:
    from mmfsdp.model.spec import ModelEntry

__all__ = ["check_data"]


def check_data(
    entry: ModelEntry,
    *,
    template: str | None,
    image_plugin: str | None,
    collator: str | None,
    packing: bool,
    videos: bool = False,
    padding_free: bool = False,
) -> list[ConfigError]:
    """The data choices of a config against the family's declarations: each of template, image plugin (the
    configured one, or the template's default) and collator must be one the family lists in `data` (None:
    not checked), packing and padding-free micro-batches need `capabilities.packing` and a video column
    (`videos`) `capabilities.video`.
    One `ConfigError` per problem, naming the key."""
    pre = "data.dataset_param.preprocess_parameters"
    model_id, capabilities = entry.model_id, entry.capabilities
    errors = []
    for key, kind, name, field in (
        (f"{pre}.template", "template", template, "templates"),
        (f"{pre}.image_plugin", "image plugin", image_plugin, "image_plugins"),
        ("data.dataloader_param.collate_param.model_name", "collator", collator, "collators"),
    ):
        names = getattr(entry.data, field)
        if name is not None and name not in names:
            fits = f"set it to {' or '.join(map(repr, names))}" if names else f"its entry lists no {field}"
            errors.append(ConfigError(key, f"{kind} {name!r} is not for model_id {model_id!r}; {fits}"))
    if packing and not capabilities.packing:
        errors.append(ConfigError(
            "data.dataset_param.basic_parameters.packing",
            f"true, but model_id {model_id!r} does not support packed rows (its entry does not declare "
            "capabilities.packing); set it to false",
        ))
    if padding_free and not packing and not capabilities.packing:
        errors.append(ConfigError(
            "data.dataloader_param.padding_free",
            f"true, but model_id {model_id!r} does not support packed rows (its entry does not declare "
            "capabilities.packing), which padding-free micro-batches are; set it to false or leave it null",
        ))
    if videos and not capabilities.video:
        errors.append(ConfigError(
            "data.dataset_param.attr.videos",
            f"is set, but model_id {model_id!r} takes no video input (its entry does not declare "
            "capabilities.video); set it to null and drop the video rows",
        ))
    return errors
