"""Chat templates: a conversation -> token ids and labels, one encoder class per format, registry keyed by the YAML name.

A template is a `Template` subclass registered under the name users write in
`preprocess_parameters.template`; it names its default image plugin and encodes a
`Conversation` (with each image already expanded into its plugin's token block) into
`(input_ids, labels)`. Control tokens are inserted as ids; only the text between them
goes through the tokenizer, one call per run of text, so the ids equal tokenizing the
rendered string.

Labels are `-100` except on assistant text and its end token. `train_on_prompt` also trains on every other text
and control token; `mask_history` trains only on the last assistant reply. Image, video and audio blocks are always
`-100`. Each family's templates live in its folder (`mmfsdp.data.families.<name>.template`) and register when
the registry is first asked (entry-point group `mmfsdp.data_families`); docs/data.md describes each format.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import ClassVar, Iterator, Sequence

from mmfsdp.config import Registry

from mmfsdp.data.conversation import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation
from mmfsdp.data.processor import MMProcessor

__all__ = [
    "IGNORE_INDEX",
    "ControlTokens",
    "MediaBlocks",
    "Template",
    "get_template",
    "register_template",
    "template_names",
]

IGNORE_INDEX = -100
_PLACEHOLDERS = re.compile("(" + "|".join(map(re.escape, (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER))) + ")")

# A template describes a conversation as parts, assembled by `Template._assemble`:
#   ("ids", [token ids], trained)           control tokens
#   ("text", "text", trained)               one run of text between control tokens
#   ("image", [token ids], False)           an image, video or audio block (never trained)
#   ("split", ("head", "tail"), (h, t))     one run of text whose head and tail train differently
Part = tuple[str, object, object]


class ControlTokens:
    """A template's class attribute naming control tokens by their text, e.g. `eos_id = ControlTokens("</s>")`:
    `Template.__init__` replaces it on the instance by their ids in the processor's vocabulary (one token: its
    id; several: a tuple of ids), so a token the tokenizer does not have fails when the template is built."""

    def __init__(self, *texts: str):
        self.texts = texts


@dataclass(frozen=True)
class MediaBlocks:
    """The token blocks of a conversation's media, each already expanded by the plugin: the i-th `<image>` of the
    conversation becomes `images[i]`, the i-th `<video>` `videos[i]`, the i-th `<audio>` `audios[i]`. One object, so a
    template's signature does not change when a kind of media is added."""

    images: Sequence[list[int]] = ()
    videos: Sequence[list[int]] = ()
    audios: Sequence[list[int]] = ()

    def check(self, conversation: Conversation) -> None:
        """One block per placeholder of each kind (the encoder reads one grid per media file)."""
        counts = (len(self.images), len(self.videos), len(self.audios))
        wanted = (len(conversation.images), len(conversation.videos), len(conversation.audios))
        assert counts == wanted, f"media blocks (images, videos, audios) {counts} for a conversation with {wanted}"

    def cursor(self) -> dict[str, Iterator[list[int]]]:
        """Placeholder -> an iterator over its blocks; a template shares one cursor between the turns of a
        conversation (`Template._user_parts`), so the i-th placeholder of a kind takes its i-th block."""
        return {
            IMAGE_PLACEHOLDER: iter(self.images), VIDEO_PLACEHOLDER: iter(self.videos), AUDIO_PLACEHOLDER: iter(self.audios),
        }


NO_MEDIA = MediaBlocks()
"""The blocks of a text-only conversation."""


