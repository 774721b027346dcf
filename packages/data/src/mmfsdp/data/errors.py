"""Bad rows and data errors.

A row that cannot become a correct training sample raises `BadSample(reason, detail)`
while it is preprocessed (or while its images are decoded in a DataLoader worker).
Normally the row is skipped and counted under its reason; with
`basic_parameters.strict: true` the first one becomes a `DataError` naming the file,
the row index and the reason. `DataError` is also raised when no usable row is left.
"""

from __future__ import annotations

__all__ = ["BAD_REASONS", "BadSample", "DataError", "format_counts"]

BAD_REASONS = (
    "not_utf8",
    "nested_too_deep",
    "number_too_long",
    "lone_surrogate",
    "empty_conversation",
    "bad_content",
    "wrong_role_order",
    "no_assistant_turn",
    "image_count_mismatch",
    "image_in_wrong_turn",
    "image_outside_dataset_dir",
    "missing_image",
    "corrupt_image",
    "too_long",
)
"""Every reason a row can be skipped for, in the order they are checked."""


class DataError(RuntimeError):
    """The data cannot be used as configured (a bad row in strict mode, or no usable rows at all)."""


class BadSample(Exception):
    """One row is unusable: `reason` is one of `BAD_REASONS`, `detail` says what exactly."""

    def __init__(self, reason: str, detail: str):
        assert reason in BAD_REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def format_counts(counts: dict[str, int]) -> str:
    """`{'missing_image': 2, 'too_long': 1}` -> `'missing_image=2, too_long=1'` in `BAD_REASONS` order."""
    return ", ".join(f"{reason}={counts[reason]}" for reason in BAD_REASONS if counts.get(reason))
