"""JSONL documents of any length: each line's ``text`` field, read in bounded memory.

An ordinary line (under LONG_LINE bytes) is parsed with json.loads. A longer one is never held whole: a first
scan checks it is JSON (as json.loads would: the same grammar, escapes, NaN/Infinity, duplicate keys where
the last one counts) and finds its ``text`` field; a second scan streams that string's text in pieces.
Either way a line that is not a JSON object with a string ``text`` is an error naming the file and line.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from moelens.traces.hashed import DataChanged

LONG_LINE = 1 << 20  # bytes: longer lines are scanned in pieces, never read whole
READ_BYTES = 1 << 16  # bytes read from the file at a time
TEXT_PIECE = 1 << 16  # characters of a long text handed on at a time (at least)
KEY_CHARS = 256  # a key longer than this is shown shortened in errors (and cannot be "text")

_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_DIGITS = re.compile(r"[0-9]*")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class _Stop(Exception):
    """The scan reached the value it was asked to stop at."""


@dataclass(frozen=True)
class Line:
    """One JSONL line: ``text`` when it is ordinary (short), else where to stream it from."""

    number: int
    text: str | None  # None: a long line; read it with long_text
    start: int  # byte offset of the line in the file
    text_key: int  # long lines: the index (among the object's keys) of the "text" key that counts
    sha256: str = ""  # long lines: of the line's bytes as its first scan read them (LongText reads them again)


def lines(fh: BinaryIO, path: Path) -> Iterator[Line]:
    """The documents of an open JSONL file, in order; blank lines pass over. Each line is checked whole."""
    number = 0
    while True:
        start = fh.tell()
        raw = fh.readline(LONG_LINE)
        if not raw:
            return
        number += 1
        if raw.endswith(b"\n") or len(raw) < LONG_LINE:
            text = _short_line(raw, path, number)
            if text is not None:
                yield Line(number, text, start, -1)
            continue
        scan = _Scanner(fh, start, path, number)
        text_key = scan.document()
        fh.seek(scan.end)
        if text_key is not None:
            yield Line(number, None, start, text_key, scan.digest.hexdigest())


def long_text(fh: BinaryIO, path: Path, line: Line) -> LongText:
    """The ``text`` of a long line, in pieces of about TEXT_PIECE characters (see LongText)."""
    return LongText(fh, path, line)


class LongText:
    """The ``text`` of a long line, in pieces of about TEXT_PIECE characters, read again from ``fh``. Once
    the text is read (or finish() is called, where reading stopped early) the rest of the line is read too,
    and the line's bytes must be those its first scan read, or DataChanged names the file and line."""

    def __init__(self, fh: BinaryIO, path: Path, line: Line) -> None:
        self.fh, self.path, self.line = fh, path, line
        self.scan: _Scanner | None = None

    def __iter__(self) -> Iterator[str]:
        self.scan = _Scanner(self.fh, self.line.start, self.path, self.line.number)
        self.scan.document(stop_at_key=self.line.text_key)
        yield from self.scan.string_pieces(TEXT_PIECE)
        self.finish()

    def finish(self) -> None:
        if self.scan is None:
            return
        while self.scan._more():
            pass
        if self.scan.digest.hexdigest() != self.line.sha256:
            raise DataChanged(self.path, f"{self.path}:{self.line.number} changed while being traced (the line read twice "
                              "differs): the trace stops; run it again once the file stays as it is")
        self.scan = None


def _short_line(raw: bytes, path: Path, number: int) -> str | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}:{number}: not UTF-8 text ({err.reason})") from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not a JSON object ({err.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        found = f"keys {sorted(row)}" if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{path}:{number}: expected a JSON object with a string field 'text', got {found}")
    return row["text"]


