"""One dataset row -> a checked `Conversation` (system prompt, user/assistant turns, image, video and audio paths).

Rows are role-tagged message lists; `AttrConfig` names the columns and role values,
so the mllm format (`messages` / `role` / `content`) and sharegpt
(`conversations` / `from` / `value`) are the same code; an alpaca row (`formatting: alpaca`) becomes the same
one-turn message list. With `attr.ranking: true` a row is a preference `Pair` (`parse_pair`: the conversation with
the chosen answer, and the rejected answer); with `attr.prompt_only: true` a `Prompt` for online RL (`parse_prompt`:
the conversation with an empty last answer, and the ground truth). Every structural problem
raises `BadSample` with its reason; image files are checked later by the plugin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmfsdp.data.config import AttrConfig
from mmfsdp.data.errors import BadSample

__all__ = [
    "AUDIO_PLACEHOLDER", "IMAGE_PLACEHOLDER", "SWIFT_REJECTED", "VIDEO_PLACEHOLDER", "Conversation", "Pair", "Prompt", "parse_pair",
    "parse_prompt", "parse_row",
]

IMAGE_PLACEHOLDER = "<image>"
"""Marks where an image goes in a user message; the i-th placeholder is the row's i-th image."""
VIDEO_PLACEHOLDER = "<video>"
"""Marks where a video goes in a user message; the i-th placeholder is the row's i-th video."""
AUDIO_PLACEHOLDER = "<audio>"
"""Marks where an audio clip goes in a user message; the i-th placeholder is the row's i-th clip."""
SWIFT_REJECTED = "rejected_response"
"""ms-swift's column of the rejected answer, read when the row has no `attr.rejected` column."""


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
    audios: list[str] = field(default_factory=list)
    """Audio paths as written in the row, one per `<audio>` placeholder."""


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


@dataclass(slots=True)
class Pair:
    """A preference pair: the conversation whose last answer is the chosen one, and the rejected answer."""

    conversation: Conversation
    """The prompt and the chosen answer (the last turn's assistant text)."""
    rejected: str
    """The rejected answer to the same prompt."""


def _alpaca_user(row: dict[str, Any], attr: AttrConfig) -> dict[str, Any]:
    """The user message of an alpaca row: the instruction, then the input after a newline when there is one."""
    texts = []
    for column in (attr.prompt, attr.query):
        text = row.get(column)
        if text is not None and not isinstance(text, str):
            raise BadSample("bad_content", f"column {column!r} must be a string, got {type(text).__name__}")
        if text:
            texts.append(text)
    return {attr.role_tag: attr.user_tag, attr.content_tag: "\n".join(texts)}


def _answer(value: Any, attr: AttrConfig, column: str, reason: str) -> str:
    """A pair's answer from its column: a string, or one assistant message (`{role_tag: assistant_tag, content_tag:
    text}`); missing or blank is `reason`."""
    if isinstance(value, dict):
        role = value.get(attr.role_tag, attr.assistant_tag)
        if role != attr.assistant_tag:
            raise BadSample("wrong_role_order", f"column {column!r} holds a message of role {role!r}, not an answer")
        value = value.get(attr.content_tag)
    if value is None:
        raise BadSample(reason, f"column {column!r} is missing")
    if not isinstance(value, str):
        raise BadSample("bad_content", f"column {column!r} must be a string or a message, got {type(value).__name__}")
    if not value.strip():
        raise BadSample(reason, f"column {column!r} is empty")
    return value


