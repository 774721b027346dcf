"""One dataset row -> a checked `Conversation` (system prompt, user/assistant turns, image paths).

Rows are role-tagged message lists; `AttrConfig` names the columns and role values,
so the mllm format (`messages` / `role` / `content`) and sharegpt
(`conversations` / `from` / `value`) are the same code. Every structural problem
raises `BadSample` with its reason; image files are checked later by the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmfsdp.data.config import AttrConfig
from mmfsdp.data.errors import BadSample

__all__ = ["IMAGE_PLACEHOLDER", "Conversation", "parse_row"]

IMAGE_PLACEHOLDER = "<image>"
"""Marks where an image goes in a user message; the i-th placeholder is the row's i-th image."""


@dataclass(slots=True)
class Conversation:
    system: str | None
    """The system prompt, if any."""
    turns: list[tuple[str, str]]
    """(user text, assistant text) pairs in order; user text may hold image placeholders."""
    images: list[str]
    """Image paths as written in the row, one per placeholder."""


def _images_of(row: dict[str, Any], attr: AttrConfig) -> list[str]:
    if attr.images is None:
        return []
    value = row.get(attr.images)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise BadSample("bad_content", f"column {attr.images!r} must be an image path or a list of paths, got {value!r:.80}")
    return list(value)


def parse_row(row: dict[str, Any], attr: AttrConfig) -> Conversation:
    """Check one row's structure and return its conversation (raises `BadSample`)."""
    messages = row.get(attr.messages)
    if messages is None or (isinstance(messages, list) and not messages):
        raise BadSample("empty_conversation", f"column {attr.messages!r} is missing or empty")
    if not isinstance(messages, list):
        raise BadSample("bad_content", f"column {attr.messages!r} must be a list of messages, got {type(messages).__name__}")

    roles: list[str] = []
    texts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadSample("bad_content", f"message {i} is not a mapping")
        role, text = message.get(attr.role_tag), message.get(attr.content_tag)
        if not isinstance(text, str):
            raise BadSample("bad_content", f"message {i} has no string {attr.content_tag!r} (got {type(text).__name__})")
        if role == attr.user_tag:
            roles.append("user")
        elif role == attr.assistant_tag:
            roles.append("assistant")
        elif attr.system_tag is not None and role == attr.system_tag:
            roles.append("system")
        else:
            raise BadSample("wrong_role_order", f"message {i} has unknown role {role!r}")
        texts.append(text)

    images = _images_of(row, attr)
    if not images and not any(t.strip() for t in texts):
        raise BadSample("empty_conversation", "every message is empty")

    system = None
    if attr.system is not None and isinstance(row.get(attr.system), str) and row[attr.system]:
        system = row[attr.system]
    if roles[0] == "system":
        if system is not None:
            raise BadSample("wrong_role_order", f"both column {attr.system!r} and a system message give a system prompt")
        system = texts[0]
        roles, texts = roles[1:], texts[1:]
    if "system" in roles:
        raise BadSample("wrong_role_order", "a system message is allowed only as the first message")
    if "assistant" not in roles:
        raise BadSample("no_assistant_turn", "the conversation has no assistant message")
    expected = ["user", "assistant"] * ((len(roles) + 1) // 2)
    if roles != expected[: len(roles)] or len(roles) % 2:
        raise BadSample("wrong_role_order", f"roles must alternate user, assistant, ... and end with assistant; got {', '.join(roles)}")

    if system is not None and IMAGE_PLACEHOLDER in system:
        raise BadSample("image_in_wrong_turn", f"the system prompt contains {IMAGE_PLACEHOLDER}")
    if any(IMAGE_PLACEHOLDER in texts[i] for i in range(1, len(texts), 2)):
        raise BadSample("image_in_wrong_turn", f"an assistant message contains {IMAGE_PLACEHOLDER}; images belong to user turns")
    num_placeholders = sum(texts[i].count(IMAGE_PLACEHOLDER) for i in range(0, len(texts), 2))
    if num_placeholders != len(images):
        raise BadSample("image_count_mismatch", f"{num_placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s)")

    turns = [(texts[i], texts[i + 1]) for i in range(0, len(texts), 2)]
    return Conversation(system=system, turns=turns, images=images)
