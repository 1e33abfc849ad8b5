"""Every field of OpenAI's request schemas (as the installed `openai` package defines them) is
honoured, with a visible effect on what we run, or refused with a 400 naming it."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from common.errors import InvalidRequestError
from control_plane.openai_api import ChatCompletionRequest, CompletionRequest, check_supported

openai_types = pytest.importorskip("openai.types")
from openai.types import completion_create_params as completion_schema  # noqa: E402
from openai.types.chat import completion_create_params as chat_schema  # noqa: E402

EOS = (2,)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}

# A non-default value per field, and what honouring it means (None: refused).
SAMPLES = {
    "model": ("m", lambda r, p: r.model == "m"),
    "prompt": ("Hello", lambda r, p: r.prompts() == ["Hello"]),
    "messages": ([{"role": "user", "content": "Hi"}], lambda r, p: len(r.messages) == 1),
    "max_tokens": (5, lambda r, p: p.max_tokens == 5),
    "max_completion_tokens": (6, lambda r, p: p.max_tokens == 6),
    "temperature": (0.5, lambda r, p: p.temperature == 0.5),
    "top_p": (0.9, lambda r, p: p.top_p == 0.9),
    "n": (3, lambda r, p: r.num_choices == 3),
    "best_of": (3, lambda r, p: r.num_candidates == 3 and p.logprobs == 0),
    "stream": (True, lambda r, p: r.stream is True),
    "stream_options": ({"include_usage": True}, lambda r, p: r.stream_options.include_usage),
    "stop": (["###"], lambda r, p: p.stop == ("###",)),
    "seed": (7, lambda r, p: p.seed == 7),
    "presence_penalty": (0.5, lambda r, p: p.presence_penalty == 0.5),
    "frequency_penalty": (0.5, lambda r, p: p.frequency_penalty == 0.5),
    "logit_bias": ({"5": 1.0}, lambda r, p: p.logit_bias == ((5, 1.0),)),
    "logprobs": (None, None),  # per endpoint below
    "top_logprobs": (3, lambda r, p: p.logprobs == 3),
    "echo": (True, lambda r, p: r.echo is True),
    "user": ("alice", lambda r, p: r.user == "alice"),
    "response_format": ({"type": "json_object"}, lambda r, p: p.guided.kind == "json_object"),
    "tools": ([TOOL], lambda r, p: r.tools[0]["function"]["name"] == "get_weather"),
    "tool_choice": ("required", lambda r, p: r.tool_choice == "required"),
    "parallel_tool_calls": (False, lambda r, p: r.parallel_tool_calls is False),
    "suffix": ("the end", None),
    "audio": ({"voice": "alloy", "format": "mp3"}, None),
    "function_call": ("auto", None),
    "functions": ([{"name": "f"}], None),
    "metadata": ({"k": "v"}, None),
    "modalities": (["text", "audio"], None),
    "moderation": ({"enabled": True}, None),
    "prediction": ({"type": "content", "content": "x"}, None),
    "prompt_cache_key": ("k", None),
    "prompt_cache_options": ({"ttl": 60}, None),
    "prompt_cache_retention": ("24h", None),
    "reasoning_effort": ("high", None),
    "safety_identifier": ("id", None),
    "service_tier": ("flex", None),
    "store": (True, None),
    "verbosity": ("low", None),
    "web_search_options": ({}, None),
}
LOGPROBS = {"completions": (2, lambda r, p: p.logprobs == 2),
            "chat": (True, lambda r, p: p.logprobs == 0)}


def _fields(schema) -> list[str]:
    return sorted(set(schema.CompletionCreateParamsBase.__annotations__) | {"stream"})


def _walk(endpoint: str, model, schema, base: dict):
    for name in _fields(schema):
        assert name in SAMPLES, f"OpenAI's {endpoint} schema has a field this test does not " \
                                f"know: {name!r}: decide whether we honour it"
        value, honoured = LOGPROBS[endpoint] if name == "logprobs" else SAMPLES[name]
        body = {**base, name: value}
        if name == "top_logprobs":
            body["logprobs"] = True
        if name == "stream_options":
            body["stream"] = True
        if name == "tool_choice":
            body["tools"] = [TOOL]
        yield name, body, model, honoured


def _cases():
    yield from _walk("completions", CompletionRequest, completion_schema,
                     {"model": "m", "prompt": "Hello"})
    yield from _walk("chat", ChatCompletionRequest, chat_schema,
                     {"model": "m", "messages": [{"role": "user", "content": "Hi"}]})


@pytest.mark.parametrize("name, body, model, honoured", list(_cases()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_openai_field_is_honoured_or_refused_by_name(name, body, model, honoured):
    try:
        request = model.model_validate(body)
        check_supported(request)
        params = request.sampling_params(16, EOS, 100)
    except ValidationError as exc:
        assert honoured is None, f"{name} is refused: {exc}"
        assert any(name in map(str, error["loc"]) for error in exc.errors()), exc
        return
    except InvalidRequestError as exc:
        assert honoured is None, f"{name} is refused: {exc}"
        assert f"`{name}`" in str(exc), str(exc)
        return
    assert honoured is not None, f"{name} = {json.dumps(body[name])} was accepted; it must " \
                                 f"be refused with a 400 naming it, or honoured here"
    assert honoured(request, params), f"{name} was accepted without its effect"
