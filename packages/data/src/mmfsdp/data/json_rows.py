"""The JSON stream parser: a JSON/JSONL file -> one checked JSON text per row, in bounded memory.

JSONL files are split at their lines; a JSON list is split at its own commas, found by a bracket scan outside
strings a few MiB at a time (`_json_list_items`). Each row is checked before and after `json.loads` — UTF-8, nesting
depth (`_MAX_JSON_DEPTH`, scanned before parsing), Python's int-str digit limit, lone surrogates — and re-serialised;
a row that fails becomes a marker (`INVALID_ROW`) carrying its bad-row reason, so no row of any shape aborts the run
(`mmfsdp.data.encoder` turns the marker back into the `BadSample`). A file that is not one list is a `DataError`.
"""

from __future__ import annotations

import json
import re
from typing import BinaryIO, Iterator

import numpy as np

from mmfsdp.data.errors import BadSample, DataError

__all__ = ["INVALID_ROW", "iter_json_rows"]

INVALID_ROW = "__mmfsdp_invalid__"
"""The key of a bad row's marker: `{INVALID_ROW: [reason, detail]}`."""
_MAX_JSON_DEPTH = 100
"""Deepest nesting of lists/objects a row may have (real conversations use about 4); deeper is `nested_too_deep`."""
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_READ_BYTES = 1 << 22
"""How much of a JSON list file is read at a time (rows are split off each read, so memory stays bounded)."""


def _structure(data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """Offsets of the brackets and commas of `data` that are outside JSON strings, the nesting depth after each, and
    the offset of the first quote that opens no complete string (`len(data)` if none): a string cut off there."""
    blank = np.frombuffer(_JSON_STRING.sub(lambda m: b"_" * len(m.group()), data), dtype=np.uint8)
    opens = (blank == ord("[")) | (blank == ord("{"))
    closes = (blank == ord("]")) | (blank == ord("}"))
    offsets = np.flatnonzero(opens | closes | (blank == ord(",")))
    quotes = np.flatnonzero(blank == ord('"'))
    unclosed = int(quotes[0]) if len(quotes) else len(data)
    return offsets, np.cumsum(opens[offsets].astype(np.int32) - closes[offsets].astype(np.int32)), unclosed


def _max_depth(data: bytes) -> int:
    if data.count(b"[") + data.count(b"{") <= _MAX_JSON_DEPTH:
        return 0  # nesting cannot exceed the number of brackets: no scan needed
    return int(_structure(data)[1].max(initial=0))


def _row_json(data: bytes, where: str) -> str:
    """One row's bytes -> its JSON text, re-serialised; `BadSample` for anything that would break a later step."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadSample("not_utf8", f"{where}: byte {err.start} ({data[err.start:err.start + 1]!r}) is not UTF-8") from None
    depth = _max_depth(data)
    if depth > _MAX_JSON_DEPTH:
        raise BadSample("nested_too_deep", f"{where}: lists/objects nest {depth} deep (at most {_MAX_JSON_DEPTH})")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadSample("bad_content", f"{where} is not valid JSON ({err})") from None
    except RecursionError:
        raise BadSample("nested_too_deep", f"{where}: lists/objects nest too deep to parse") from None
    except ValueError as err:  # json's only other error: an integer past sys.get_int_max_str_digits()
        raise BadSample("number_too_long", f"{where}: {str(err).split(';')[0]}") from None
    out = json.dumps(value, ensure_ascii=False)
    try:
        out.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadSample("lone_surrogate", f"{where}: a string holds the lone surrogate U+{ord(out[err.start]):04X} (an unpaired \\ud800-\\udfff escape)") from None
    return out


def _json_list_items(f: BinaryIO, path: str) -> Iterator[tuple[bytes, str]]:
    """(bytes, "item i") of each item of the JSON list in the open file `f`, split at the list's own commas.

    Streams: reads `_READ_BYTES` at a time and keeps only the bytes of items not yet split off. Each scan starts
    right after the list's `[` or one of its commas, so outside any string at depth 1; before the end of the file
    only the part up to the first string the read cut through is split (its commas and brackets may be text)."""
    pending, started, index, read_size = b"", False, 0, _READ_BYTES
    while True:
        chunk = f.read(read_size)
        at_end = not chunk
        pending += chunk
        if not started:
            pending = pending.lstrip()
            if not pending and not at_end:
                continue
            if not pending.startswith(b"["):
                raise DataError(f"{path} must hold a JSON list of rows (or be a .jsonl file with one row per line)")
            pending, started = pending[1:], True
        offsets, depth, unclosed = _structure(pending)
        if not at_end:
            depth, offsets = depth[offsets < unclosed], offsets[offsets < unclosed]
        depth = depth + 1
        codes = np.frombuffer(pending, dtype=np.uint8)[offsets]
        ends = offsets[(depth == 0) | ((depth == 1) & (codes == ord(",")))]
        start = 0
        for end in ends.tolist():
            item = pending[start:end]
            if pending[end] == ord(","):
                yield item, f"item {index}"
                index, start = index + 1, end + 1
                continue
            trailing = pending[end + 1 :].strip() or any(b.strip() for b in iter(lambda: f.read(_READ_BYTES), b""))
            if pending[end] != ord("]") or trailing:
                break  # the list closes with another bracket, or something follows it
            if index or item.strip():  # `[]` holds no item; `[1,]` ends with an empty one
                yield item, f"item {index}"
            return
        else:
            if not at_end:
                pending = pending[start:]
                read_size = _READ_BYTES if start else 2 * read_size  # a long item: read more before scanning again
                continue
        raise DataError(f"{path} is not valid JSON (its brackets do not balance into one list); fix the file or convert it to JSONL (one row per line)")


def iter_json_rows(path: str, size: int, mtime_ns: int, max_samples: int | None) -> Iterator[dict[str, str]]:
    """One `{"row": json}` per row of `path`; a row that is not usable JSON becomes an invalid marker with its reason."""
    del size, mtime_ns  # in the signature so HF datasets' cache key changes when the file does
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            rows: Iterator[tuple[bytes, str]] = ((line, f"line {n}") for n, line in enumerate(f, 1) if line.strip())
            yield from _rows_json(rows, max_samples)
        return
    with open(path, "rb") as f:
        items = _json_list_items(f, path)
        yield from _rows_json(items, max_samples)
        for _ in items:  # past max_samples: the rest of the list is still checked to be one list
            pass


def _rows_json(rows: Iterator[tuple[bytes, str]], max_samples: int | None) -> Iterator[dict[str, str]]:
    for count, (data, where) in enumerate(rows):
        if max_samples is not None and count >= max_samples:
            return
        try:
            yield {"row": _row_json(data, where)}
        except BadSample as bad:
            yield {"row": json.dumps({INVALID_ROW: [bad.reason, bad.detail]})}
