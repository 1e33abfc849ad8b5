"""The OpenAI wire format: request models, their validation, and response/chunk builders.

Accepts what benchmark clients send to vLLM's server (`max_completion_tokens`, `ignore_eos`,
`stream_options` with `include_usage` and `continuous_usage_stats`, `best_of: 1`,
`logprobs: null`, `stop: null`, `top_k`, `min_p`, `stop_token_ids`); unknown fields are
ignored, as vLLM does. What we cannot honour (n > 1, logprobs, echo, penalties) is refused with a 400 that says
so, never silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_is_valid_unicode(cls, value):
        for text in [value] if isinstance(value, str) else value or []:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\\udfff" in JSON)
                raise ValueError("stop strings must be valid Unicode (lone surrogate)") from None
        return value

    def unsupported(self) -> str | None:
        if self.n != 1:
            return "only n=1 is supported"
        if self.best_of not in (None, 1):
            return "only best_of=1 is supported"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty and frequency_penalty are not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed with stream: true"
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int, eos_token_ids: tuple[int, ...]
                        ) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        requested = self.requested_max_tokens()
        top_k = self.top_k if self.top_k and self.top_k > 0 else 0
        params = SamplingParams(
            max_tokens=default_max_tokens if requested is None else requested,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
            min_p=self.min_p or 0.0, seed=self.seed,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            eos_token_ids=eos_token_ids, ignore_eos=self.ignore_eos)
        return params.validate()


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    def unsupported(self) -> str | None:
        if self.logprobs is not None:  # even 0 asks for the sampled token's logprob
            return "logprobs are not supported"
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix is not supported"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> str | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs are not supported"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# -- errors ------------------------------------------------------------------------------------
def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_supported(request: _CommonRequest) -> None:
    problem = request.unsupported()
    if problem:
        raise InvalidRequestError(problem)


# -- responses ---------------------------------------------------------------------------------
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
        self.sent_role = False
        # The serialized envelope up to the choices, for chunk_json: a stream sends one chunk
        # per generated token, and only the text changes from one to the next.
        name = "chat.completion.chunk" if chat else "text_completion"
        self._chunk_head = json.dumps(self._envelope(name, []))[:-len("[]}")]

    def _envelope(self, object_name: str, choices: list, extra: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices}
        body.update(extra or {})
        return body

    def chunk(self, text: str, finish_reason: str | None, usage_now: dict | None = None) -> dict:
        if self.chat:
            delta: dict[str, Any] = {}
            if not self.sent_role:
                delta["role"] = "assistant"  # carried by the first chunk, with its text
                self.sent_role = True
            if text or finish_reason is None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            name = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            name = "text_completion"
        return self._envelope(name, [choice], {"usage": usage_now} if usage_now else None)

    def chunk_json(self, text: str, finish_reason: str | None,
                   usage_now: dict | None = None) -> str:
        """`json.dumps(self.chunk(text, finish_reason, usage_now))`, the same text, without
        building and encoding the envelope again for every token."""
        if finish_reason is not None or usage_now or (self.chat and not self.sent_role):
            return json.dumps(self.chunk(text, finish_reason, usage_now))
        key = '"delta": {"content": ' if self.chat else '"text": '
        close = "}" if self.chat else ""
        return (f'{self._chunk_head}[{{"index": 0, {key}{json.dumps(text)}{close}, '
                f'"logprobs": null, "finish_reason": null}}]}}')

    def usage_chunk(self, usage_total: dict) -> dict:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(name, [], {"usage": usage_total})

    def response(self, text: str, finish_reason: str | None, usage_total: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion", [choice], {"usage": usage_total})
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice], {"usage": usage_total})
