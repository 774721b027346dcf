"""Chat templates: a conversation -> token ids and labels, one encoder class per format, registry keyed by the YAML name.

A template is a `Template` subclass registered under the name users write in
`preprocess_parameters.template`; it names its default image plugin and encodes a
`Conversation` (with each image already expanded into its plugin's token block) into
`(input_ids, labels)`. Control tokens are inserted as ids; only the text between them
goes through the tokenizer, one call per run of text, so the ids equal tokenizing the
rendered string.

`mistral` reproduces Mistral's own instruct encoding (mistral-common, v7 and later
tokenizers):

    <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user 1[/INST]assistant 1</s>[INST]user 2[/INST]assistant 2</s>

BOS once at the start, the system prompt (if any) once before the first turn, and
each assistant reply followed by EOS. Assistant text loses trailing spaces, as
mistral-common does.

`qwen3_vl_nothink` and `qwen3_vl` are Qwen3-VL's ChatML, as the official chat
templates render it (the names and their meaning are LLaMA-Factory's, which
MindSpeed-MM configs use):

    <|im_start|>system\\nsystem<|im_end|>\\n<|im_start|>user\\nuser 1<|im_end|>\\n<|im_start|>assistant\\nassistant 1<|im_end|>\\n...

- `qwen3_vl_nothink` is the Qwen3-VL *Instruct* template: no think block (for Instruct models).
- `qwen3_vl` is the Qwen3-VL *Thinking* template: the last answer (the one after the
  last user message) starts with its think block, `<think>\\n{reasoning}\\n</think>\\n\\n`,
  empty when the answer holds none; earlier answers keep only the text after their
  `</think>` (the template drops old reasoning). The block is trained with its answer.
  With `enable_thinking: false` (LLaMA-Factory's switch, which MindSpeed-MM configs
  carry) every answer's reasoning is dropped and the last answer follows an empty
  block, `<think>\\n\\n</think>\\n\\n`, that belongs to the prompt (untrained).
  `qwen3_vl_nothink` and `mistral` have no think block and ignore the switch.

Labels are `-100` except on assistant text and its end token (`</s>`, `<|im_end|>`).
`train_on_prompt` also trains on every other text and control token; `mask_history`
trains only on the last assistant reply. Image and video blocks (Qwen3-VL's frame timestamps included) are
always `-100`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import ClassVar, Iterator, Sequence

from mmfsdp.config import Registry

from mmfsdp.data.conversation import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation
from mmfsdp.data.processor import MMProcessor

__all__ = [
    "IGNORE_INDEX",
    "MistralTemplate",
    "Qwen3VLNoThinkTemplate",
    "Qwen3VLTemplate",
    "Template",
    "get_template",
    "register_template",
    "template_names",
]

IGNORE_INDEX = -100
_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")

# A template describes a conversation as parts, assembled by `Template._assemble`:
#   ("ids", [token ids], trained)           control tokens
#   ("text", "text", trained)               one run of text between control tokens
#   ("image", [token ids], False)           an image or video block (never trained)
#   ("split", ("head", "tail"), (h, t))     one run of text whose head and tail train differently
Part = tuple[str, object, object]


class Template(ABC):
    """A chat format bound to one tokenizer: `encode(conversation, image_blocks)` -> (input_ids, labels)."""

    name: ClassVar[str]
    """The name users write in `preprocess_parameters.template`."""
    default_plugin: ClassVar[str]
    """The image plugin used when `preprocess_parameters.image_plugin` is null."""

    def __init__(
        self, processor: MMProcessor, *, train_on_prompt: bool = False, mask_history: bool = False, enable_thinking: bool = True,
    ):
        self.processor = processor
        self.train_on_prompt = train_on_prompt
        self.mask_history = mask_history
        self.enable_thinking = enable_thinking
        """Used by templates with a think block (`qwen3_vl`); the others ignore it."""

    @abstractmethod
    def encode(
        self, conversation: Conversation, image_blocks: list[list[int]], video_blocks: Sequence[list[int]] = ()
    ) -> tuple[list[int], list[int]]:
        """Ids and labels of `conversation`; the i-th `<image>` becomes `image_blocks[i]`, the i-th `<video>`
        `video_blocks[i]`."""

    def fingerprint(self) -> list[object]:
        """What of the template changes the tokens (part of the dataset cache key)."""
        return [self.name, self.train_on_prompt, self.mask_history]

    def _user_parts(
        self, user: str, images: Iterator[list[int]], videos: Iterator[list[int]], prefix: str = ""
    ) -> list[Part]:
        """A user message's text runs with its image and video blocks in place of the placeholders."""
        parts: list[Part] = []
        for j, piece in enumerate(_PLACEHOLDERS.split(user)):
            if j % 2:
                parts.append(("image", next(images if piece == IMAGE_PLACEHOLDER else videos), False))
            else:
                parts.append(("text", prefix + piece if j == 0 else piece, self.train_on_prompt))
        return parts

    def _assemble(self, parts: list[Part]) -> tuple[list[int], list[int]]:
        """Ids and labels of `parts`, with all text encoded in one batched tokenizer call.

        A "split" run is encoded whole (as the tokenizer sees it in the rendered
        string); its head is the longest prefix of those ids that the head alone
        encodes to, plus the token straddling the boundary if there is one.
        """
        texts: list[str] = []
        for kind, payload, _ in parts:
            if kind == "text":
                texts.append(payload)
            elif kind == "split":
                head, tail = payload
                texts += [head, head + tail]
        encoded = iter(self.processor.encode_texts(texts))
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


_TEMPLATES: Registry[type[Template]] = Registry("template", "data.dataset_param.preprocess_parameters.template")


