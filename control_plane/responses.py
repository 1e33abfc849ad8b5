"""OpenAI response bodies and stream chunks, completions and chat, with their log-probabilities.

`ResponseBuilder` writes one request's envelope (id, created, model) around choices; a choice is
one sequence's text (index i of n), its finish reason, and optionally its log-probabilities and
tool calls. `LogprobsFormatter` turns the instances' `TokenLogprobs` into OpenAI's shapes: chat
`{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`, completions vLLM's
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with `echo`, the prompt's tokens
first, the first of them without a log-probability). Nothing here runs for a request that asked
for no log-probabilities.
"""

from __future__ import annotations

import json
import time
import uuid
from functools import lru_cache
from typing import Any

from common.protocol import TokenLogprobs
from common.tokenizer import TextTokenizer


class LogprobsFormatter:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprobs]) -> dict:
        return {"content": [self._chat_entry(e) for e in entries]}

    def _chat_entry(self, entry: TokenLogprobs) -> dict:
        text = self.token_text(entry.token_id)
        top = [{"token": (t := self.token_text(i)), "logprob": lp, "bytes": list(t.encode())}
               for i, lp in zip(entry.top_ids, entry.top_logprobs)]
        return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode()),
                "top_logprobs": top}

    def completion(self, entries: list[TokenLogprobs | None], token_ids: list[int],
                   offset: int = 0) -> tuple[dict, int]:
        """The completions shape for `token_ids` (their entries, None where a token has no
        log-probability: the first of an echoed prompt); returns it and the text offset after."""
        body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                 "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id)
            body["tokens"].append(text)
            body["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(entry.logprob)
            top = {self.token_text(i): lp for i, lp in zip(entry.top_ids, entry.top_logprobs)}
            body["top_logprobs"].append(top)
        return body, offset


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """Builds one request's responses or stream chunks in the completions or chat format."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sent_role: set[int] = set()  # choices whose first chunk went out
        # The serialized envelope up to the choices, for chunk_json: a stream sends one chunk
        # per generated token, and only the text changes from one to the next.
        name = "chat.completion.chunk" if chat else "text_completion"
        self._chunk_head = json.dumps(self._envelope(name, []))[:-len("[]}")]

    def _envelope(self, object_name: str, choices: list, extra: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices}
        body.update(extra or {})
        return body

    def chunk(self, text: str, finish_reason: str | None, usage_now: dict | None = None,
              index: int = 0, logprobs: dict | None = None,
              tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            delta: dict[str, Any] = {}
            if index not in self.sent_role:
                delta["role"] = "assistant"  # carried by the first chunk, with its text
                self.sent_role.add(index)
            if tool_calls:
                delta["tool_calls"] = tool_calls
            elif text or finish_reason is None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            name = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            name = "text_completion"
        return self._envelope(name, [choice], {"usage": usage_now} if usage_now else None)

    def chunk_json(self, text: str, finish_reason: str | None,
                   usage_now: dict | None = None) -> str:
        """`json.dumps(self.chunk(text, finish_reason, usage_now))` for choice 0 without
        log-probabilities, the same text, without building and encoding the envelope again for
        every token."""
        if finish_reason is not None or usage_now or (self.chat and 0 not in self.sent_role):
            return json.dumps(self.chunk(text, finish_reason, usage_now))
        key = '"delta": {"content": ' if self.chat else '"text": '
        close = "}" if self.chat else ""
        return (f'{self._chunk_head}[{{"index": 0, {key}{json.dumps(text)}{close}, '
                f'"logprobs": null, "finish_reason": null}}]}}')

    def usage_chunk(self, usage_total: dict) -> dict:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(name, [], {"usage": usage_total})

    def choice(self, text: str | None, finish_reason: str | None, index: int = 0,
               logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        """One choice of a whole (non-streamed) response."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def response(self, text: str, finish_reason: str | None, usage_total: dict) -> dict:
        return self.response_of([self.choice(text, finish_reason)], usage_total)

    def response_of(self, choices: list[dict], usage_total: dict) -> dict:
        name = "chat.completion" if self.chat else "text_completion"
        return self._envelope(name, choices, {"usage": usage_total})
