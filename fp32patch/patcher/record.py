"""The dist-info ``RECORD`` row of a patched file: its hash and size, kept in step with its bytes.

Only the target's row changes; every other byte (order, quoting, line endings) stays, so
a revert gives back the RECORD it found.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
from collections.abc import Callable


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rewrite_record(record: bytes, relpath: str, data: bytes) -> bytes | None:
    """RECORD with ``relpath``'s row set to ``data``'s hash and size; None if it has no row.

    Only that row's text changes: every other byte (order, quoting, line endings) stays,
    so a revert gives back the RECORD it found. A RECORD that is not UTF-8 CSV is left alone.
    """

    def with_hash(row: list[str], body: str) -> str:
        out = io.StringIO()
        csv.writer(out, lineterminator="").writerow([row[0], record_hash(data), str(len(data)), *row[3:]])
        return out.getvalue()

    return _replace_row(record, relpath, with_hash)


def row_of(record: bytes, relpath: str) -> str | None:
    """``relpath``'s RECORD row as it is written (no line ending), or None if it has none."""
    try:
        lines = record.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None
    for line in lines:
        try:
            row = next(csv.reader([line]), [])
        except csv.Error:
            continue
        if row and row[0] == relpath:
            return line
    return None


def put_row(record: bytes, relpath: str, text: str) -> bytes | None:
    """RECORD with ``relpath``'s row set back to ``text`` exactly (as ``row_of`` read it); None if it has no row."""
    return _replace_row(record, relpath, lambda row, body: text)


def _replace_row(record: bytes, relpath: str, new_text: Callable[[list[str], str], str]) -> bytes | None:
    """RECORD with each of ``relpath``'s rows written anew by ``new_text(row, line)`` (the parsed
    row and its text without the line ending), every other byte kept; None if it has no row or
    is not UTF-8."""
    try:
        lines = record.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None
    hit = False
    for i, line in enumerate(lines):
        body = line.rstrip("\r\n")
        try:
            row = next(csv.reader([body]), [])
        except csv.Error:
            continue
        if row and row[0] == relpath:
            lines[i] = new_text(row, body) + line[len(body) :]
            hit = True
    return "".join(lines).encode("utf-8") if hit else None


def record_row_hash(record: bytes, relpath: str) -> str | None:
    """The hash RECORD gives ``relpath`` (``sha256=...``), or None if it has no such row."""
    try:
        text = record.decode("utf-8")
    except UnicodeDecodeError:
        return None
    for row in csv.reader(text.splitlines()):
        if row and row[0] == relpath:
            return row[1] if len(row) > 1 else None
    return None
