"""Bad rows and data errors.

A row that cannot become a correct training sample raises `BadSample(reason, detail)`
while it is preprocessed (or while its images are decoded in a DataLoader worker).
Normally the row is skipped and counted under its reason; with
`basic_parameters.strict: true` the first one becomes a `DataError` naming the file,
the row index and the reason. `DataError` is also raised when no usable row is left.
"""

from __future__ import annotations

__all__ = [
    "BAD_REASONS", "BAD_REASON_ADVICE", "BadSample", "DataError", "all_rows_bad_message", "format_counts", "top_reason",
]

BAD_REASONS = (
    "not_utf8",
    "nested_too_deep",
    "number_too_long",
    "lone_surrogate",
    "empty_conversation",
    "bad_content",
    "wrong_role_order",
    "no_assistant_turn",
    "missing_chosen",
    "missing_rejected",
    "identical_pair",
    "missing_solution",
    "image_count_mismatch",
    "image_in_wrong_turn",
    "video_count_mismatch",
    "video_in_wrong_turn",
    "video_not_supported",
    "audio_count_mismatch",
    "audio_in_wrong_turn",
    "audio_not_supported",
    "image_outside_dataset_dir",
    "video_outside_dataset_dir",
    "audio_outside_dataset_dir",
    "missing_image",
    "corrupt_image",
    "missing_video",
    "corrupt_video",
    "unsupported_video",
    "video_timeout",
    "missing_audio",
    "corrupt_audio",
    "unsupported_audio",
    "empty_audio",
    "silent_audio",
    "audio_too_long",
    "audio_timeout",
    "too_long",
    "pair_too_long",
)
"""Every reason a row can be skipped for, in the order they are checked."""

BAD_REASON_ADVICE = {
    "not_utf8": "re-save the file as UTF-8",
    "nested_too_deep": "the rows are not conversations; check basic_parameters.dataset names the right file",
    "number_too_long": "the rows are not conversations; check basic_parameters.dataset names the right file",
    "lone_surrogate": "the file holds broken \\ud800-\\udfff escapes; re-export it from its source",
    "empty_conversation": (
        "check dataset_param.attr.messages (the column holding the messages, `conversations` for sharegpt files) "
        "and attr.content_tag"
    ),
    "bad_content": (
        "check dataset_param.attr (messages, images, content_tag) against the file's column names "
        "and that the file is JSON/JSONL"
    ),
    "wrong_role_order": (
        "check dataset_param.attr.role_tag, user_tag, assistant_tag and system_tag (sharegpt: from, human, gpt, system)"
    ),
    "no_assistant_turn": "check dataset_param.attr.assistant_tag (sharegpt files use gpt) and attr.role_tag",
    "missing_chosen": (
        "check dataset_param.attr.chosen (the column of the chosen answer) and that each pair's messages end with "
        "the user turn or with the chosen answer"
    ),
    "missing_rejected": (
        "check dataset_param.attr.rejected (the column of the rejected answer; ms-swift: rejected_response)"
    ),
    "missing_solution": (
        "check dataset_param.attr.solution (the column of a prompt's ground truth; `answer` is read too) or end the "
        "messages with the answer"
    ),
    "identical_pair": "remove pairs whose chosen and rejected answers are the same: they teach nothing",
    "image_count_mismatch": (
        "check dataset_param.attr.images (the column holding the image paths) "
        "and that each image has one <image> placeholder"
    ),
    "image_in_wrong_turn": "move <image> placeholders into user turns (or check attr.user_tag / assistant_tag)",
    "video_count_mismatch": (
        "set dataset_param.attr.videos to the column holding the video paths "
        "and check that each video has one <video> placeholder"
    ),
    "video_in_wrong_turn": "move <video> placeholders into user turns (or check attr.user_tag / assistant_tag)",
    "video_not_supported": (
        "this model family has no video input: remove the video rows or set dataset_param.attr.videos: null "
        "(or train a family whose entry declares capabilities.video, e.g. qwen3_vl)"
    ),
    "audio_count_mismatch": (
        "set dataset_param.attr.audios to the column holding the audio paths "
        "and check that each clip has one <audio> placeholder"
    ),
    "audio_in_wrong_turn": "move <audio> placeholders into user turns (or check attr.user_tag / assistant_tag)",
    "audio_not_supported": (
        "this model family has no audio input: remove the audio rows or set dataset_param.attr.audios: null "
        "(or use an audio template and plugin, e.g. qwen3_omni)"
    ),
    "image_outside_dataset_dir": (
        "write image paths relative to basic_parameters.dataset_dir without `..` (a symlink inside dataset_dir "
        "may point anywhere), or set basic_parameters.allow_paths_outside_dataset_dir: true"
    ),
    "video_outside_dataset_dir": (
        "write video paths relative to basic_parameters.dataset_dir without `..` (a symlink inside dataset_dir "
        "may point anywhere), or set basic_parameters.allow_paths_outside_dataset_dir: true"
    ),
    "audio_outside_dataset_dir": (
        "write audio paths relative to basic_parameters.dataset_dir without `..` (a symlink inside dataset_dir "
        "may point anywhere), or set basic_parameters.allow_paths_outside_dataset_dir: true"
    ),
    "missing_image": "check basic_parameters.dataset_dir: relative image paths are resolved against it",
    "corrupt_image": "check the image files (and clear cache_dir if they changed after the cache was built)",
    "missing_video": "check basic_parameters.dataset_dir: relative video paths are resolved against it",
    "corrupt_video": (
        "check the video files play to their end (ffprobe -count_frames), re-encode damaged ones, "
        "and clear cache_dir if they changed after the cache was built"
    ),
    "unsupported_video": (
        "re-encode the video with a common codec (H.264, MPEG-4, VP9) at a sane size and length, "
        "or cut long videos into clips"
    ),
    "video_timeout": (
        "the video decodes too slowly to its last sampled frame: cut it into shorter clips or re-encode it; "
        "preprocess_parameters.video_timeout raises the bound"
    ),
    "missing_audio": "check basic_parameters.dataset_dir: relative audio paths are resolved against it",
    "corrupt_audio": (
        "check the audio files play to their end (ffprobe), re-encode damaged ones, "
        "and clear cache_dir if they changed after the cache was built"
    ),
    "unsupported_audio": "re-encode the clip with a common codec (WAV, FLAC, MP3, Opus, AAC) into a file with audio",
    "empty_audio": "remove clips without sound: a clip needs at least one feature window (25 ms at 16 kHz)",
    "silent_audio": "the clip is all zeros (a failed recording or export): re-export it from its source, or drop the row",
    "audio_too_long": "cut long clips into shorter ones, or raise preprocess_parameters.audio_max_seconds",
    "audio_timeout": (
        "the clip decodes too slowly: re-encode it or cut it into shorter clips; "
        "preprocess_parameters.audio_timeout raises the bound"
    ),
    "too_long": "raise preprocess_parameters.cutoff_len or lower image_max_pixels / video_max_pixels / video_maxlen",
    "pair_too_long": (
        "raise preprocess_parameters.cutoff_len (a pair's chosen and rejected sequences are never cut) or lower "
        "image_max_pixels / video_max_pixels / video_maxlen"
    ),
}
"""What to check or change for each bad-row reason: the all-bad error names the advice of the most common reason."""


