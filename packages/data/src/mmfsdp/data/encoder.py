"""`SampleEncoder`: one raw row -> its tokenized sample (preprocessing), and a sample's media -> pixels (workers).

`encode_row` parses the conversation, reads each image's header for its grid (an opaque tuple of ints from the
plugin), each video's headers for its sampled frames and grid and decodes each audio clip for its length and grid,
expands placeholders into the plugin's image, video and audio tokens, applies the template and labels, and
truncates at `cutoff_len`; a row that cannot be used raises `BadSample` with its reason (`encode_batch` keeps the reason instead of tokens). With `attr.ranking: true` a row is
a preference pair, encoded with its prompt tokenized once (`encode_pair`); with `attr.prompt_only: true` a prompt
for online RL (`encode_prompt`: the tokens a completion follows, and the ground truth). `fingerprint` hashes everything that
changes the tokens: the key of the token cache (`mmfsdp.data.token_cache`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mmfsdp.config import to_dict

from mmfsdp.data.build import build_plugin
from mmfsdp.data.config import DataConfig
from mmfsdp.data.conversation import Conversation, parse_pair, parse_prompt, parse_row
from mmfsdp.data.errors import BadSample
from mmfsdp.data.json_rows import INVALID_ROW
from mmfsdp.data.paths import media_path
from mmfsdp.data.processor import MMProcessor
from mmfsdp.data.templates import IGNORE_INDEX, MediaBlocks, get_template

__all__ = ["SampleEncoder", "answer_start"]

_PREPROCESS_VERSION = 5
"""Bump when the tokenized layout or the encoding rules change, to invalidate old caches."""
_EMPTY_SAMPLE = {
    "input_ids": [], "labels": [], "images": [], "image_grids": [], "videos": [], "video_grids": [], "audios": [],
    "audio_grids": [], "absolute_images": 0,
}
"""The token columns of a bad row (and, with the counts, the columns of the tokenized table)."""
_EMPTY_PAIR = {**_EMPTY_SAMPLE, "rejected_ids": [], "rejected_labels": [], "prompt_length": 0}
"""The token columns of a bad row of preference data: the chosen sequence in `input_ids`/`labels`, the rejected
one's tokens after the shared prompt (its first `prompt_length` tokens) in `rejected_ids`/`rejected_labels`."""
_EMPTY_PROMPT = {**_EMPTY_SAMPLE, "solution": "null", "prompt_text": ""}
"""The token columns of a bad row of prompt data: the prompt's tokens in `input_ids` (`labels` all ignored), the
ground truth as JSON in `solution`, the last user message in `prompt_text` (what reward functions get as prompt)."""


def answer_start(labels: list[int]) -> int:
    """Where the last answer's trained tokens start: the start of the last run of trained labels (an empty last
    answer's run is its end token(s), a thinking template's empty think block with them)."""
    trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    if not trained:
        raise BadSample("no_assistant_turn", "the template trains no token of the last answer")
    start = trained[-1]
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start


