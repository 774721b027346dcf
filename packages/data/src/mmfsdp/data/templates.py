"""Chat templates: a conversation -> token ids and labels, registry keyed by the YAML name.

A `TemplateSpec` names the control tokens around each part of a conversation; the
`mistral` one reproduces Mistral's own instruct encoding (mistral-common, v7 and
later tokenizers):

    <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user 1[/INST]assistant 1</s>[INST]user 2[/INST]assistant 2</s>

BOS once at the start, the system prompt (if any) once before the first turn, and
each assistant reply followed by EOS. Assistant text loses trailing spaces, as
mistral-common does. Control tokens are inserted as ids; only the text between
them goes through the tokenizer, so ids equal tokenizing the rendered string.

Labels are `-100` except on assistant text and its EOS. `train_on_prompt` also
trains on BOS, system and user text; `mask_history` trains only on the last
assistant reply. Image tokens are always `-100`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmfsdp.config import Registry

from mmfsdp.data.conversation import IMAGE_PLACEHOLDER, Conversation
from mmfsdp.data.processor import MMProcessor

__all__ = ["IGNORE_INDEX", "TemplateEncoder", "TemplateSpec", "get_template", "register_template", "template_names"]

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class TemplateSpec:
    """The control tokens of one chat format."""

    name: str
    default_plugin: str
    bos: str
    eos: str
    system_prefix: str
    system_suffix: str
    user_prefix: str
    user_suffix: str


_TEMPLATES: Registry[TemplateSpec] = Registry("template", "data.dataset_param.preprocess_parameters.template")


def register_template(spec: TemplateSpec) -> TemplateSpec:
    return _TEMPLATES.register(spec.name, spec)


def template_names() -> list[str]:
    return _TEMPLATES.names()


def get_template(name: str) -> TemplateSpec:
    return _TEMPLATES.get(name)


register_template(
    TemplateSpec(
        name="mistral",
        default_plugin="pixtral",
        bos="<s>",
        eos="</s>",
        system_prefix="[SYSTEM_PROMPT]",
        system_suffix="[/SYSTEM_PROMPT]",
        user_prefix="[INST]",
        user_suffix="[/INST]",
    )
)


class TemplateEncoder:
    """A `TemplateSpec` bound to one tokenizer: encodes conversations to (input_ids, labels)."""

    def __init__(self, spec: TemplateSpec, processor: MMProcessor, *, train_on_prompt: bool = False, mask_history: bool = False):
        self.spec = spec
        self.processor = processor
        self.train_on_prompt = train_on_prompt
        self.mask_history = mask_history
        tid = processor.token_id
        self.bos_id = tid(spec.bos)
        self.eos_id = tid(spec.eos)
        self.system_ids = (tid(spec.system_prefix), tid(spec.system_suffix))
        self.user_ids = (tid(spec.user_prefix), tid(spec.user_suffix))

    def encode(self, conversation: Conversation, image_blocks: list[list[int]]) -> tuple[list[int], list[int]]:
        """Ids and labels of `conversation`; the i-th placeholder becomes `image_blocks[i]`."""
        assert len(image_blocks) == len(conversation.images)
        # Parts are (kind, payload, trained): kind "ids" carries token ids, "text" a string
        # encoded below in one batched tokenizer call, "image" an image block (never trained).
        prompt = self.train_on_prompt
        parts: list[tuple[str, object, bool]] = [("ids", [self.bos_id], prompt)]
        if conversation.system is not None:
            parts += [("ids", [self.system_ids[0]], prompt), ("text", conversation.system, prompt), ("ids", [self.system_ids[1]], prompt)]
        images = iter(image_blocks)
        last = len(conversation.turns) - 1
        for i, (user, assistant) in enumerate(conversation.turns):
            parts.append(("ids", [self.user_ids[0]], prompt))
            pieces = user.split(IMAGE_PLACEHOLDER)
            for j, piece in enumerate(pieces):
                if j:
                    parts.append(("image", next(images), False))
                parts.append(("text", piece, prompt))
            parts.append(("ids", [self.user_ids[1]], prompt))
            trained = not self.mask_history or i == last
            parts += [("text", assistant.rstrip(" "), trained), ("ids", [self.eos_id], trained)]

        texts = [payload for kind, payload, _ in parts if kind == "text"]
        encoded = iter(self.processor.encode_texts(texts))
        input_ids: list[int] = []
        labels: list[int] = []
        for kind, payload, trained in parts:
            ids = next(encoded) if kind == "text" else payload
            input_ids += ids
            labels += ids if trained else [IGNORE_INDEX] * len(ids)
        return input_ids, labels
