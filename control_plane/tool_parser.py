"""Tool calling on the chat API, the response side: tool calls read out of the model's text.

Owns the parsers, each fed the output's text deltas and giving OpenAI chat-chunk deltas
(`{"content": ...}` and `{"tool_calls": [...]}` dicts), plus whole-output helpers built on them:
  * `HermesToolParser` / `parse_tool_calls` (tool_choice "auto"): calls written as
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` among ordinary content;
  * `NamedToolParser` / `parse_named` (tool_choice naming a function): the output is the
    arguments object, made so by guided decoding;
  * `RequiredToolParser` / `parse_required` (tool_choice "required"): the output is a JSON
    array of `{"name", "parameters"}` objects, made so by guided decoding.
All three stream a call's arguments as they are generated: first a delta with the call's
index, id, type, name and empty arguments, then argument fragments whose concatenation is the
call's arguments, re-serialized canonically (control_plane.json_stream), so any split of the
output gives the same arguments as parsing it whole. The deltas' shapes and the reading of one
call object are control_plane.tool_calls's.
"""

from __future__ import annotations

from typing import Any

from control_plane.json_stream import JsonError, JsonEvents, canonical
from control_plane.tool_calls import (
    CallAssembler,
    Malformed,
    arguments_delta,
    coalesce,
    collect,
    header_delta,
    new_call_id,
)
from control_plane.tools import NamedToolChoice, resolve_tool_choice

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


# -- tool_choice "auto": Hermes-style tags -----------------------------------------------------
class _Block:
    """One `<tool_call>` block being read: its text, and its deltas until they are sent."""

    def __init__(self, index: int) -> None:
        self.inner = ""  # the text after the opening tag
        self.json = JsonEvents()
        self.call = CallAssembler(index, "arguments")
        self.pending: list[dict] = []
        self.failed = False
        self.committed = False  # its header was sent: it is a call whatever follows

    @property
    def complete(self) -> bool:
        return self.call.done and not self.failed

    def feed(self, text: str) -> None:
        self.inner += text
        if self.failed:
            return
        events: list = []
        try:
            used = self.json.feed(text, events) if not self.json.done else 0
            for event in events:
                self.pending += self.call.on_event(event)
            if text[used:].strip():
                raise Malformed("text after the call's JSON object")
        except (JsonError, Malformed):
            self.failed = True


