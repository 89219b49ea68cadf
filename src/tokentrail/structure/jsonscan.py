"""Where each leaf of a JSON value stands in already-generated text.

`JsonScanner` is fed text in pieces (as segments arrive) and reports each leaf value
(string, number, true, false, null) with its path and its char and UTF-8 byte offsets,
as soon as the leaf is complete: a string at its closing quote, a literal at its last
letter, a number at the first character after it (or at `finish`). It is a locator, not
a validator or a grammar: it follows the structure ({ } [ ] , :) and string escapes so
that it knows where each leaf is; the leaf's value is parsed later with `json.loads`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["JsonLeaf", "JsonScanner", "json_pointer"]

_WS = frozenset(" \t\n\r")
_NUMBER = frozenset("0123456789+-.eE")
_LITERALS = {"t": "true", "f": "false", "n": "null"}

# States: what the scanner expects next.
_VALUE, _OBJ_FIRST, _KEY, _COLON, _AFTER, _ARR_FIRST, _DONE, _STR, _NUM, _LIT, _ERROR = range(11)


def json_pointer(parts: tuple[str | int, ...]) -> str:
    """RFC 6901 JSON Pointer of a path: "" for the root, "/a/0", "~0" for "~", "~1" for "/"."""
    return "".join(
        "/" + (str(p) if isinstance(p, int) else p.replace("~", "~0").replace("/", "~1"))
        for p in parts
    )


@dataclass(frozen=True, slots=True)
class JsonLeaf:
    """A leaf value's place: its path, and [start, end) in chars and in UTF-8 bytes,
    counted from the first character the scanner was fed."""

    path: tuple[str | int, ...]
    start: int
    end: int
    byte_start: int
    byte_end: int


class JsonScanner:
    """Locates the leaves of one JSON value in text fed piece by piece.

    Leading white space is skipped; the scan stops after the value (`done`, with `end`
    the char offset after it), and text after it is not read. Text that is not JSON
    sets `error` (where and what) and the scanner reads nothing more.
    `containers` maps each finished object's or array's path to its (start, end) chars;
    `opened` maps each container seen so far to its start char.
    """

    def __init__(self) -> None:
        self.text = ""
        self.error: str | None = None
        self.end: int | None = None
        self.containers: dict[tuple[str | int, ...], tuple[int, int]] = {}
        self.opened: dict[tuple[str | int, ...], int] = {}
        self._state = _VALUE
        self._frames: list[list] = []  # [is_object, key or index, start char]
        self._bytes = 0  # byte offset of the next char
        self._tok = (0, 0)  # (char, byte) start of the string/number/literal being read
        self._is_key = False
        self._escape = False
        self._word = ""

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def in_leaf(self) -> bool:
        """Whether a leaf value (not a key) has begun and is not complete yet."""
        return self._state in (_NUM, _LIT) or (self._state == _STR and not self._is_key)

    def feed(self, text: str) -> list[JsonLeaf]:
        """Read more text; return the leaves it completed."""
        out: list[JsonLeaf] = []
        pos = len(self.text)
        self.text += text
        for c in text:
            if self._state >= _DONE:
                if self._state == _STR:
                    self._string_char(c, pos, out)
                elif self._state == _NUM and c in _NUMBER:
                    pass
                elif self._state == _NUM:
                    self._leaf(pos, out)
                    if c not in _WS:
                        self._step(c, pos, out)
                elif self._state == _LIT:
                    self._literal_char(c, pos, out)
                else:
                    break  # done or failed: read no further
            elif c not in _WS:
                self._step(c, pos, out)
            pos += 1
            self._bytes += 1 if c < "\x80" else len(c.encode("utf-8", "surrogatepass"))
        return out

    def finish(self) -> list[JsonLeaf]:
        """End of text: a number still open ends here; an unfinished value is an error."""
        out: list[JsonLeaf] = []
        if self._state == _NUM:
            self._leaf(len(self.text), out)
        if self._state not in (_DONE, _ERROR):
            self._fail(len(self.text), "the text ends inside the JSON value")
        return out

    # -- one character -------------------------------------------------------------

    def _path(self) -> tuple[str | int, ...]:
        return tuple(f[1] for f in self._frames)

    def _fail(self, pos: int, what: str) -> None:
        self.error = f"not JSON at char {pos}: {what}"
        self._state = _ERROR

    def _step(self, c: str, pos: int, out: list[JsonLeaf]) -> None:
        """A structural character (not white space) in state `_state`."""
        state = self._state
        if state in (_VALUE, _ARR_FIRST):
            if state == _ARR_FIRST and c == "]":
                self._close(c, pos)
            else:
                self._value(c, pos)
        elif state in (_OBJ_FIRST, _KEY):
            if c == '"':
                self._tok, self._is_key, self._state = (pos, self._bytes), True, _STR
            elif c == "}" and state == _OBJ_FIRST:
                self._close(c, pos)
            else:
                self._fail(pos, f"expected a key in quotes, found {c!r}")
        elif state == _COLON:
            if c == ":":
                self._state = _VALUE
            else:
                self._fail(pos, f"expected ':' after a key, found {c!r}")
        elif state == _AFTER:
            frame = self._frames[-1]
            if c == ",":
                if frame[0]:
                    self._state = _KEY
                else:
                    frame[1] += 1
                    self._state = _VALUE
            elif c == ("}" if frame[0] else "]"):
                self._close(c, pos)
            else:
                kind = "object" if frame[0] else "array"
                self._fail(pos, f"expected ',' or the end of the {kind}, found {c!r}")
        # _DONE, _ERROR: nothing more is read

    def _value(self, c: str, pos: int) -> None:
        if c == '"':
            self._tok, self._is_key, self._state = (pos, self._bytes), False, _STR
        elif c == "-" or "0" <= c <= "9":
            self._tok, self._state = (pos, self._bytes), _NUM
        elif c in _LITERALS:
            self._tok, self._word, self._state = (pos, self._bytes), _LITERALS[c], _LIT
        elif c in "{[":
            self.opened[self._path()] = pos
            self._frames.append([c == "{", None if c == "{" else 0, pos])
            self._state = _OBJ_FIRST if c == "{" else _ARR_FIRST
        else:
            self._fail(pos, f"expected a value, found {c!r}")

    def _close(self, c: str, pos: int) -> None:
        frame = self._frames.pop()
        self.containers[self._path()] = (frame[2], pos + 1)
        self._after(pos + 1)

    def _after(self, end: int) -> None:
        """A value ended at char `end`."""
        if self._frames:
            self._state = _AFTER
        else:
            self._state, self.end = _DONE, end

    def _leaf(self, end: int, out: list[JsonLeaf]) -> None:
        start, bstart = self._tok
        nbytes = len(self.text[start:end].encode("utf-8", "surrogatepass"))
        out.append(JsonLeaf(self._path(), start, end, bstart, bstart + nbytes))
        self._after(end)

    def _string_char(self, c: str, pos: int, out: list[JsonLeaf]) -> None:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            if self._is_key:
                self._frames[-1][1] = json.loads(self.text[self._tok[0] : pos + 1])
                self._state = _COLON
            else:
                self._leaf(pos + 1, out)
        elif c < " ":
            self._fail(pos, f"control character {c!r} inside a string")

    def _literal_char(self, c: str, pos: int, out: list[JsonLeaf]) -> None:
        k = pos - self._tok[0]
        if c != self._word[k]:
            self._fail(pos, f"expected {self._word!r}")
        elif k + 1 == len(self._word):
            self._leaf(pos + 1, out)
