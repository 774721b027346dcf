"""The `qwen3_5` chat template: Qwen3.5's ChatML, as its official chat template renders a conversation.

The official template (`chat_template.jinja` of the Qwen3.5 checkpoints; one template for every Qwen3.5 model,
thinking by default) renders what Qwen3-VL's *Thinking* template does (`qwen3_vl`), except that it trims:

- the system prompt and every user message are stripped of surrounding whitespace (the rendered content, images
  and videos in place, so only text at either end is touched);
- every answer is stripped before its think block is looked for, and the reasoning is stripped whole (Qwen3-VL's
  strips newlines only).

So the last answer (after the last user message) starts with its think block
`<think>\\n{reasoning}\\n</think>\\n\\n` (empty when the answer holds none), earlier answers keep only the text after
their `</think>`, and the block is trained with its answer. `enable_thinking: false` (LLaMA-Factory's switch)
drops every answer's reasoning and puts the empty block in the prompt, untrained; the tokens are those of the
official template for the answers without reasoning.
"""

from __future__ import annotations


from mmfsdp.data.conversation import Conversation
from mmfsdp.data.families.qwen3_vl.template import Qwen3VLTemplate
from mmfsdp.data.templates import MediaBlocks, Part, register_template

__all__ = ["Qwen3_5Template"]


@register_template
class Qwen3_5Template(Qwen3VLTemplate):
    """Qwen3-VL's thinking ChatML with the official Qwen3.5 template's trimming (module docstring)."""

    name = "qwen3_5"

    def parts(self, conversation: Conversation, media: MediaBlocks) -> list[Part]:
        trimmed = Conversation(
            system=None if conversation.system is None else conversation.system.strip(),
            turns=[(user.strip(), answer.strip()) for user, answer in conversation.turns],
            images=conversation.images,
            videos=conversation.videos,
            audios=conversation.audios,
        )
        return super().parts(trimmed, media)

    def _assistant_parts(self, answer: str, is_last: bool, trained: bool) -> list[Part]:
        if not is_last or not self.enable_thinking or self.think_close not in answer:
            return super()._assistant_parts(answer, is_last, trained)
        reasoning = answer.split(self.think_close)[0].rstrip("\n").split(self.think_open)[-1].lstrip("\n").strip()
        answer = answer.split(self.think_close)[-1].lstrip("\n")
        return [
            ("text", "assistant\n", self.train_on_prompt),
            ("ids", [self.think_ids[0]], trained),
            ("text", "\n" + reasoning + "\n", trained),
            ("ids", [self.think_ids[1]], trained),
            ("text", "\n\n" + answer, trained),
        ]
