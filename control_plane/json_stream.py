"""Incremental JSON: a push parser fed text fragments, and the canonical text of what it reads.

Owns `JsonEvents` (reports each piece of JSON structure as soon as it is certain, however the
text was split, and where the top-level value ended) and `canonical(event)` (the compact,
re-serialized text of one event). Tool-call arguments are streamed as the canonical text of
their events (control_plane.tool_parser), so a call's arguments come out the same whether the
model's output arrives whole or token by token, whatever whitespace the model wrote.

Events are `(kind, value)` pairs:
  ("open", "{" | "[")   ("close", "}" | "]")   ("comma", ",")   ("key", decoded key)
  ("str_start", '"')    ("chars", decoded text) ("str_end", '"')  ("scalar", number/true/false/null)
A string value streams as str_start, any number of chars, str_end; a key comes whole.
"""

from __future__ import annotations

import json
import re

_WHITESPACE = re.compile(r"[ \t\n\r]+")
_STRING_RUN = re.compile(r'[^"\\]+')
_NUMBER_RUN = re.compile(r"[0-9+\-.eE]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_LITERALS = ("true", "false", "null")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}
_SURROGATE = re.compile("[\ud800-\udfff]")

# Parser states (outside strings, numbers and literals, whitespace is skipped in all of them).
_VALUE = "value"              # a value must come
_ARRAY_FIRST = "array_first"  # after "[": a value or "]"
_OBJECT_FIRST = "object_first"  # after "{": a key or "}"
_KEY = "key"                  # after "," in an object: a key
_COLON = "colon"
_AFTER = "after"              # after a value: "," or the closing bracket
_STRING, _ESCAPE, _NUMBER_TOKEN, _LITERAL, _DONE = "string", "escape", "number", "literal", "done"


class JsonError(ValueError):
    """The text is not JSON (the message says where it went wrong)."""


class JsonEvents:
    """Push parser for one JSON value. `feed` may be called with any split of the text.

    Lenient in one way only: raw control characters inside strings (models write raw newlines
    in code arguments) are accepted and come out escaped in the canonical text."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # open containers, "{" or "["
        self._state = _VALUE
        self._token = ""  # the number, literal or escape sequence read so far
        self._in_key = False
        self._key_parts: list[str] = []
        self._high: int | None = None  # a \\uD8xx escape waiting for its low surrogate

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, text: str, events: list) -> int:
        """Append the events `text` completes to `events`; return how many characters of
        `text` the value used (all of them until the value ends). Raises JsonError, with the
        events before the error already appended."""
        i = 0
        while i < len(text) and self._state != _DONE:
            i = self._step(text, i, events)
        return i

    def end(self, events: list) -> None:
        """The text has ended: complete a top-level number, or raise if the value is cut."""
        if self._state == _NUMBER_TOKEN and not self._stack:
            self._finish_number(events)
        if self._state != _DONE:
            raise JsonError("the JSON value is incomplete")

    # -- one step: consume from text[i:], return the next position -------------------------
    def _step(self, text: str, i: int, events: list) -> int:
        state = self._state
        if state == _STRING:
            return self._string(text, i, events)
        if state == _ESCAPE:
            self._escape(text[i], events)
            return i + 1
        if state == _NUMBER_TOKEN:
            match = _NUMBER_RUN.match(text, i)
            if match:
                self._token += match.group()
                return match.end()
            self._finish_number(events)
            return i  # the character after the number is read in the new state
        if state == _LITERAL:
            self._literal(text[i], events)
            return i + 1
        match = _WHITESPACE.match(text, i)
        if match:
            return match.end()
        self._structural(text[i], events)
        return i + 1

    def _structural(self, char: str, events: list) -> None:
        state = self._state
        if state in (_OBJECT_FIRST, _KEY) and char == '"':
            self._in_key, self._key_parts, self._state = True, [], _STRING
        elif state == _COLON and char == ":":
            self._state = _VALUE
        elif state == _AFTER and char == ",":
            events.append(("comma", ","))
            self._state = _KEY if self._stack[-1] == "{" else _VALUE
        elif char in "}]" and (state == _AFTER or (state, char) in (
                (_OBJECT_FIRST, "}"), (_ARRAY_FIRST, "]"))):
            if self._stack[-1] != {"}": "{", "]": "["}[char]:
                raise JsonError(f"unexpected {char!r}")
            self._stack.pop()
            events.append(("close", char))
            self._value_done()
        elif state in (_VALUE, _ARRAY_FIRST):
            self._start_value(char, events)
        else:
            raise JsonError(f"unexpected {char!r}")

    def _start_value(self, char: str, events: list) -> None:
        if char in "{[":
            self._stack.append(char)
            events.append(("open", char))
            self._state = _OBJECT_FIRST if char == "{" else _ARRAY_FIRST
        elif char == '"':
            self._in_key, self._state = False, _STRING
            events.append(("str_start", '"'))
        elif char == "-" or char.isdigit():
            self._token, self._state = char, _NUMBER_TOKEN
        elif char in "tfn":
            self._token, self._state = "", _LITERAL
            self._literal(char, events)
        else:
            raise JsonError(f"unexpected {char!r} where a value should start")

    def _value_done(self) -> None:
        self._state = _AFTER if self._stack else _DONE

    # -- tokens ---------------------------------------------------------------------------
    def _finish_number(self, events: list) -> None:
        if not _NUMBER.fullmatch(self._token):
            raise JsonError(f"bad number {self._token!r}")
        events.append(("scalar", self._token))
        self._value_done()

    def _literal(self, char: str, events: list) -> None:
        self._token += char
        if self._token in _LITERALS:  # no literal is a prefix of another: complete now
            events.append(("scalar", self._token))
            self._value_done()
        elif not any(word.startswith(self._token) for word in _LITERALS):
            raise JsonError(f"unexpected {self._token!r}")

    def _string(self, text: str, i: int, events: list) -> int:
        match = _STRING_RUN.match(text, i)
        if match:
            self._chars(match.group(), events)
            return match.end()
        if text[i] == "\\":
            self._token, self._state = "", _ESCAPE
            return i + 1
        self._flush_high(events)  # the closing quote
        self._state = _COLON if self._in_key else _AFTER
        if self._in_key:
            events.append(("key", "".join(self._key_parts)))
        else:
            events.append(("str_end", '"'))
            self._value_done()
        return i + 1

    def _escape(self, char: str, events: list) -> None:
        """Read one character of an escape sequence (after the backslash)."""
        self._token += char
        if self._token[0] != "u":
            if self._token not in _SIMPLE_ESCAPES:
                raise JsonError(f"bad escape \\{self._token}")
            self._chars(_SIMPLE_ESCAPES[self._token], events)
        elif len(self._token) == 5:
            if not _HEX4.fullmatch(self._token[1:]):
                raise JsonError(f"bad escape \\{self._token}")
            self._code_unit(int(self._token[1:], 16), events)
        else:
            return
        self._state = _STRING

    def _code_unit(self, unit: int, events: list) -> None:
        # A surrogate pair arrives as two escapes; json.loads joins them into one character.
        if self._high is not None and 0xDC00 <= unit <= 0xDFFF:
            high, self._high = self._high, None
            self._chars(chr(0x10000 + ((high - 0xD800) << 10) + (unit - 0xDC00)), events)
        elif 0xD800 <= unit <= 0xDBFF:
            self._flush_high(events)
            self._high = unit
        else:
            self._chars(chr(unit), events)

    def _flush_high(self, events: list) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            self._chars(chr(high), events)  # a lone surrogate: kept, escaped by canonical()

    def _chars(self, text: str, events: list) -> None:
        if self._high is not None:
            self._flush_high(events)
        if self._in_key:
            self._key_parts.append(text)
        else:
            events.append(("chars", text))


def _escape_text(text: str) -> str:
    # json.dumps escapes per character, so escaping fragments equals escaping their sum; lone
    # surrogates are written as \\u escapes so the result can always be encoded as UTF-8.
    body = json.dumps(text, ensure_ascii=False)[1:-1]
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", body)


def canonical(event: tuple[str, str]) -> str:
    """The event's text in compact JSON with json.dumps's separators (", " and ": ")."""
    kind, value = event
    if kind == "chars":
        return _escape_text(value)
    if kind == "key":
        return f'"{_escape_text(value)}": '
    if kind == "comma":
        return ", "
    return value  # open, close, str_start, str_end, scalar: their own text


def canonical_json(text: str) -> str:
    """The canonical text of a whole JSON value (raises JsonError if it is not one)."""
    events: list = []
    parser = JsonEvents()
    end = parser.feed(text, events)
    parser.end(events)
    if text[end:].strip():
        raise JsonError("text after the JSON value")
    return "".join(canonical(event) for event in events)
