"""Checks shared by the trace loaders: reading the file, repeated keys, and the types of count and time fields."""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from pathlib import Path

Source = str | os.PathLike[str]  # a trace's path, or a label for content not read from a file

from marsched.workload.errors import TraceError, describe


def read_trace_bytes(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, or a TraceError that says why there are none."""
    file = Path(path)
    if not file.exists():
        raise TraceError(path, "file", None, "no such file")
    if file.is_dir():
        raise TraceError(path, "file", None, "is a directory, not a trace file")
    try:
        return file.read_bytes()
    except OSError as error:
        raise TraceError(path, "file", None, f"cannot be read: {error.strerror or error}") from error


GZIP_MAGIC = b"\x1f\x8b"


def gunzipped(data: bytes | str, source: Source) -> bytes | str:
    """The content itself, or decompressed when it is gzip (by its first two bytes)."""
    if isinstance(data, bytes) and data.startswith(GZIP_MAGIC):
        try:
            return gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as error:
            raise TraceError(source, "file", None, f"not a readable gzip file: {error}") from None
    return data


def decode_utf8(data: bytes | str, source: Source) -> str:
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8-sig")  # a BOM is harmless; editors on Windows add one
    except UnicodeDecodeError as error:
        raise TraceError(source, "file", None, f"not UTF-8 text (byte {error.start})") from error


class DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A json `object_pairs_hook`: json.loads would keep the last of two equal keys and lose the first silently."""
    result = dict(pairs)
    if len(result) < len(pairs):  # the rare case, looked into key by key
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return result


def object_line(line: str, number: int, source: Source, what: str) -> tuple[dict, str]:
    """One line of a JSONL trace: a JSON object (`what` it holds, for the error) with a non-empty
    string `id`; returns it and its id. Errors name the line and the field."""
    where = f"line {number}"
    try:
        record = json.loads(line, object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as duplicate:
        raise TraceError(source, where, duplicate.key, "appears twice in one JSON object") from None
    except json.JSONDecodeError as error:
        raise TraceError(source, where, None, f"not valid JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(record, dict):
        raise TraceError(source, where, None, f"must be a JSON object{what}, got {describe(record)}")
    name = record.get("id")
    if not isinstance(name, str) or not name:
        raise TraceError(source, where, "id", f"must be a non-empty string, got {describe(name)}")
    return record, name


def require_count(value: object, source: Source, record: str, field: str) -> int:
    """A token count: a JSON integer >= 0 (a bool is not an integer here, nor is 3.0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(source, record, field, f"must be a non-negative integer, got {describe(value)}")
    return value


def require_seconds(value: object, source: Source, record: str, field: str) -> float:
    """A duration or instant: a finite JSON number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TraceError(source, record, field, f"must be a finite number of seconds >= 0, got {describe(value)}")
    return float(value)


def require_text(value: object, source: Source, record: str, field: str) -> str:
    if not isinstance(value, str):
        raise TraceError(source, record, field, f"must be a string, got {describe(value)}")
    return value