def register_template(cls: type[Template]) -> type[Template]:
    return _TEMPLATES.register(cls.name, cls)


def template_names() -> list[str]:
    return _TEMPLATES.names()


def get_template(name: str) -> type[Template]:
    return _TEMPLATES.get(name)


@register_template
class MistralTemplate(Template):
    """Mistral instruct (v7+): `[SYSTEM_PROMPT]`, `[INST]…[/INST]`, replies closed by `</s>`."""

    name = "mistral"
    default_plugin = "pixtral"
    bos = "<s>"
    eos = "</s>"
    system_prefix = "[SYSTEM_PROMPT]"
    system_suffix = "[/SYSTEM_PROMPT]"
    user_prefix = "[INST]"
    user_suffix = "[/INST]"

    def __init__(self, processor: MMProcessor, **options: bool):
        super().__init__(processor, **options)
        tid = processor.token_id
        self.bos_id = tid(self.bos)
        self.eos_id = tid(self.eos)
        self.system_ids = (tid(self.system_prefix), tid(self.system_suffix))
        self.user_ids = (tid(self.user_prefix), tid(self.user_suffix))

    def encode(
        self, conversation: Conversation, image_blocks: list[list[int]], video_blocks: Sequence[list[int]] = ()
    ) -> tuple[list[int], list[int]]:
        assert len(image_blocks) == len(conversation.images) and len(video_blocks) == len(conversation.videos)
        prompt = self.train_on_prompt
        parts: list[Part] = [("ids", [self.bos_id], prompt)]
        if conversation.system is not None:
            parts += [("ids", [self.system_ids[0]], prompt), ("text", conversation.system, prompt), ("ids", [self.system_ids[1]], prompt)]
        images, videos = iter(image_blocks), iter(video_blocks)
        last = len(conversation.turns) - 1
        for i, (user, assistant) in enumerate(conversation.turns):
            parts.append(("ids", [self.user_ids[0]], prompt))
            parts += self._user_parts(user, images, videos)
            parts.append(("ids", [self.user_ids[1]], prompt))
            trained = not self.mask_history or i == last
            parts += [("text", assistant.rstrip(" "), trained), ("ids", [self.eos_id], trained)]
        return self._assemble(parts)


@register_template
class Qwen3VLNoThinkTemplate(Template):
    """Qwen3-VL ChatML as the official Instruct template renders it: no think block."""

    name = "qwen3_vl_nothink"
    default_plugin = "qwen2_vl"
    im_start = "<|im_start|>"
    im_end = "<|im_end|>"

    def __init__(self, processor: MMProcessor, **options: bool):
        super().__init__(processor, **options)
        self.start_id = processor.token_id(self.im_start)
        self.end_id = processor.token_id(self.im_end)

    def encode(
        self, conversation: Conversation, image_blocks: list[list[int]], video_blocks: Sequence[list[int]] = ()
    ) -> tuple[list[int], list[int]]:
        assert len(image_blocks) == len(conversation.images) and len(video_blocks) == len(conversation.videos)
        prompt = self.train_on_prompt
        start, end = ("ids", [self.start_id], prompt), ("ids", [self.end_id], prompt)
        newline = ("text", "\n", prompt)
        parts: list[Part] = []
        if conversation.system is not None:
            parts += [start, ("text", "system\n" + conversation.system, prompt), end, newline]
        images, videos = iter(image_blocks), iter(video_blocks)
        last = len(conversation.turns) - 1
        for i, (user, assistant) in enumerate(conversation.turns):
            parts += [start, *self._user_parts(user, images, videos, prefix="user\n"), end, newline, start]
            trained = not self.mask_history or i == last
            parts += self._assistant_parts(assistant, i == last, trained)
            parts += [("ids", [self.end_id], trained), newline]
        return self._assemble(parts)

    def _assistant_parts(self, answer: str, is_last: bool, trained: bool) -> list[Part]:
        """`assistant\\n` (prompt) and the answer (trained)."""
        return [("split", ("assistant\n", answer), (self.train_on_prompt, trained))]


@register_template
class Qwen3VLTemplate(Qwen3VLNoThinkTemplate):
    """Qwen3-VL ChatML as the official Thinking template renders it: the last answer opens with its think block."""

    name = "qwen3_vl"
    think_open = "<think>"
    think_close = "</think>"

    def __init__(self, processor: MMProcessor, **options: bool):
        super().__init__(processor, **options)
        self.think_ids = (processor.token_id(self.think_open), processor.token_id(self.think_close))

    def fingerprint(self) -> list[object]:
        return [*super().fingerprint(), self.enable_thinking]

    def _assistant_parts(self, answer: str, is_last: bool, trained: bool) -> list[Part]:
        reasoning = ""
        if self.think_close in answer:
            reasoning = answer.split(self.think_close)[0].rstrip("\n").split(self.think_open)[-1].lstrip("\n")
            answer = answer.split(self.think_close)[-1].lstrip("\n")
        if not is_last:
            return super()._assistant_parts(answer, is_last, trained)
        if not self.enable_thinking:  # the reasoning is dropped; an empty block ends the prompt
            prompt = self.train_on_prompt
            return [
                ("text", "assistant\n", prompt),
                ("ids", [self.think_ids[0]], prompt),
                ("text", "\n\n", prompt),
                ("ids", [self.think_ids[1]], prompt),
                ("split", ("\n\n", answer.lstrip("\n")), (prompt, trained)),
            ]
        return [
            ("text", "assistant\n", self.train_on_prompt),
            ("ids", [self.think_ids[0]], trained),
            ("text", "\n" + reasoning.strip("\n") + "\n", trained),
            ("ids", [self.think_ids[1]], trained),
            ("text", "\n\n" + answer.lstrip("\n"), trained),
        ]