class _Scanner:
    """One line of a file, from byte ``start`` to its newline, as characters scanned a block at a time."""

    def __init__(self, fh: BinaryIO, start: int, path: Path, number: int) -> None:
        self.fh, self.path, self.number = fh, path, number
        fh.seek(start)
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf, self.pos = "", 0
        self.done = False
        self.end = start  # byte offset just past the line (its newline) once read to the end
        self.digest = hashlib.sha256()  # of the line's bytes read so far (its newline left out)

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}:{self.number}: {message}")

    def _more(self) -> bool:
        """Read the next block of the line into the buffer (keeping what is not consumed yet)."""
        if self.done:
            return False
        block = self.fh.read(READ_BYTES)
        newline = block.find(b"\n")
        if newline >= 0:
            block, self.done = block[:newline], True
            self.end += newline + 1
        else:
            self.end += len(block)
            self.done = not block
        self.digest.update(block)
        try:
            text = self.decoder.decode(block, final=self.done)
        except UnicodeDecodeError as err:
            raise self.error(f"not UTF-8 text ({err.reason})") from None
        self.buf, self.pos = self.buf[self.pos :] + text, 0
        return True

    def peek(self, ahead: int = 0) -> str:
        """The character ``ahead`` places on ("" past the end of the line)."""
        while self.pos + ahead >= len(self.buf):
            if not self._more():
                return ""
        return self.buf[self.pos + ahead]

    def skip(self, pattern: re.Pattern) -> None:
        while True:
            self.pos = pattern.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self._more():
                return

    # ---- the grammar of json.loads -------------------------------------------------------------------

    def document(self, stop_at_key: int | None = None) -> int | None:
        """Check the line is a JSON object with a string "text" (the last one, as json.loads keeps) and return
        that key's index among the object's keys; None for a blank line. With stop_at_key, stop where that
        key's value starts (the line was checked before)."""
        self.skip(_JSON_SPACE)
        if self.peek() == "" or self.peek().isspace():
            while self.peek().isspace():  # Unicode white space json.loads refuses, but str.strip() takes
                self.pos += 1
            if self.peek() == "":
                return None  # a blank line holds no document
            raise self.error("not a JSON object (Expecting value)")
        keys: list[tuple[str, bool]] = []  # the top object's keys, and whether each value is a string
        try:
            top = self._value(keys, stop_at_key)
        except _Stop:
            return stop_at_key
        self.skip(_JSON_SPACE)
        if self.peek() != "":
            raise self.error("not a JSON object (Extra data)")
        text = [i for i, (key, _) in enumerate(keys) if key == "text"]
        if top != "object" or not text or not keys[text[-1]][1]:
            found = f"keys {sorted({key for key, _ in keys})}" if top == "object" else top
            raise self.error(f"expected a JSON object with a string field 'text', got {found}")
        return text[-1]

    def _value(self, keys: list, stop_at_key: int | None) -> str:
        """Scan one JSON value (containers without recursion); returns the top value's kind."""
        stack: list[str] = []  # "{" or "["
        top = None
        top_key = None  # index of the top object's key whose value comes next
        expect = "value"
        while True:
            if expect == "value":
                c = self.peek()
                kind = {"{": "object", "[": "list", '"': "str"}.get(c) or self._scalar(c)
                top = top or kind
                if top_key is not None:
                    keys[top_key] = (keys[top_key][0], kind == "str")
                    top_key = None
                if c in "{[":
                    self.pos += 1
                    stack.append(c)
                    self.skip(_JSON_SPACE)
                    if self.peek() == ("}" if c == "{" else "]"):
                        self.pos += 1
                        stack.pop()
                        expect = "after"
                    else:
                        expect = "key" if c == "{" else "value"
                    continue
                if c == '"':
                    for _ in self.string_pieces(TEXT_PIECE):
                        pass
                expect = "after"
            elif expect == "key":
                if self.peek() != '"':
                    raise self.error("not a JSON object (Expecting property name enclosed in double quotes)")
                if len(stack) == 1:
                    keys.append((self._key(), False))
                else:
                    for _ in self.string_pieces(TEXT_PIECE):
                        pass
                self.skip(_JSON_SPACE)
                if self.peek() != ":":
                    raise self.error("not a JSON object (Expecting ':' delimiter)")
                self.pos += 1
                self.skip(_JSON_SPACE)
                if len(stack) == 1:
                    top_key = len(keys) - 1
                    if top_key == stop_at_key:
                        raise _Stop
                expect = "value"
            else:  # after a value
                if not stack:
                    return top
                self.skip(_JSON_SPACE)
                c = self.peek()
                close = "}" if stack[-1] == "{" else "]"
                if c == ",":
                    self.pos += 1
                    self.skip(_JSON_SPACE)
                    expect = "key" if close == "}" else "value"
                elif c == close:
                    self.pos += 1
                    stack.pop()
                else:
                    raise self.error("not a JSON object (Expecting ',' delimiter)")

    def _scalar(self, c: str) -> str:
        """Scan a number or literal (json.loads's: NaN, Infinity and -Infinity included)."""
        for word, kind in (("true", "bool"), ("false", "bool"), ("null", "NoneType"), ("NaN", "float"), ("Infinity", "float"), ("-Infinity", "float")):
            if c == word[0] and all(self.peek(i) == ch for i, ch in enumerate(word)):
                self.pos += len(word)
                return kind
        if c == "-":
            self.pos += 1
        first = self.peek()
        if first == "0":
            self.pos += 1
        elif first in "123456789" and first:
            self.skip(_DIGITS)
        else:
            raise self.error("not a JSON object (Expecting value)")
        kind = "int"
        if self.peek() == "." and self.peek(1) in "0123456789" and self.peek(1):
            self.pos += 1
            self.skip(_DIGITS)
            kind = "float"
        if self.peek() in ("e", "E"):
            sign = 1 if self.peek(1) in ("+", "-") else 0
            if self.peek(1 + sign) in "0123456789" and self.peek(1 + sign):
                self.pos += 1 + sign
                self.skip(_DIGITS)
                kind = "float"
        return kind

    def _key(self) -> str:
        """A key of the top object (its first KEY_CHARS characters, with "..." when longer)."""
        held: list[str] = []
        size = 0
        for piece in self.string_pieces(KEY_CHARS):
            if size <= KEY_CHARS:
                held.append(piece)
            size += len(piece)
        key = "".join(held)
        return key if size <= KEY_CHARS else key[:KEY_CHARS] + "..."

    def string_pieces(self, piece: int) -> Iterator[str]:
        """The decoded characters of the string that starts here, in pieces of about ``piece`` characters."""
        self.pos += 1  # the opening quote
        held: list[str] = []
        size = 0
        while True:
            run = _STRING_RUN.match(self.buf, self.pos)
            if run:
                held.append(run.group())
                size += run.end() - self.pos
                self.pos = run.end()
            c = self.peek()
            if c == '"':
                self.pos += 1
                if held:
                    yield "".join(held)
                return
            if c == "\\":
                held.append(self._escape())
                size += 1
            elif c == "":
                raise self.error("not a JSON object (Unterminated string starting at)")
            elif c < " ":
                raise self.error(f"not a JSON object (Invalid control character {c!r})")
            # else the run stopped at the end of the buffer: go on with the next block
            if size >= piece:
                yield "".join(held)
                held, size = [], 0

    def _escape(self) -> str:
        code = self.peek(1)
        if code in _ESCAPES and code:
            self.pos += 2
            return _ESCAPES[code]
        if code != "u":
            raise self.error("not a JSON object (Invalid \\escape)")
        value = self._hex4(2)
        self.pos += 6
        if 0xD800 <= value <= 0xDBFF and self.peek() == "\\" and self.peek(1) == "u":
            low = self._hex4(2)
            if 0xDC00 <= low <= 0xDFFF:  # a surrogate pair is one character, as json.loads makes it
                self.pos += 6
                return chr(0x10000 + ((value - 0xD800) << 10) + (low - 0xDC00))
        return chr(value)

    def _hex4(self, at: int) -> int:
        digits = "".join(self.peek(at + i) for i in range(4))
        if len(digits) != 4 or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error("not a JSON object (Invalid \\uXXXX escape)")
        return int(digits, 16)
