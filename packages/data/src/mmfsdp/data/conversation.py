"""One dataset row -> a checked `Conversation` (system prompt, user/assistant turns, image and video paths).

Rows are role-tagged message lists; `AttrConfig` names the columns and role values,
so the mllm format (`messages` / `role` / `content`) and sharegpt
(`conversations` / `from` / `value`) are the same code. Every structural problem
raises `BadSample` with its reason; image files are checked later by the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmfsdp.data.config import AttrConfig
from mmfsdp.data.errors import BadSample

__all__ = ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "Conversation", "parse_row"]

IMAGE_PLACEHOLDER = "<image>"
"""Marks where an image goes in a user message; the i-th placeholder is the row's i-th image."""
VIDEO_PLACEHOLDER = "<video>"
"""Marks where a video goes in a user message; the i-th placeholder is the row's i-th video."""


@dataclass(slots=True)
class Conversation:
    system: str | None
    """The system prompt, if any."""
    turns: list[tuple[str, str]]
    """(user text, assistant text) pairs in order; user text may hold image placeholders."""
    images: list[str]
    """Image paths as written in the row, one per placeholder."""
    videos: list[str] = field(default_factory=list)
    """Video paths as written in the row, one per `<video>` placeholder."""


def _paths_of(row: dict[str, Any], column: str | None, kind: str) -> list[str]:
    if column is None:
        return []
    value = row.get(column)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise BadSample("bad_content", f"column {column!r} must be {kind} path or a list of paths, got {value!r:.80}")
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

    images = _paths_of(row, attr.images, "an image")
    videos = _paths_of(row, attr.videos, "a video")
    if not images and not videos and not any(t.strip() for t in texts):
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

    for placeholder, media, kind in ((IMAGE_PLACEHOLDER, images, "image"), (VIDEO_PLACEHOLDER, videos, "video")):
        if system is not None and placeholder in system:
            raise BadSample(f"{kind}_in_wrong_turn", f"the system prompt contains {placeholder}")
        if any(placeholder in texts[i] for i in range(1, len(texts), 2)):
            detail = f"an assistant message contains {placeholder}; {kind}s belong to user turns"
            raise BadSample(f"{kind}_in_wrong_turn", detail)
        num_placeholders = sum(texts[i].count(placeholder) for i in range(0, len(texts), 2))
        if num_placeholders != len(media):
            detail = f"{num_placeholders} {placeholder} placeholder(s) but {len(media)} {kind}(s)"
            raise BadSample(f"{kind}_count_mismatch", detail)

    turns = [(texts[i], texts[i + 1]) for i in range(0, len(texts), 2)]
    return Conversation(system=system, turns=turns, images=images, videos=videos)