class DataError(RuntimeError):
    """The data cannot be used as configured (a bad row in strict mode, or no usable rows at all)."""


class BadSample(Exception):
    """One row is unusable: `reason` is one of `BAD_REASONS`, `detail` says what exactly."""

    def __init__(self, reason: str, detail: str):
        assert reason in BAD_REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def top_reason(counts: dict[str, int]) -> str | None:
    """The most common reason of `counts` (the first in `BAD_REASONS` order on a tie); None when there is none."""
    return max(BAD_REASONS, key=lambda reason: counts.get(reason, 0)) if any(counts.values()) else None


def all_rows_bad_message(
    num_rows: int, names: str, counts: dict[str, int], example: tuple[str, int, str] | None
) -> str:
    """The one-line error for a split with no usable row: counts, the top reason, one example row and its fix.

    `example` is (file, row, detail) of a row skipped for the most common reason.
    """
    counted = format_counts(counts) or "no rows"
    message = f"every one of the {num_rows} rows of {names} is bad ({counted}); nothing to train on"
    if not counts:
        return f"{message}. Check basic_parameters.dataset names a file with rows"
    top = top_reason(counts)
    message += f". Top reason: {top} ({counts[top]} of {num_rows} rows)"
    if example is not None:
        source, row, detail = example
        message += f", e.g. {source} row {row}: {detail}"
    return f"{message}. Fix: {BAD_REASON_ADVICE[top]}"


def format_counts(counts: dict[str, int]) -> str:
    """`{'missing_image': 2, 'too_long': 1}` -> `'missing_image=2, too_long=1'` in `BAD_REASONS` order."""
    return ", ".join(f"{reason}={counts[reason]}" for reason in BAD_REASONS if counts.get(reason))
