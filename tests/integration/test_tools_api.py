"""Tool calling end to end with the official `openai` client against a real cluster serving the
default model with a chat template that renders tools: a forced call (tool_choice `required`
and a named function, enforced by the grammar engine), the tool's result sent back, and the
final answer, streamed and not."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from cluster_fixture import Cluster

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "hermes_tools.jinja"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"], "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    cluster = Cluster("--dtype", "float32", "--chat-template", str(TEMPLATE),
                      log_dir=tmp_path_factory.mktemp("tools"))
    yield openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    cluster.stop()


def _check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    assert name is None or call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def _answer_round(call) -> list[dict]:
    """The conversation after the call: the assistant's call and the tool's result."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, light rain"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_round_trip(client, choice):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                           tool_choice=choice, max_tokens=60, temperature=0)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls, message
    named = None if choice == "required" else "get_weather"
    _check_call(message.tool_calls[0], named)
    final = client.chat.completions.create(model=MODEL, messages=_answer_round(
        message.tool_calls[0]), tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_streamed_round_trip(client):
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", max_tokens=60,
                                            temperature=0.7, top_p=0.95, seed=3, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = part.id or call["id"]
                call["name"] += (part.function.name or "") if part.function else ""
                call["arguments"] += (part.function.arguments or "") if part.function else ""
    assert finish == "tool_calls" and calls
    whole = openai.types.chat.ChatCompletionMessageToolCall(
        id=calls[0]["id"], type="function",
        function={"name": calls[0]["name"], "arguments": calls[0]["arguments"]})
    _check_call(whole)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in
                   client.chat.completions.create(
                       model=MODEL, messages=_answer_round(whole), tools=TOOLS, max_tokens=20,
                       temperature=0, stream=True, tool_choice="none") if chunk.choices)
    assert text


def test_auto_parses_or_answers(client):
    """With `auto` the model decides; whatever it wrote is either content or well-formed
    calls, never both lost."""
    response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                              max_tokens=40, temperature=0)
    message = response.choices[0].message
    if message.tool_calls:
        assert response.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert message.content


def test_bad_tool_requests_are_400(client):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=MODEL, messages=QUESTION + [
            {"role": "tool", "content": "x"}], tools=TOOLS)