def _tag_prefix_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class HermesToolParser:
    """Reads `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks out of
    streamed text. Text outside blocks is content, less the whitespace between it and a call
    (what separates content before a call from content after it is kept once); a possible tag
    prefix is held back, so no tag text leaks into content. A block whose JSON is not a call
    (malformed, no name, cut off) stays content, from its opening tag on.

    Streaming must commit before it knows everything: a call is announced (its header sent) at
    the end of the first `feed` where its name is known. If its JSON later breaks or is cut
    off, the call stands with the arguments sent so far and the rest of the block is dropped;
    parsing the same text whole (`finish(text)` on a fresh parser) keeps such a block as
    content. Any split of well-formed output gives the same content and calls."""

    def __init__(self) -> None:
        self._buffer = ""  # text not yet consumed (a held-back tag prefix)
        self._block: _Block | None = None
        self._calls = 0  # calls made so far; the next call's index
        self._space = ""  # content's trailing whitespace, dropped if a call follows
        self._after_call = False  # no content since the last call
        self._emitted = False  # some content was sent
        self.tool_called = False

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        self._buffer += text
        self._scan(out, final=False)
        block = self._block
        if block is not None and block.pending:  # the name is known: announce the call
            self._commit(block, out)
        return coalesce(out)

    def finish(self, text: str = "") -> tuple[list[dict], bool]:
        """The last deltas (with `text`, the output's rest), and whether any call was made
        (then finish_reason is "tool_calls")."""
        out: list[dict] = []
        self._buffer += text
        self._scan(out, final=True)
        if self._space and not self._after_call:  # whitespace after a call is dropped
            out.append({"content": self._space})
            self._space = ""
        return coalesce(out), self.tool_called

    def _scan(self, out: list[dict], final: bool) -> None:
        progressing = True
        while progressing:
            if self._block is None:
                progressing = self._scan_content(out, final)
            else:
                progressing = self._scan_block(out, final)

    def _scan_content(self, out: list[dict], final: bool) -> bool:
        start = self._buffer.find(OPEN_TAG)
        if start < 0:
            end = len(self._buffer) - (0 if final else _tag_prefix_length(self._buffer, OPEN_TAG))
            self._content(self._buffer[:end], out)
            self._buffer = self._buffer[end:]
            return False
        self._content(self._buffer[:start], out)
        self._buffer = self._buffer[start + len(OPEN_TAG):]
        self._block = _Block(self._calls)
        return True

    def _scan_block(self, out: list[dict], final: bool) -> bool:
        block, text = self._block, self._buffer
        close = text.find(CLOSE_TAG)
        end = close if close >= 0 else \
            len(text) - (0 if final else _tag_prefix_length(text, CLOSE_TAG))
        block.feed(text[:end])
        self._buffer = text[end:]
        ended = close >= 0 or final
        if not block.committed and (block.failed or (ended and not block.complete)):
            self._reject(block, out)
            return True
        if ended:  # a call; a committed one stands even if its JSON broke
            self._buffer = self._buffer[len(CLOSE_TAG):]
            self._accept(block, out)
        return ended

    def _commit(self, block: _Block, out: list[dict]) -> None:
        out += block.pending
        block.pending = []
        block.committed = self.tool_called = True
        self._space = ""

    def _accept(self, block: _Block, out: list[dict]) -> None:
        self._commit(block, out)
        self._block, self._after_call = None, True
        self._calls += 1

    def _reject(self, block: _Block, out: list[dict]) -> None:
        # Not a call: its opening tag is content, and reading resumes right after it.
        self._content(OPEN_TAG, out)
        self._buffer = block.inner + self._buffer
        self._block = None

    def _content(self, text: str, out: list[dict]) -> None:
        if self._after_call:
            stripped = text.lstrip()
            if self._emitted:  # kept only if content resumes: it separates the two parts
                self._space += text[:len(text) - len(stripped)]
            text, self._after_call = stripped, not stripped
        if not text:
            return
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            out.append({"content": body})
            self._emitted = True


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole output in the Hermes format: (content or None, tool calls)."""
    deltas, _ = HermesToolParser().finish(text)
    return collect(deltas)


# -- tool_choice forcing a call: the output is JSON ----------------------------------------------
class NamedToolParser:
    """The output is the arguments of function `name` (guided decoding makes it that JSON
    object). The header comes with the first delta, then the arguments as they are generated;
    output cut off before the JSON ends leaves the arguments cut off too."""

    def __init__(self, name: str) -> None:
        self._call_id, self._name = new_call_id(), name
        self._json = JsonEvents()
        self._started = self._broken = False

    def feed(self, text: str) -> list[dict]:
        out = []
        if not self._started:
            self._started = True
            out.append(header_delta(0, self._call_id, self._name))
        events: list = []
        if not self._broken:
            try:
                self._json.feed(text, events)
            except JsonError:
                self._broken = True  # the fragments before the error stand
        fragment = "".join(canonical(event) for event in events)
        if fragment:
            out.append(arguments_delta(0, fragment))
        return out

    def finish(self, text: str = "") -> tuple[list[dict], bool]:
        return self.feed(text), True


class RequiredToolParser:
    """The output is a JSON array of `{"name": ..., "parameters": {...}}` (guided decoding
    makes it so); each element is a call, streamed as it is generated."""

    def __init__(self) -> None:
        self._json = JsonEvents()
        self._depth = 0
        self._call: CallAssembler | None = None
        self._count = 0
        self._broken = False
        self.tool_called = False

    def feed(self, text: str) -> list[dict]:
        events: list = []
        if not self._broken:
            try:
                self._json.feed(text, events)
            except JsonError:
                self._broken = True
        out: list[dict] = []
        try:
            for event in events:
                out += self._route(event)
        except Malformed:
            self._broken = True
        self.tool_called = self.tool_called or bool(out)
        return coalesce(out)

    def finish(self, text: str = "") -> tuple[list[dict], bool]:
        return self.feed(text), self.tool_called

    def _route(self, event: tuple[str, str]) -> list[dict]:
        if self._call is not None:
            deltas = self._call.on_event(event)
            if self._call.done:
                self._call, self._count = None, self._count + 1
            return deltas
        if self._depth == 0 and event == ("open", "["):
            self._depth = 1
        elif self._depth == 1 and event == ("open", "{"):
            self._call = CallAssembler(self._count, "parameters")
            return self._call.on_event(event)
        elif self._depth == 0 or event[0] not in ("comma", "close"):
            raise Malformed("expected an array of calls")
        return []


def parse_named(text: str, name: str) -> list[dict]:
    """The tool calls of a whole output under a tool_choice naming function `name`."""
    deltas, _ = NamedToolParser(name).finish(text)
    return collect(deltas)[1]


def parse_required(text: str) -> list[dict]:
    """The tool calls of a whole output under tool_choice "required"."""
    deltas, _ = RequiredToolParser().finish(text)
    return collect(deltas)[1]


def make_tool_parser(tools: Any, tool_choice: Any
                     ) -> HermesToolParser | NamedToolParser | RequiredToolParser | None:
    """The streaming parser for a request's tool choice; None when calls are off ("none")."""
    choice = resolve_tool_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        return NamedToolParser(choice.function.name)
    return {"none": None, "auto": HermesToolParser(),
            "required": RequiredToolParser()}[choice]
