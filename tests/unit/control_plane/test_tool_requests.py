"""A request's tools against the model's chat template: refused (400) when the template cannot
show them, rendered into the prompt when it can, and a forced choice becomes a grammar."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.tokenizer import TextTokenizer
from control_plane.openai_api import ChatCompletionRequest
from control_plane.tool_requests import RequestTools

TEMPLATE = Path(__file__).resolve().parents[2] / "data" / "chat_templates" / "hermes_tools.jinja"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(**fields):
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], **fields})


def test_a_template_without_tools_refuses_them(default_model):
    tokenizer = TextTokenizer(default_model.hf_dir)
    assert not tokenizer.supports_tools
    with pytest.raises(InvalidRequestError, match="`tools`.*--chat-template"):
        RequestTools.from_request(chat(tools=[TOOL]), tokenizer)
    # tool_choice none makes no call possible: served without tools
    assert RequestTools.from_request(chat(tools=[TOOL], tool_choice="none"), tokenizer) is None


def test_tools_render_and_forced_choices_constrain(default_model):
    tokenizer = TextTokenizer(default_model.hf_dir, TEMPLATE)
    assert tokenizer.supports_tools
    tools = RequestTools.from_request(chat(tools=[TOOL], tool_choice="required"), tokenizer)
    prompt = tokenizer.apply_chat_template(chat().template_messages(), tools=tools.definitions)
    assert "get_weather" in prompt and "<tools>" in prompt
    params = tools.constrain(SamplingParams())
    assert params.guided.kind == "json"
    schema = json.loads(params.guided.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    auto = RequestTools.from_request(chat(tools=[TOOL]), tokenizer)
    assert auto.constrain(SamplingParams()).guided is None  # auto: the model decides
    with pytest.raises(InvalidRequestError, match="response_format"):
        tools.constrain(SamplingParams(guided=chat(response_format={
            "type": "json_object"}).guided()))


def test_whole_output_parsing(default_model):
    tokenizer = TextTokenizer(default_model.hf_dir, TEMPLATE)
    auto = RequestTools.from_request(chat(tools=[TOOL]), tokenizer)
    content, calls = auto.parse('Sure.<tool_call>\n{"name": "get_weather", "arguments": '
                                '{"city": "Oslo"}}\n</tool_call>')
    assert content == "Sure." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert auto.parse("It is sunny.") == ("It is sunny.", [])
    required = RequestTools.from_request(chat(tools=[TOOL], tool_choice="required"), tokenizer)
    _, calls = required.parse('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
