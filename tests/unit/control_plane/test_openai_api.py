"""The OpenAI wire format: parsing benchmark bodies, refusals, sampling mapping, response shapes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from control_plane.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
    error_body,
)
from control_plane.responses import ResponseBuilder, usage

EOS = (2, 32000)


def completion(**fields):
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields})


# -- parsing ---------------------------------------------------------------------------------------
def test_vllm_benchmark_completion_body():
    # what vllm's benchmark_serving.py sends to /v1/completions
    body = {"model": "facebook/opt-125m", "prompt": "The capital of France is",
            "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 128, "logprobs": None,
            "best_of": 1, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    req = CompletionRequest.model_validate(body)
    assert req.prompt == "The capital of France is"
    assert (req.max_tokens, req.temperature, req.best_of, req.logprobs) == (128, 0.0, 1, None)
    assert req.stream and req.ignore_eos
    assert req.stream_options.include_usage and not req.stream_options.continuous_usage_stats
    assert req.unsupported() is None
    check_supported(req)  # does not raise
    assert req.repetition_penalty == 1.0  # honoured (vLLM's extension), 1.0 = off


def test_vllm_benchmark_chat_body():
    body = {"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}]}],
            "temperature": 0.0, "max_completion_tokens": 64, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True}
    req = ChatCompletionRequest.model_validate(body)
    assert req.template_messages() == [{"role": "user", "content": "Tell me a story"}]
    assert req.requested_max_tokens() == 64
    assert req.stream_options.continuous_usage_stats
    assert req.unsupported() is None


def test_chat_prefers_max_completion_tokens_over_max_tokens():
    assert chat(max_completion_tokens=10, max_tokens=99).requested_max_tokens() == 10
    assert chat(max_tokens=99).requested_max_tokens() == 99
    assert chat(max_completion_tokens=0, max_tokens=99).requested_max_tokens() == 0
    assert chat().requested_max_tokens() is None
    assert completion(max_tokens=5).requested_max_tokens() == 5
    # completions have no max_completion_tokens: refused, naming it
    with pytest.raises(ValidationError, match="max_completion_tokens"):
        completion(max_completion_tokens=7)


@pytest.mark.parametrize("stop, expected", [
    (None, ()), ("\n", ("\n",)), (["a", "bc"], ("a", "bc")), ([], ())])
def test_stop_forms(stop, expected):
    req = completion(stop=stop)
    assert req.sampling_params(16, EOS).stop == expected


@pytest.mark.parametrize("stop", ["a\udfffb", ["ok", "\ud800"]])
def test_stop_with_a_lone_surrogate_is_refused(stop):
    with pytest.raises(ValidationError, match="lone surrogate"):
        completion(stop=stop)


def test_prompt_forms():
    assert completion(prompt=["only one"]).prompts() == ["only one"]
    assert completion(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert completion(prompt=["12"]).prompts() == ["12"]  # a string stays a string
    assert completion(prompt=["one", "two"]).prompts() == ["one", "two"]
    assert completion(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    with pytest.raises(ValidationError, match="empty"):
        completion(prompt=[])
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m"})  # prompt is required


def test_chat_message_forms():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "bob"},
        {"role": "assistant", "content": None}]})
    assert req.template_messages() == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": ""}]
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}])


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 100.5), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("max_tokens", "lots")])
def test_out_of_range_values_fail_validation(field, value):
    with pytest.raises(ValidationError):
        completion(**{field: value})


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, message", [
    ({"best_of": 1, "n": 2}, "`best_of` must be at least n"),
    ({"best_of": 3, "stream": True}, "`best_of` cannot be used with stream"),
    ({"suffix": "end"}, "`suffix` is not supported"),
    ({"stream_options": {"include_usage": True}},
     "`stream_options` is only allowed with stream: true"),
])
def test_completion_unsupported(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        check_supported(completion(**fields))


@pytest.mark.parametrize("fields, message", [
    ({"top_logprobs": 3}, "`top_logprobs` requires logprobs: true"),
    ({"audio": {"voice": "x"}}, "`audio` is not supported"),
    ({"store": True}, "`store` is not supported"),
    ({"modalities": ["text", "audio"]}, "`modalities` is not supported"),
    ({"stream": False, "stream_options": {"include_usage": True}},
     "`stream_options` is only allowed with stream: true"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     "`guided_regex` cannot be combined with `response_format`"),
])
def test_chat_unsupported(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        chat(**fields).sampling_params(16, EOS)  # some refusals come with the parameters
        check_supported(chat(**fields))


@pytest.mark.parametrize("field", ["frobnicate", "logit_bias_v2", "echo"])
def test_unknown_chat_fields_are_refused_by_name(field):
    with pytest.raises(ValidationError, match=field):
        chat(**{field: 1})


@pytest.mark.parametrize("fields", [
    {}, {"n": 1}, {"best_of": 1}, {"best_of": None}, {"logprobs": None}, {"n": 3},
    {"best_of": 4, "n": 2}, {"logprobs": 0}, {"echo": True, "logprobs": 2},
    {"presence_penalty": 0.0, "frequency_penalty": 0.0},
    {"presence_penalty": None, "frequency_penalty": None},
    {"stream": True, "stream_options": {"include_usage": True}},
    {"stream": False, "stream_options": None}, {"echo": False}, {"suffix": ""}])
def test_supported_fields_are_accepted(fields):
    check_supported(completion(**fields))


def test_chat_defaults_of_refused_fields_are_accepted():
    check_supported(chat(logprobs=False, top_logprobs=0, store=False, modalities=["text"],
                         service_tier="auto", parallel_tool_calls=True))


def test_logprobs_counts():
    assert completion(logprobs=0).logprobs_counts() == (0, None)
    assert completion(logprobs=3, echo=True).logprobs_counts() == (3, 3)
    assert completion(best_of=3).logprobs_counts() == (0, None)  # candidates are ranked
    assert chat(logprobs=True).logprobs_counts() == (0, None)
    assert chat(logprobs=True, top_logprobs=5).logprobs_counts() == (5, None)
    assert chat().logprobs_counts() == (None, None)


def test_penalties_bias_and_guided_map_to_sampling_params():
    params = chat(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                  logit_bias={"7": 5.0, "3": -100}, min_tokens=4, max_tokens=8,
                  ).sampling_params(16, EOS, 100)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_tokens) == (0.5, -1.0, 1.2, 4)
    assert params.logit_bias == ((3, -100.0), (7, 5.0))
    params = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}).sampling_params(16, EOS, 100)
    assert (params.guided.kind, json.loads(params.guided.spec)) == ("json", {"type": "object"})
    assert completion(guided_choice=["a", "b"]).sampling_params(16, EOS).guided.kind == "choice"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        chat(logit_bias={"100": 1.0}).sampling_params(16, EOS, 100)


# -- sampling parameters ---------------------------------------------------------------------------
def test_sampling_params_defaults():
    params = completion().sampling_params(256, EOS)
    assert params == SamplingParams(max_tokens=256, temperature=1.0, top_p=1.0, top_k=0,
                                    seed=None, stop=(), stop_token_ids=(), eos_token_ids=EOS,
                                    ignore_eos=False)


def test_sampling_params_mapping():
    params = chat(max_completion_tokens=12, max_tokens=99, temperature=0.0, top_p=0.5, top_k=20,
                  seed=3, stop=["###"], stop_token_ids=[5, 6],
                  ignore_eos=True).sampling_params(256, EOS)
    assert params == SamplingParams(max_tokens=12, temperature=0.0, top_p=0.5, top_k=20, seed=3,
                                    stop=("###",), stop_token_ids=(5, 6), eos_token_ids=EOS,
                                    ignore_eos=True)
    assert params.is_greedy and isinstance(params.stop, tuple)
    assert isinstance(params.stop_token_ids, tuple)


@pytest.mark.parametrize("top_k, expected", [(None, 0), (-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_mapping(top_k, expected):
    assert completion(top_k=top_k).sampling_params(16, EOS).top_k == expected


def test_sampling_params_are_validated():
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        completion(max_tokens=0).sampling_params(16, EOS)
    with pytest.raises(InvalidRequestError, match="stop strings"):
        completion(stop=["ok", ""]).sampling_params(16, EOS)


# -- responses -------------------------------------------------------------------------------------
def envelope_ok(body, builder, object_name):
    assert body["id"] == builder.id and body["object"] == object_name
    assert body["model"] == "m" and body["created"] == builder.created
    assert isinstance(body["created"], int)


def test_ids_are_unique_and_prefixed():
    a, b = ResponseBuilder(chat=False, model="m"), ResponseBuilder(chat=False, model="m")
    assert a.id.startswith("cmpl-") and a.id != b.id
    assert ResponseBuilder(chat=True, model="m").id.startswith("chatcmpl-")


def test_completion_chunks():
    rb = ResponseBuilder(chat=False, model="m")
    first = rb.chunk("Hel", None)
    envelope_ok(first, rb, "text_completion")
    assert first["choices"] == [{"index": 0, "text": "Hel", "logprobs": None,
                                 "finish_reason": None}]
    assert "usage" not in first
    last = rb.chunk("", "length", usage_now=usage(3, 2))
    assert last["choices"] == [{"index": 0, "text": "", "logprobs": None,
                                "finish_reason": "length"}]
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_chat_chunks_role_only_on_the_first():
    rb = ResponseBuilder(chat=True, model="m")
    first = rb.chunk("Hel", None)
    envelope_ok(first, rb, "chat.completion.chunk")
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": "Hel"},
                                 "logprobs": None, "finish_reason": None}]
    second = rb.chunk("lo", None)
    assert second["choices"][0]["delta"] == {"content": "lo"}
    empty = rb.chunk("", None)  # a token that decodes to no text yet still carries content
    assert empty["choices"][0]["delta"] == {"content": ""}
    finish = rb.chunk("", "stop")
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "stop"
    with_text = ResponseBuilder(chat=True, model="m")
    with_text.chunk("a", None)
    assert with_text.chunk("b", "length")["choices"][0]["delta"] == {"content": "b"}


def test_chat_finish_chunk_alone_carries_only_the_role():
    rb = ResponseBuilder(chat=True, model="m")
    finish = rb.chunk("", "length")
    assert finish["choices"][0]["delta"] == {"role": "assistant"}
    assert finish["choices"][0]["finish_reason"] == "length"
    assert rb.chunk("", "stop")["choices"][0]["delta"] == {}


def test_chat_chunk_with_continuous_usage():
    rb = ResponseBuilder(chat=True, model="m")
    body = rb.chunk("x", None, usage_now=usage(4, 1))
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}


@pytest.mark.parametrize("is_chat, name", [(False, "text_completion"),
                                           (True, "chat.completion.chunk")])
def test_usage_chunk_has_no_choices(is_chat, name):
    rb = ResponseBuilder(chat=is_chat, model="m")
    body = rb.usage_chunk(usage(10, 20))
    envelope_ok(body, rb, name)
    assert body["choices"] == []
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}


def test_non_streaming_completion_response():
    rb = ResponseBuilder(chat=False, model="m")
    body = rb.response("Paris.", "stop", usage(5, 2))
    envelope_ok(body, rb, "text_completion")
    assert body["choices"] == [{"index": 0, "text": "Paris.", "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 7


def test_non_streaming_chat_response():
    rb = ResponseBuilder(chat=True, model="m")
    body = rb.response("Paris.", "length", usage(5, 2))
    envelope_ok(body, rb, "chat.completion")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}


def test_error_body_shape():
    assert error_body("bad thing") == {"error": {"message": "bad thing",
                                                 "type": "invalid_request_error",
                                                 "param": None, "code": None}}
    assert error_body("gone", kind="not_found_error", param="model", code=404) == {
        "error": {"message": "gone", "type": "not_found_error", "param": "model", "code": 404}}


@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "`response_format` is not a valid JSON"),
    ({"guided_json": {"type": "object", "required": "a"}}, "`guided_json` is not a valid JSON"),
    ({"guided_regex": "a(b"}, "`guided_regex` is not a valid regular expression"),
    ({"guided_choice": ["a"], "min_tokens": 3}, "`min_tokens` cannot be combined"),
    ({"guided_regex": "a+", "ignore_eos": True}, "`ignore_eos` cannot be combined"),
])
def test_bad_constraints_are_refused_at_the_gateway(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        completion(**fields).sampling_params(16, EOS)