class SampleEncoder:
    """Turns a raw row into a tokenized sample (preprocessing) and a sample's image paths into pixels (workers)."""

    def __init__(self, data_cfg: DataConfig, processor: MMProcessor):
        pp = data_cfg.dataset_param.preprocess_parameters
        template_cls = get_template(pp.template)
        self.processor = processor
        self.attr = data_cfg.dataset_param.attr
        self.ranking = self.attr.ranking
        """Preference data: a row is a pair (`encode_pair`)."""
        self.prompt_only = self.attr.prompt_only
        """Prompt data (online RL): a row is a prompt and its ground truth (`encode_prompt`)."""
        self.cutoff_len = pp.cutoff_len
        self.dataset_dir = Path(data_cfg.dataset_param.basic_parameters.dataset_dir).expanduser().resolve()
        self.allow_outside = data_cfg.dataset_param.basic_parameters.allow_paths_outside_dataset_dir
        self.template = template_cls(
            processor, train_on_prompt=pp.train_on_prompt, mask_history=pp.mask_history, enable_thinking=pp.enable_thinking,
        )
        self.plugin = build_plugin(data_cfg, processor)

    def image_path(self, path: str) -> str:
        """Where image `path` of a row is read from (`media_path`: no `..` escape, symlinks followed)."""
        return media_path(path, self.dataset_dir, allow_outside=self.allow_outside)

    def encode_row(self, row: Any) -> dict[str, Any]:
        """Tokenize one row (a parsed JSON value); raises `BadSample`."""
        if not isinstance(row, dict):
            raise BadSample("bad_content", f"a row must be a JSON object, got {type(row).__name__}")
        if INVALID_ROW in row:
            raise BadSample(*row[INVALID_ROW])
        pair = parse_pair(row, self.attr) if self.ranking else None
        prompt = parse_prompt(row, self.attr) if self.prompt_only else None
        if pair is not None:
            conversation = pair.conversation
        else:
            conversation = parse_row(row, self.attr) if prompt is None else prompt.conversation
        for kind, items, supported in (
            ("video", conversation.videos, self.plugin.supports_video),
            ("audio", conversation.audios, self.plugin.supports_audio),
        ):
            if items and not supported:
                raise BadSample(
                    f"{kind}_not_supported",
                    f"the row has {len(items)} {kind}(s), but image plugin {self.plugin.name!r} "
                    f"(this model family) reads no {kind}",
                )
        paths = [self.image_path(p) for p in conversation.images]
        video_paths, audio_paths = (
            [media_path(p, self.dataset_dir, allow_outside=self.allow_outside, reason=f"{kind}_outside_dataset_dir")
             for p in items]
            for kind, items in (("video", conversation.videos), ("audio", conversation.audios))
        )
        grids = [self.plugin.read_grid(p) for p in paths]
        if hasattr(self.plugin, "read_media_grids"):  # a plugin whose clips' tokens depend on its videos' tracks
            video_grids, audio_grids = self.plugin.read_media_grids(video_paths, audio_paths)
        else:
            video_grids = self.plugin.read_video_grids(video_paths) if video_paths else []
            audio_grids = self.plugin.read_audio_grids(audio_paths) if audio_paths else []
        media_blocks = MediaBlocks(
            images=[self.plugin.image_tokens(grid) for grid in grids],
            videos=[self.plugin.video_tokens(grid) for grid in video_grids],
            audios=[self.plugin.audio_tokens(grid) for grid in audio_grids],
        )
        everything = conversation.images + conversation.videos + conversation.audios
        media = {
            "images": paths, "image_grids": [list(g) for g in grids],
            "videos": video_paths, "video_grids": [list(g) for g in video_grids],
            "audios": audio_paths, "audio_grids": [list(g) for g in audio_grids],
            "absolute_images": sum(Path(p).expanduser().is_absolute() for p in everything),
        }
        if pair is not None:
            tokens = self.encode_pair(conversation, pair.rejected, media_blocks)
        elif prompt is not None:
            tokens = self.encode_prompt(conversation, prompt.ground_truth, media_blocks)
        else:
            input_ids, labels = self.template.encode(conversation, media_blocks)
            input_ids, labels = self.truncate(input_ids, labels)
            tokens = {"input_ids": input_ids, "labels": labels}
        if hasattr(self.plugin, "arrange_media"):  # the media lists in the order their tokens came out
            media = self.plugin.arrange_media(tokens["input_ids"], media)
        return {**tokens, **media}

    def encode_pair(self, conversation: Any, rejected: str, media: MediaBlocks) -> dict[str, Any]:
        """The token columns of a pair (`_EMPTY_PAIR`): the prompt is tokenized once (`Template.encode_pair`); a
        pair with a sequence over `cutoff_len` is `pair_too_long` (DPO's answers are never cut)."""
        (ids, labels), (rejected_ids, rejected_labels) = self.template.encode_pair(conversation, rejected, media)
        for name, n in (("chosen", len(ids)), ("rejected", len(rejected_ids))):
            if n > self.cutoff_len:
                raise BadSample("pair_too_long", f"the {name} sequence has {n} tokens > cutoff_len {self.cutoff_len}")
        shared = next(
            (k for k, (a, b) in enumerate(zip(zip(ids, labels), zip(rejected_ids, rejected_labels))) if a != b),
            min(len(ids), len(rejected_ids)),
        )
        return {
            "input_ids": ids, "labels": labels, "rejected_ids": rejected_ids[shared:],
            "rejected_labels": rejected_labels[shared:], "prompt_length": shared,
        }

    def encode_prompt(self, conversation: Conversation, ground_truth: Any, media: MediaBlocks) -> dict[str, Any]:
        """The token columns of a prompt (`_EMPTY_PROMPT`): the conversation (its last answer empty) encoded by the
        template, up to where the last answer's trained tokens start (`answer_start`); over `cutoff_len` is
        `too_long` (a prompt is never cut)."""
        ids, labels = self.template.encode(conversation, media)
        ids = ids[: answer_start(labels)]
        if len(ids) > self.cutoff_len:
            raise BadSample("too_long", f"the prompt has {len(ids)} tokens > cutoff_len {self.cutoff_len}")
        return {
            "input_ids": ids, "labels": [IGNORE_INDEX] * len(ids), "solution": json.dumps(ground_truth),
            "prompt_text": conversation.turns[-1][0],
        }

    def answer_end_ids(self) -> list[int]:
        """The token(s) that end an answer in this template (the last trained token of an empty answer): the stop
        tokens of generation."""
        ids, labels = self.template.encode(Conversation(system=None, turns=[("?", "")], images=[]))
        return [ids[max(i for i, label in enumerate(labels) if label != IGNORE_INDEX)]]

    def stop_token_ids(self) -> list[int]:
        """The tokens that end a generation: the template's end of an answer (`answer_end_ids`), then the
        tokenizer's eos where it is another. GRPO's stop tokens, and what an HF export's `generation_config.json`
        lists as `eos_token_id` (the trainer records them with each checkpoint)."""
        eos = getattr(self.processor.tokenizer, "eos_token_id", None)
        return list(dict.fromkeys([*self.answer_end_ids(), *([int(eos)] if eos is not None else [])]))

    def truncate(self, input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """Cut to `cutoff_len` in text only; a cut through a media block, or one that leaves nothing trained, is
        `too_long`."""
        n = len(input_ids)
        if n <= self.cutoff_len:
            return input_ids, labels
        image_ids = self.plugin.image_token_ids
        last_image = max((i for i in range(n - 1, -1, -1) if input_ids[i] in image_ids), default=-1)
        if last_image >= self.cutoff_len:
            raise BadSample("too_long", f"{n} tokens > cutoff_len {self.cutoff_len} and the cut would go through image tokens (the last ends at {last_image + 1})")
        input_ids, labels = input_ids[: self.cutoff_len], labels[: self.cutoff_len]
        if all(label == IGNORE_INDEX for label in labels[1:]):
            raise BadSample("too_long", f"{n} tokens > cutoff_len {self.cutoff_len} and nothing trained is left before the cut")
        return input_ids, labels

    def encode_batch(self, batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """`datasets.map` function: raw JSON rows -> token columns plus `bad_reason`/`bad_detail`."""
        empty = _EMPTY_PAIR if self.ranking else _EMPTY_PROMPT if self.prompt_only else _EMPTY_SAMPLE
        keys = (*empty, "length", "bad_reason", "bad_detail")
        out: dict[str, list[Any]] = {k: [] for k in keys}
        for text in batch["row"]:
            try:
                sample = self.encode_row(json.loads(text))
                bad_reason = bad_detail = ""
            except BadSample as bad:
                sample = dict(empty)
                bad_reason, bad_detail = bad.reason, bad.detail
            for key, value in sample.items():
                out[key].append(value)
            # a pair's length is both sequences': what batching, packing and the token budget plan with
            length = len(sample["input_ids"])
            if self.ranking and not bad_reason:
                length += sample["prompt_length"] + len(sample["rejected_ids"])
            out["length"].append(length)
            out["bad_reason"].append(bad_reason)
            out["bad_detail"].append(bad_detail)
        return out

    def fingerprint(self) -> str:
        """Hash of everything that changes the tokens: tokenizer, image processor, template and options."""
        tok = self.processor.tokenizer
        h = hashlib.sha256()
        h.update(type(tok).__name__.encode())
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
        probe = ["Hello, wörld! 12345  tabs\tand\nnew lines... ¿Qué tal? 日本語 [INST] <s>", " leading", "trailing "]
        h.update(json.dumps(self.processor.encode_texts(probe)).encode())
        h.update(json.dumps(self.processor.image_processor.to_dict(), sort_keys=True, default=str).encode())
        h.update(
            json.dumps(
                [
                    _PREPROCESS_VERSION,
                    self.template.fingerprint(),
                    self.plugin.fingerprint(),
                    self.cutoff_len,
                    str(self.dataset_dir),
                    self.allow_outside,
                    to_dict(self.attr),
                ]
            ).encode()
        )
        return h.hexdigest()