class Template(ABC):
    """A chat format bound to one tokenizer: `encode(conversation, media)` -> (input_ids, labels)."""

    name: ClassVar[str]
    """The name users write in `preprocess_parameters.template`."""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Optional: other names that select it (older or alternative spellings users' YAML has)."""
    default_plugin: ClassVar[str]
    """The image plugin used when `preprocess_parameters.image_plugin` is null."""

    def __init__(
        self, processor: MMProcessor, *, train_on_prompt: bool = False, mask_history: bool = False, enable_thinking: bool = True,
    ):
        self.processor = processor
        self.train_on_prompt = train_on_prompt
        self.mask_history = mask_history
        self.enable_thinking = enable_thinking
        """Used by templates with a think block; the others ignore it."""
        for name in dir(type(self)):
            tokens = getattr(type(self), name)
            if isinstance(tokens, ControlTokens):
                ids = tuple(processor.token_id(text) for text in tokens.texts)
                setattr(self, name, ids if len(ids) > 1 else ids[0])

    @abstractmethod
    def parts(self, conversation: Conversation, media: MediaBlocks) -> list[Part]:
        """The parts of `conversation` (the comment above `Part`), each media placeholder replaced by its block
        (`media`; `encode` and `encode_pair` have checked there is one block each)."""

    def encode(self, conversation: Conversation, media: MediaBlocks = NO_MEDIA) -> tuple[list[int], list[int]]:
        """Ids and labels of `conversation`, each media placeholder replaced by its block of `media`."""
        media.check(conversation)
        return self._assemble(self.parts(conversation, media))

    def encode_pair(
        self, conversation: Conversation, rejected: str, media: MediaBlocks = NO_MEDIA,
    ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """(ids, labels) of `conversation` (its last answer the chosen one) and of the same with `rejected` as the
        last answer, each equal to `encode` of its conversation. The parts the two share (the prompt) are
        tokenized once, and the text of all three runs goes through one batched tokenizer call."""
        media.check(conversation)
        last_user = conversation.turns[-1][0]
        other = replace(conversation, turns=[*conversation.turns[:-1], (last_user, rejected)])
        chosen_parts = self.parts(conversation, media)
        rejected_parts = self.parts(other, media)
        shared = next(
            (k for k, (a, b) in enumerate(zip(chosen_parts, rejected_parts)) if a != b),
            min(len(chosen_parts), len(rejected_parts)),
        )
        runs = [chosen_parts[:shared], chosen_parts[shared:], rejected_parts[shared:]]
        encoded = iter(self.processor.encode_texts([text for run in runs for text in _texts(run)]))
        (prompt_ids, prompt_labels), chosen, rejected_out = (self._build(run, encoded) for run in runs)
        return (
            (prompt_ids + chosen[0], prompt_labels + chosen[1]),
            (prompt_ids + rejected_out[0], prompt_labels + rejected_out[1]),
        )

    def fingerprint(self) -> list[object]:
        """What of the template changes the tokens (part of the dataset cache key)."""
        return [self.name, self.train_on_prompt, self.mask_history]

    def _user_parts(self, user: str, blocks: dict[str, Iterator[list[int]]], prefix: str = "") -> list[Part]:
        """A user message's text runs with its media blocks in place of the placeholders; `blocks` is the
        conversation's `MediaBlocks.cursor()`, shared by its turns."""
        parts: list[Part] = []
        for j, piece in enumerate(_PLACEHOLDERS.split(user)):
            if j % 2:
                parts.append(("image", next(blocks[piece]), False))
            else:
                parts.append(("text", prefix + piece if j == 0 else piece, self.train_on_prompt))
        return parts

    def _assemble(self, parts: list[Part]) -> tuple[list[int], list[int]]:
        """Ids and labels of `parts`, with all text encoded in one batched tokenizer call.

        A "split" run is encoded whole (as the tokenizer sees it in the rendered
        string); its head is the longest prefix of those ids that the head alone
        encodes to, plus the token straddling the boundary if there is one.
        """
        return self._build(parts, iter(self.processor.encode_texts(_texts(parts))))

    def _build(self, parts: list[Part], encoded: Iterator[list[int]]) -> tuple[list[int], list[int]]:
        """Ids and labels of `parts`, taking the ids of their texts (`_texts`) in turn from `encoded`."""
        input_ids: list[int] = []
        labels: list[int] = []
        for kind, payload, trained in parts:
            if kind == "split":
                head_ids, ids = next(encoded), next(encoded)
                cut = next((k for k, (a, b) in enumerate(zip(head_ids, ids)) if a != b), min(len(head_ids), len(ids)))
                cut += cut < len(head_ids)
                head_trained, tail_trained = trained
                input_ids += ids
                labels += [t if head_trained else IGNORE_INDEX for t in ids[:cut]] + [t if tail_trained else IGNORE_INDEX for t in ids[cut:]]
                continue
            ids = next(encoded) if kind == "text" else payload
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
        return input_ids, labels


def _texts(parts: list[Part]) -> list[str]:
    """The texts `parts` tokenize, in order: one per "text" run, the head and then head + tail per "split" run."""
    texts: list[str] = []
    for kind, payload, _ in parts:
        if kind == "text":
            texts.append(payload)
        elif kind == "split":
            head, tail = payload
            texts += [head, head + tail]
    return texts


_TEMPLATES: Registry[type[Template]] = Registry(
    "template", "data.dataset_param.preprocess_parameters.template", entry_point_group="mmfsdp.data_families"
)


def register_template(cls: type[Template]) -> type[Template]:
    return _TEMPLATES.register(cls.name, cls, aliases=getattr(cls, "aliases", ()))


def template_names() -> list[str]:
    return _TEMPLATES.names()


def get_template(name: str) -> type[Template]:
    return _TEMPLATES.get(name)
