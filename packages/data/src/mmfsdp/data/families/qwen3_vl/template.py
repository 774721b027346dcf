"""The `qwen3_vl` and `qwen3_vl_nothink` chat templates.

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
"""

from __future__ import annotations


from mmfsdp.data.conversation import Conversation
from mmfsdp.data.templates import ControlTokens, MediaBlocks, Part, Template, register_template

__all__ = ["Qwen3VLNoThinkTemplate", "Qwen3VLTemplate"]


@register_template
class Qwen3VLNoThinkTemplate(Template):
    """Qwen3-VL ChatML as the official Instruct template renders it: no think block."""

    name = "qwen3_vl_nothink"
    default_plugin = "qwen3_vl"
    start_id = ControlTokens("<|im_start|>")
    end_id = ControlTokens("<|im_end|>")

    def parts(self, conversation: Conversation, media: MediaBlocks) -> list[Part]:
        prompt = self.train_on_prompt
        start, end = ("ids", [self.start_id], prompt), ("ids", [self.end_id], prompt)
        newline = ("text", "\n", prompt)
        parts: list[Part] = []
        if conversation.system is not None:
            parts += [start, ("text", "system\n" + conversation.system, prompt), end, newline]
        blocks = media.cursor()
        last = len(conversation.turns) - 1
        for i, (user, assistant) in enumerate(conversation.turns):
            parts += [start, *self._user_parts(user, blocks, "user\n"), end, newline, start]
            trained = not self.mask_history or i == last
            parts += self._assistant_parts(assistant, i == last, trained)
            parts += [("ids", [self.end_id], trained), newline]
        return parts

    def _assistant_parts(self, answer: str, is_last: bool, trained: bool) -> list[Part]:
        """`assistant\\n` (prompt) and the answer (trained)."""
        return [("split", ("assistant\n", answer), (self.train_on_prompt, trained))]


@register_template
class Qwen3VLTemplate(Qwen3VLNoThinkTemplate):
    """Qwen3-VL ChatML as the official Thinking template renders it: the last answer opens with its think block."""

    name = "qwen3_vl"
    think_open = "<think>"
    think_close = "</think>"
    think_ids = ControlTokens(think_open, think_close)

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
