"""The ndjson commit payload, parsed as it streams in, with bounded memory whatever the file sizes.

huggingface_hub sends a commit as one JSON object per line; a file travels base64-encoded inside its line
(``{"key": "file", "value": {"content": "<base64>", "path": ..., "encoding": "base64"}}``), so one line can be
gigabytes long. Lines up to 1 MiB are parsed with ``json.loads``. A longer line goes through a small streaming
parser (:class:`_LongLine`) that base64-decodes the ``value.content`` string straight into a file as it arrives;
everything else on such a line is limited to 1 MiB and strings elsewhere to 64 KiB. The server thus holds about a
megabyte per upload, and the decoded files wait on disk (``<root>/.tmp``) until ``git hash-object`` stores them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import HubError
from .http import MAX_JSON_DEPTH, BodyReader, json_problem
from .names import utf8_ok, validate_path, validate_text
from .storage import CommitOp

READ_SIZE = 1 << 18
SMALL_LINE = 1 << 20
INLINE_STRING = 1 << 16
MAX_OPS = 100_000
_STRING_SPECIAL = re.compile(rb'["\\]')
_SCALAR_END = re.compile(rb"[,}\]\s]")
_ESCAPES = {ord('"'): b'"', ord("\\"): b"\\", ord("/"): b"/", ord("b"): b"\b", ord("f"): b"\f", ord("n"): b"\n",
            ord("r"): b"\r", ord("t"): b"\t"}
_EOF = object()


def _malformed(msg: str) -> HubError:
    return HubError(400, f"Malformed commit payload: {msg}")


@dataclass
class Payload:
    header: dict | None = None
    ops: list[CommitOp] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # decoded contents of the "add" ops, in order


class _Stream:
    """A window on the body: ``buf[pos:]`` is read but not yet consumed."""

    def __init__(self, body: BodyReader):
        self.body, self.buf, self.pos, self.eof = body, b"", 0, False

    def fill(self) -> bool:
        if self.eof:
            return False
        data = self.body.read(READ_SIZE)
        if not data:
            self.eof = True
            return False
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        return True

    def line(self):
        """The next line (without its newline) if it is at most SMALL_LINE bytes, None if it is longer (nothing
        consumed), _EOF at the end of the body."""
        while True:
            i = self.buf.find(b"\n", self.pos)
            if 0 <= i and i - self.pos <= SMALL_LINE:
                line, self.pos = self.buf[self.pos:i], i + 1
                return line
            if len(self.buf) - self.pos > SMALL_LINE:
                return None
            if not self.fill():
                if self.pos >= len(self.buf):
                    return _EOF
                line, self.pos = self.buf[self.pos:], len(self.buf)
                return line

    def peek(self) -> int | None:
        while self.pos >= len(self.buf):
            if not self.fill():
                return None
        return self.buf[self.pos]


class _Base64File:
    """Decodes base64 text written in pieces into a file (strict: only the alphabet, padding only at the end)."""

    def __init__(self, path: Path):
        self.path, self.f, self.pending, self.padded, self.size = path, open(path, "wb"), b"", False, 0

    def write(self, text: bytes) -> None:
        data = self.pending + text
        cut = len(data) - len(data) % 4
        self.pending = data[cut:]
        if not cut:
            return
        if self.padded:
            raise ValueError("data after padding")
        piece = data[:cut]
        self.padded = piece.endswith(b"=")
        out = binascii.a2b_base64(piece, strict_mode=True)
        self.f.write(out)
        self.size += len(out)

    def close(self) -> None:
        self.f.close()
        if self.pending:
            raise ValueError("truncated base64")


class _LongLine:
    """A recursive-descent JSON parser over the stream, for one line longer than SMALL_LINE."""

    def __init__(self, s: _Stream, lineno: int, sink_path: Path):
        self.s, self.lineno, self.sink_path = s, lineno, sink_path
        self.inline_bytes = 0
        self.spilled: _Base64File | None = None

    def parse(self):
        value = self._value((), 0)
        while (c := self.s.peek()) is not None and c != ord("\n"):
            if c not in b" \t\r":
                raise self._error("extra data after the JSON object")
            self._take(1)
        if c is not None:
            self._take(1)
        return value

    def _error(self, msg: str) -> HubError:
        return _malformed(f"line {self.lineno} is not valid JSON ({msg}).")

    def _take(self, n: int) -> None:
        self.s.pos += n
        self.inline_bytes += n
        if self.inline_bytes > SMALL_LINE:
            raise _malformed(f"line {self.lineno} is over {SMALL_LINE} bytes outside a file's content.")

    def _next(self) -> int:
        while (c := self.s.peek()) is not None and c in b" \t\r":
            self._take(1)
        if c is None:
            raise self._error("it ends in the middle")
        return c

    def _expect(self, ch: bytes) -> None:
        if self._next() != ch[0]:
            raise self._error(f"expected {ch.decode()!r}")
        self._take(1)

    def _value(self, path: tuple, depth: int):
        if depth >= MAX_JSON_DEPTH:
            raise self._error(f"nested more than {MAX_JSON_DEPTH} levels deep")
        c = self._next()
        if c == ord("{"):
            return self._object(path, depth)
        if c == ord("["):
            self._take(1)
            out = []
            if self._next() == ord("]"):
                self._take(1)
                return out
            while True:
                out.append(self._value(path + (len(out),), depth + 1))
                if self._next() == ord("]"):
                    self._take(1)
                    return out
                self._expect(b",")
        if c == ord('"'):
            return self._string(path)
        return self._scalar()

    def _object(self, path: tuple, depth: int) -> dict:
        self._take(1)
        out = {}
        if self._next() == ord("}"):
            self._take(1)
            return out
        while True:
            if self._next() != ord('"'):
                raise self._error("expected a key")
            key = self._string(None)
            self._expect(b":")
            out[key] = self._value(path + (key,), depth + 1)
            if self._next() == ord("}"):
                self._take(1)
                return out
            self._expect(b",")

    def _scalar(self):
        while (m := _SCALAR_END.search(self.s.buf, self.s.pos)) is None and len(self.s.buf) - self.s.pos < 64:
            if not self.s.fill():
                break
        end = m.start() if m else len(self.s.buf)
        token = self.s.buf[self.s.pos:end]
        if not token or len(token) > 64:
            raise self._error("bad value")
        self._take(len(token))
        try:
            return json.loads(token)
        except ValueError:
            raise self._error(f"bad value {token[:20]!r}") from None

    def _string(self, path):
        """A string; the one at value.content may be any length and goes to the file sink."""
        self._take(1)
        raw, size, sink = [], 0, None
        while True:
            s = self.s
            m = _STRING_SPECIAL.search(s.buf, s.pos)
            end = m.start() if m else len(s.buf)
            span = s.buf[s.pos:end]
            if sink is not None:
                sink.write(span)
                s.pos = end
            else:  # counted against the line's inline budget when the string ends (at most INLINE_STRING)
                raw.append(span)
                size += len(span)
                s.pos = end
                if size > INLINE_STRING:
                    if path != ("value", "content") or self.spilled is not None:
                        raise _malformed(f"line {self.lineno}: a string of over {INLINE_STRING} bytes outside a "
                                         "file's content.")
                    sink = self.spilled = _Base64File(self.sink_path)
                    sink.write(self._decode(b"".join(raw)).encode())
            if m is None:
                if not s.fill():
                    raise self._error("it ends inside a string")
                continue
            if s.buf[end] == ord('"'):
                if sink is not None:
                    s.pos = end + 1
                    sink.close()
                    return _Spilled(sink.path, sink.size)
                s.pos = end
                self._take(1)
                self.inline_bytes += size
                return self._decode(b"".join(raw))
            esc = self._escape(raw if sink is None else None)
            if sink is not None:
                sink.write(esc)

    def _escape(self, raw: list | None) -> bytes:
        """Consume a backslash escape: appended raw (inline strings) or returned decoded (the file sink)."""
        s = self.s
        while len(s.buf) - s.pos < 6 and s.fill():
            pass
        if len(s.buf) - s.pos < 2:
            raise self._error("it ends inside a string")
        kind = s.buf[s.pos + 1]
        n = 6 if kind == ord("u") else 2
        seq = s.buf[s.pos:s.pos + n]
        if raw is not None:
            raw.append(seq)
            self._take(n)
            return b""
        s.pos += n
        if kind == ord("u"):
            try:
                return chr(int(seq[2:], 16)).encode("utf-8", "surrogatepass")
            except ValueError:
                raise self._error("bad \\u escape") from None
        if kind not in _ESCAPES:
            raise self._error("bad escape")
        return _ESCAPES[kind]

    def _decode(self, raw: bytes) -> str:
        try:
            text = json.loads(b'"' + raw + b'"')
        except ValueError as e:
            raise self._error(f"bad string: {e}") from None
        if not text.isascii() and not utf8_ok(text):
            raise self._error("a string is not valid Unicode (a lone surrogate such as '\\ud800')")
        return text


@dataclass
class _Spilled:
    path: Path
    size: int


def read_commit_payload(body: BodyReader, tmp: Path, on_header=lambda: None) -> Payload:
    """Parse the whole ndjson body into a Payload; file contents are decoded into files under ``tmp``.
    Raises HubError (400) on the first bad line: nothing of such a commit is stored."""
    s, out, lineno = _Stream(body), Payload(), 0
    while True:
        line = s.line()
        if line is _EOF:
            break
        lineno += 1
        sink = tmp / f"{len(out.files)}"
        if line is None:
            parser = _LongLine(s, lineno, sink)
            try:
                item = parser.parse()
            except (ValueError, binascii.Error) as e:
                raise _malformed(f"the content on line {lineno} is not valid base64 ({e}).") from None
            finally:
                if parser.spilled is not None:
                    parser.spilled.f.close()
        elif not line.strip():
            continue
        else:
            item = _loads_line(line, lineno)
        _add_item(out, item, lineno, sink, on_header)
        if len(out.ops) > MAX_OPS:
            raise HubError(413, f"Commit has more than {MAX_OPS} operations; split it into several commits.")
    if out.header is None:
        raise _malformed("it is empty (no 'header' line).")
    return out


def _loads_line(line: bytes, lineno: int):
    try:
        item = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise _malformed(f"line {lineno} is not valid JSON (expected application/x-ndjson, one JSON object per line; "
                         f"{why}).") from None
    problem = json_problem(item, MAX_JSON_DEPTH)
    if problem:
        raise _malformed(f"line {lineno} is refused: {problem}.")
    return item


def _add_item(out: Payload, item, lineno: int, sink: Path, on_header) -> None:
    if not isinstance(item, dict) or not isinstance(item.get("value"), dict):
        raise _malformed(f"line {lineno} must be {{'key': ..., 'value': {{...}}}}.")
    key, value = item.get("key"), item["value"]
    if out.header is None:
        if key != "header":
            raise _malformed("the first line must be the 'header' item.")
        summary, desc = value.get("summary"), value.get("description") or ""
        if not isinstance(summary, str) or not summary.strip():
            raise _malformed("header.summary (the commit title) is required.")
        if not isinstance(desc, str):
            raise _malformed("header.description must be a string.")
        validate_text(summary, "commit summary (header.summary)")
        validate_text(desc, "commit description (header.description)")
        out.header = value
        on_header()
        return
    if key == "file":
        path = validate_path(value.get("path"))
        content = value.get("content")
        if value.get("encoding", "base64") != "base64" or not isinstance(content, (str, _Spilled)):
            raise _malformed(f"file '{path}' must have a base64 'content' and 'encoding': 'base64'.")
        if isinstance(content, str):
            try:
                sink.write_bytes(base64.b64decode(content, validate=True))
            except (binascii.Error, ValueError):
                raise _malformed(f"the content of '{path}' (line {lineno}) is not valid base64.") from None
        out.files.append(sink)
        out.ops.append(CommitOp("add", path))
    elif key == "deletedFile":
        out.ops.append(CommitOp("delete_file", validate_path(value.get("path"))))
    elif key == "deletedFolder":
        out.ops.append(CommitOp("delete_folder", validate_path(value.get("path"), folder=True)))
    elif key == "lfsFile":
        raise HubError(400, "This server stores every file as a regular git blob and does not accept LFS files (its "
                            "preupload always answers uploadMode 'regular'). Upload with huggingface_hub>=2.4 and "
                            "without HF_HUB_DISABLE_XET tricks.")
    else:
        raise _malformed(f"unknown key {key!r} on line {lineno} (expected 'file', 'deletedFile' or "
                         "'deletedFolder').")
