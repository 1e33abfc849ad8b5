"""Tool calls as the chat API returns them, built from the JSON of one call at a time.

Owns the shapes of tool-call deltas in chat chunks (`header_delta`: index, id, type, name and
empty arguments; `arguments_delta`: a fragment of the arguments), `CallAssembler` (one
`{"name": ..., <arguments key>: {...}}` object's JSON events -> those deltas), `coalesce`
(fewer, larger deltas) and `collect` (deltas -> the whole message). The formats that contain
calls (Hermes tags, forced JSON) are control_plane.tool_parser's.
"""

from __future__ import annotations

import uuid

from control_plane.json_stream import canonical


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def header_delta(index: int, call_id: str, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def arguments_delta(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


class Malformed(ValueError):
    """JSON that is not a tool call (no name, arguments not an object, a repeated key)."""


class CallAssembler:
    """Turns the JSON events of one `{"name": ..., <args_key>: {...}}` object into deltas: the
    header once the name is complete, then the arguments' canonical text (held until the name
    is known, since a call cannot be announced without it). Other keys are ignored."""

    def __init__(self, index: int, args_key: str) -> None:
        self.index, self.args_key = index, args_key
        self.call_id = new_call_id()
        self.name: str | None = None
        self.done = False
        self._depth = 0  # containers open, the call object included
        self._key: str | None = None  # the call object's key whose value is being read
        self._seen: set[str] = set()
        self._value_started = False
        self._name_parts: list[str] = []
        self._held: list[str] = []  # arguments text before the name is known

    def on_event(self, event: tuple[str, str]) -> list[dict]:
        kind, value = event
        if self._depth == 0:
            if self.done or event != ("open", "{"):
                raise Malformed("a tool call must be one JSON object")
            self._depth = 1
            return []
        if self._depth == 1 and kind in ("key", "comma", "close"):
            return self._member(kind, value)
        first = not self._value_started
        self._value_started = True
        self._depth += {"open": 1, "close": -1}.get(kind, 0)
        if self._key == "name":
            return self._name_event(kind, value)
        if self._key == self.args_key:
            if first and event != ("open", "{"):
                raise Malformed(f"{self.args_key} must be a JSON object")
            return self._emit_arguments(canonical(event))
        return []

    def _member(self, kind: str, key: str) -> list[dict]:
        if kind == "key":
            if key in self._seen:
                raise Malformed(f"repeated key {key!r}")
            self._seen.add(key)
            self._key, self._value_started = key, False
            return []
        if kind == "comma":
            return []
        self._depth, self.done = 0, True  # the call object closed
        if self.name is None:
            raise Malformed("a tool call needs a name")
        return [] if self.args_key in self._seen else self._emit_arguments("{}")

    def _name_event(self, kind: str, value: str) -> list[dict]:
        if kind == "chars":
            self._name_parts.append(value)
            return []
        if kind == "str_start":
            return []
        name = "".join(self._name_parts)
        if kind != "str_end" or not name:
            raise Malformed("the name must be a non-empty string")
        self.name = name
        deltas = [header_delta(self.index, self.call_id, name)]
        if self._held:
            deltas.append(arguments_delta(self.index, "".join(self._held)))
        return deltas

    def _emit_arguments(self, text: str) -> list[dict]:
        if self.name is None:
            self._held.append(text)
            return []
        return [arguments_delta(self.index, text)]


def coalesce(deltas: list[dict]) -> list[dict]:
    """Merge neighbouring content deltas, and neighbouring argument fragments of one call."""
    merged: list[dict] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
        elif last is not None and _is_fragment(delta) and _is_fragment(last) \
                and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]:
            last["tool_calls"][0]["function"]["arguments"] += \
                delta["tool_calls"][0]["function"]["arguments"]
        else:
            merged.append(delta)
    return merged


def _is_fragment(delta: dict) -> bool:
    return "tool_calls" in delta and "id" not in delta["tool_calls"][0]


def collect(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """The whole message the deltas make: (content or None, tool calls as in a response's
    `message.tool_calls`: `{"id", "type", "function": {"name", "arguments"}}`)."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"id": None, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
            call["id"] = part.get("id") or call["id"]
            call["function"]["name"] += part["function"].get("name") or ""
            call["function"]["arguments"] += part["function"].get("arguments") or ""
    return "".join(content) or None, [calls[index] for index in sorted(calls)]
