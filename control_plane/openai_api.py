"""The OpenAI request schemas: what each field means here, and the refusal of what we lack.

Every field of OpenAI's completions and chat request schemas is either honoured or refused with
a 400 naming it (tests/unit/control_plane/test_request_schema.py walks the `openai` package's
schemas); a field of neither schema is refused the same way (`extra="forbid"`), except vLLM's
extensions that we implement: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, and `max_completion_tokens` on chat. A field sent as null means its default.

Responses and stream chunks are built in control_plane/responses.py; tools in
control_plane/tools.py.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from common.errors import InvalidRequestError
from common.sampling_params import MAX_LOGPROBS, GuidedSpec, SamplingParams
from control_plane.tools import ToolMessageFields, render_messages

MAX_CHOICES = 16  # n and best_of: each choice is a sequence in the cluster
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap for the completions `logprobs`


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def guided(self) -> GuidedSpec | None:
        if self.type == "json_object":
            return GuidedSpec("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequestError("response_format.json_schema is required with type "
                                          "json_schema")
            return GuidedSpec("json", json.dumps(self.json_schema.schema_ or {"type": "object"}))
        return None


def _refuse(field: str, why: str = "is not supported by this server") -> None:
    raise InvalidRequestError(f"`{field}` {why}")


class _CommonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    user: str | None = None  # an end-user id for the operator's logs; changes no output
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_is_valid_unicode(cls, value):
        for text in [value] if isinstance(value, str) else value or []:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\\udfff" in JSON)
                raise ValueError("stop strings must be valid Unicode (lone surrogate)") from None
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_candidates(self) -> int:
        """Sequences generated per prompt: best_of where it asks for more than n."""
        return self.num_choices

    def unsupported(self) -> None:
        """Raise InvalidRequestError naming a field asked for in a way we cannot honour."""
        if self.stream_options is not None and not self.stream:
            _refuse("stream_options", "is only allowed with stream: true")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) as SamplingParams counts."""
        return None, None

    def guided(self) -> GuidedSpec | None:
        """The output constraint asked for, if any (at most one way of asking)."""
        specs = [(name, spec) for name, spec in (
            ("response_format", self.response_format.guided() if self.response_format else None),
            ("guided_json", _json_spec(self.guided_json)),
            ("guided_regex", GuidedSpec("regex", self.guided_regex)
             if self.guided_regex is not None else None),
            ("guided_choice", GuidedSpec("choice", json.dumps(self.guided_choice))
             if self.guided_choice is not None else None),
            ("guided_grammar", GuidedSpec("grammar", self.guided_grammar)
             if self.guided_grammar is not None else None)) if spec is not None]
        if len(specs) > 1:
            _refuse(specs[1][0], f"cannot be combined with `{specs[0][0]}`")
        if self.guided_choice is not None and not self.guided_choice:
            _refuse("guided_choice", "must list at least one choice")
        if not specs:
            return None
        name, spec = specs[0]
        # A grammar ends the output itself: forcing tokens past its end has no valid token.
        if self.min_tokens:
            _refuse("min_tokens", f"cannot be combined with `{name}`")
        if self.ignore_eos:
            _refuse("ignore_eos", f"cannot be combined with `{name}`")
        check_spec(name, spec)
        return spec

    def sampling_params(self, default_max_tokens: int, eos_token_ids: tuple[int, ...],
                        vocab_size: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        requested = self.requested_max_tokens()
        top_k = self.top_k if self.top_k and self.top_k > 0 else 0
        logprobs, prompt_logprobs = self.logprobs_counts()
        params = SamplingParams(
            max_tokens=default_max_tokens if requested is None else requested,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k,
            min_p=self.min_p or 0.0, seed=self.seed,
            stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            eos_token_ids=eos_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=_logit_bias(self.logit_bias, vocab_size),
            min_tokens=self.min_tokens or 0, guided=self.guided(),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        return params.validate()


def check_spec(name: str, spec: GuidedSpec) -> None:
    """What the gateway can check of a constraint without the grammar engine (which brings
    torch): a JSON schema is a valid Draft 2020-12 schema, a regex compiles. The instance's
    grammar engine may still refuse a construct it lacks; that fails the request there."""
    if spec.kind == "json":
        import jsonschema

        try:
            jsonschema.Draft202012Validator.check_schema(json.loads(spec.spec))
        except jsonschema.SchemaError as exc:
            _refuse(name, f"is not a valid JSON schema: {exc.message}")
    elif spec.kind == "regex":
        try:
            re.compile(spec.spec)
        except re.error as exc:
            _refuse(name, f"is not a valid regular expression: {exc}")


def _json_spec(value: str | dict | None) -> GuidedSpec | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            _refuse("guided_json", "is not valid JSON")
        return GuidedSpec("json", value)
    return GuidedSpec("json", json.dumps(value))


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None
                ) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (as a string) to a bias in [-100, 100]."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            _refuse("logit_bias", f"keys must be token ids, got {key!r}")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            _refuse("logit_bias", f"token id {token} is outside the vocabulary")
        if not -100.0 <= value <= 100.0:
            _refuse("logit_bias", f"values must be in [-100, 100], got {value}")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (OpenAI takes one, or a list of texts or of token lists)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def num_candidates(self) -> int:
        return max(self.best_of or 1, self.num_choices)

    def unsupported(self) -> None:
        if self.suffix:
            _refuse("suffix")
        if self.best_of is not None and self.best_of < self.num_choices:
            _refuse("best_of", "must be at least n")
        if self.num_candidates > self.num_choices and self.stream:
            _refuse("best_of", "cannot be used with stream: true (the best are known at the end)")
        super().unsupported()

    def logprobs_counts(self) -> tuple[int | None, int | None]:
        # best_of ranks candidates by their cumulative log-probability
        ranked = self.num_candidates > self.num_choices
        sampled = self.logprobs if self.logprobs is not None else (0 if ranked else None)
        return sampled, (self.logprobs if self.echo and self.logprobs is not None else None)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(ToolMessageFields):
    """A message; its tool fields (`tool_calls`, `tool_call_id`, `name`) and their check
    against the role are `control_plane.tools`'."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


# OpenAI chat fields we do not implement, and the one value of each that asks for what we do
# anyway (so a client sending the default is served).
_CHAT_REFUSED = {"audio": None, "function_call": None, "functions": None, "metadata": None,
                 "modalities": ["text"], "prediction": None, "reasoning_effort": None,
                 "service_tier": "auto", "store": False, "verbosity": None,
                 "web_search_options": None, "prompt_cache_key": None,
                 "safety_identifier": None}
# Each refused field accepted as anything, so `unsupported` can name it (declared once, here).
_ChatRefusedFields = create_model("_ChatRefusedFields", __base__=_CommonRequest,
                                  **{name: (Any, None) for name in _CHAT_REFUSED})


class ChatCompletionRequest(_ChatRefusedFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self) -> None:
        for name, default in _CHAT_REFUSED.items():
            value = getattr(self, name)
            if value is not None and value != default and not (
                    name == "service_tier" and value == "default"):
                _refuse(name)
        if self.top_logprobs and not self.logprobs:
            _refuse("top_logprobs", "requires logprobs: true")
        super().unsupported()

    def logprobs_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict]:
        if any(m.tool_calls or m.tool_call_id for m in self.messages):
            return render_messages(self.messages)  # a conversation with tool calls
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# -- errors ------------------------------------------------------------------------------------
def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_supported(request: _CommonRequest) -> None:
    request.unsupported()