def parse_pair(row: dict[str, Any], attr: AttrConfig) -> Pair:
    """Check one preference row and return its pair (raises `BadSample`). The layout is found per row:

    - the messages (or alpaca's prompt) end with the user turn: the answers are the `attr.chosen` and
      `attr.rejected` columns (LLaMA-Factory's sharegpt and alpaca pairwise rows);
    - the messages end with an assistant turn, the chosen answer: the rejected one is the `attr.rejected` column or
      ms-swift's `rejected_response` (mllm and ms-swift rows).
    """
    assistant = {attr.role_tag: attr.assistant_tag}
    if attr.formatting == "alpaca":
        messages: Any = [_alpaca_user(row, attr)]
    else:
        messages = row.get(attr.messages)
        if not isinstance(messages, list) or not messages:
            parse_row(row, attr)  # raises the conversation's own reason (missing, empty or not a list)
    last = messages[-1]
    if isinstance(last, dict) and last.get(attr.role_tag) == attr.assistant_tag:
        if row.get(attr.chosen) is not None:
            raise BadSample("bad_content", f"the messages end with an answer and column {attr.chosen!r} gives another")
        chosen = _answer(last, attr, f"{attr.messages}[-1]", "missing_chosen")
        messages = messages[:-1]
    else:
        chosen = _answer(row.get(attr.chosen), attr, attr.chosen, "missing_chosen")
    rejected_column = attr.rejected if attr.rejected in row or SWIFT_REJECTED not in row else SWIFT_REJECTED
    rejected = _answer(row.get(rejected_column), attr, rejected_column, "missing_rejected")
    if chosen.strip() == rejected.strip():
        raise BadSample("identical_pair", f"the chosen and the rejected answer are the same: {chosen!r:.80}")
    placeholders = ((IMAGE_PLACEHOLDER, "image"), (VIDEO_PLACEHOLDER, "video"), (AUDIO_PLACEHOLDER, "audio"))
    for placeholder, kind in placeholders:
        if placeholder in rejected:
            detail = f"the rejected answer contains {placeholder}; {kind}s belong to user turns"
            raise BadSample(f"{kind}_in_wrong_turn", detail)
    conversation = _parse_messages([*messages, {**assistant, attr.content_tag: chosen}], row, attr)
    return Pair(conversation, rejected)


@dataclass(slots=True)
class Prompt:
    """A prompt of online RL: the conversation whose last answer is empty (the completion goes there), and the
    ground truth the rewards compare completions with."""

    conversation: Conversation
    ground_truth: Any
    """Any JSON value (a string, a number, a box)."""


SOLUTION_FALLBACK = "answer"
"""The ground-truth column read when a prompt row has no `attr.solution` column (LLaMA-Factory / ms-swift rows)."""


def parse_prompt(row: dict[str, Any], attr: AttrConfig) -> Prompt:
    """Check one prompt row and return its prompt (raises `BadSample`). The messages (or alpaca's prompt) end with
    the user turn, or with an answer, which is dropped; the ground truth is the `attr.solution` column, else
    `answer`, else the dropped answer (so SFT rows, the synthetic shapes among them, are prompts as they are)."""
    if attr.formatting == "alpaca":
        messages: Any = [_alpaca_user(row, attr)]
        answer = row.get(attr.response)
    else:
        messages = row.get(attr.messages)
        if not isinstance(messages, list) or not messages:
            parse_row(row, attr)  # raises the conversation's own reason (missing, empty or not a list)
        answer = None
        last = messages[-1]
        if isinstance(last, dict) and last.get(attr.role_tag) == attr.assistant_tag:
            answer = last.get(attr.content_tag)
            messages = messages[:-1]
    column = attr.solution if attr.solution in row else SOLUTION_FALLBACK
    truth = row.get(column, answer)
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        raise BadSample("missing_solution", f"no ground truth: column {attr.solution!r} is missing or empty and the "
                                            "messages end without an answer")
    empty = {attr.role_tag: attr.assistant_tag, attr.content_tag: ""}
    return Prompt(_parse_messages([*messages, empty], row, attr), truth)


def parse_row(row: dict[str, Any], attr: AttrConfig) -> Conversation:
    """Check one row's structure and return its conversation (raises `BadSample`)."""
    if attr.formatting == "alpaca":
        answer = {attr.role_tag: attr.assistant_tag, attr.content_tag: row.get(attr.response)}
        return _parse_messages([_alpaca_user(row, attr), answer], row, attr)
    return _parse_messages(row.get(attr.messages), row, attr)


def _parse_messages(messages: Any, row: dict[str, Any], attr: AttrConfig) -> Conversation:
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
    audios = _paths_of(row, attr.audios, "an audio")
    if not images and not videos and not audios and not any(t.strip() for t in texts):
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

    placed = (
        (IMAGE_PLACEHOLDER, images, "image"), (VIDEO_PLACEHOLDER, videos, "video"), (AUDIO_PLACEHOLDER, audios, "audio")
    )
    for placeholder, media, kind in placed:
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
    return Conversation(system=system, turns=turns, images=images, videos=videos, audios=audios)
