"""The `mistral` chat template.

`mistral` reproduces Mistral's own instruct encoding (mistral-common, v7 and later
tokenizers):

    <s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]user 1[/INST]assistant 1</s>[INST]user 2[/INST]assistant 2</s>

BOS once at the start, the system prompt (if any) once before the first turn, and
each assistant reply followed by EOS. Assistant text loses trailing spaces, as
mistral-common does.
"""

from __future__ import annotations


from mmfsdp.data.conversation import Conversation
from mmfsdp.data.templates import ControlTokens, MediaBlocks, Part, Template, register_template

__all__ = ["MistralTemplate"]


@register_template
class MistralTemplate(Template):
    """Mistral instruct (v7+): `[SYSTEM_PROMPT]`, `[INST]…[/INST]`, replies closed by `</s>`."""

    name = "mistral"
    default_plugin = "pixtral"
    bos_id, eos_id = ControlTokens("<s>"), ControlTokens("</s>")
    system_ids, user_ids = ControlTokens("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"), ControlTokens("[INST]", "[/INST]")

    def parts(self, conversation: Conversation, media: MediaBlocks) -> list[Part]:
        prompt = self.train_on_prompt
        parts: list[Part] = [("ids", [self.bos_id], prompt)]
        if conversation.system is not None:
            parts += [("ids", [self.system_ids[0]], prompt), ("text", conversation.system, prompt), ("ids", [self.system_ids[1]], prompt)]
        blocks = media.cursor()
        last = len(conversation.turns) - 1
        for i, (user, assistant) in enumerate(conversation.turns):
            parts.append(("ids", [self.user_ids[0]], prompt))
            parts += self._user_parts(user, blocks)
            parts.append(("ids", [self.user_ids[1]], prompt))
            trained = not self.mask_history or i == last
            parts += [("text", assistant.rstrip(" "), trained), ("ids", [self.eos_id], trained)]
        return parts
