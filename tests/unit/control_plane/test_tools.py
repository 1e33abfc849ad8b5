"""control_plane.tools: request validation, rendering through the default model's tokenizer with
the Hermes tools template, and the guided-decoding schemas of a forced tool choice."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from common.errors import InvalidRequestError
from control_plane.tool_parser import parse_named, parse_required, parse_tool_calls
from control_plane.tools import (
    NamedToolChoice,
    ToolMessageFields,
    ToolRequestFields,
    check_tool_request,
    guided_for_tool_choice,
    render_messages,
    render_tools,
    resolve_tool_choice,
    template_supports_tools,
)

TEMPLATE = Path(__file__).resolve().parents[2] / "data" / "chat_templates" / "hermes_tools.jinja"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]

CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris, "},
                                 {"type": "text", "text": "and the time?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


def _error(model, payload) -> dict:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(payload)
    return caught.value.errors()[0]


# -- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", [None, "none", "auto", "required",
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_valid_tool_choices(choice):
    request = ToolRequestFields.model_validate({"tools": TOOLS, "tool_choice": choice})
    assert [tool.function.name for tool in request.tools] == ["get_weather", "get_time"]
    assert request.tools[1].function.parameters is None


@pytest.mark.parametrize("payload, location, words", [
    ({"tools": [WEATHER, WEATHER]}, ("tools",), "get_weather"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     ("tool_choice",), "'nope' is not one of the tools"),
    ({"tool_choice": "required"}, ("tool_choice",), "at least one tool"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     ("tool_choice",), "not one of the tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     ("tools", 0, "function", "name"), "pattern"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, ("tools", 0, "type"), "function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     ("tools", 0, "function", "parameters"), "dictionary"),
])
def test_invalid_tool_fields_name_the_field(payload, location, words):
    error = _error(ToolRequestFields, payload)
    assert error["loc"][:len(location)] == location
    assert words in error["msg"]


def test_check_tool_request_names_the_field_in_its_message():
    assert check_tool_request(TOOLS, "required").tools[0].function.name == "get_weather"
    with pytest.raises(InvalidRequestError, match=r"^tools\.0\.function\.name: "):
        check_tool_request([{"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(InvalidRequestError, match="^tool_choice: function 'g' is not one of"):
        check_tool_request(TOOLS, {"type": "function", "function": {"name": "g"}})


def test_tool_choice_rejects_unknown_strings():
    error = _error(ToolRequestFields, {"tools": TOOLS, "tool_choice": "always"})
    assert error["loc"][0] == "tool_choice"


def test_resolve_tool_choice_applies_openai_defaults():
    assert resolve_tool_choice(TOOLS, None) == "auto"
    assert resolve_tool_choice(None, None) == "none"
    assert resolve_tool_choice([], "auto") == "none"
    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert isinstance(named, NamedToolChoice) and named.function.name == "get_time"
    with pytest.raises(InvalidRequestError):
        resolve_tool_choice(None, "required")


class _Message(ToolMessageFields):
    role: str
    content: str | None = None


def test_message_shapes_around_tool_calls():
    assistant = _Message.model_validate(CONVERSATION[2])
    assert assistant.content is None and assistant.tool_calls[0].function.name == "get_weather"
    tool = _Message.model_validate(CONVERSATION[3])
    assert tool.tool_call_id == "call_1"
    assert "tool_call_id" in _error(_Message, {"role": "tool", "content": "x"})["msg"]
    misplaced = {"role": "user", "content": "x", "tool_calls": CONVERSATION[2]["tool_calls"]}
    assert "only allowed on assistant" in _error(_Message, misplaced)["msg"]
    bad_call = {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}
    assert _error(_Message, bad_call)["loc"] == ("tool_calls", 0, "function", "arguments")


# -- rendering ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tokenizer(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model.hf_dir))


def _render(tokenizer, messages, tools=None) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE.read_text(),
                                         tokenize=False, add_generation_prompt=True)


def test_template_support_is_read_from_the_template(hf_tokenizer):
    assert template_supports_tools(TEMPLATE.read_text())
    assert not template_supports_tools(hf_tokenizer.chat_template)  # SmolLM2's own
    assert not template_supports_tools("{# tools #}no tools {{ messages[0].content }}")
    assert not template_supports_tools(None)
    # a tag of an extension we do not load: decided by the text
    assert template_supports_tools("{% generation %}{{ tools }}{% endgeneration %}")


def test_render_messages_gives_template_dicts():
    rendered = render_messages(CONVERSATION)
    assert rendered[0] == {"role": "system", "content": "Be brief."}
    assert rendered[1]["content"] == "Weather in Paris, and the time?"
    assert rendered[2]["content"] == ""
    assert rendered[2]["tool_calls"][0] == {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}
    assert rendered[3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1",
                           "name": "get_weather"}
    assert rendered[4]["name"] == "get_time"
    # models render as dicts do; arguments that are not a JSON object stay text
    models = [_Message.model_validate(m) for m in CONVERSATION[2:]]
    assert render_messages(models) == rendered[2:]
    cut = dict(CONVERSATION[2], tool_calls=[{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": '{"a": '}}])
    assert render_messages([cut])[0]["tool_calls"][0]["function"]["arguments"] == '{"a": '


def test_tools_and_calls_render_through_the_real_tokenizer(hf_tokenizer):
    prompt = _render(hf_tokenizer, render_messages(CONVERSATION), render_tools(TOOLS))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" in prompt
    assert '{"type": "function", "function": {"name": "get_time"}}\n</tools>' in prompt
    assert ("<|im_start|>assistant\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
            ) in prompt
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\nnoon\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            ) in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert hf_tokenizer(prompt)["input_ids"]  # it tokenizes


def test_rendered_calls_parse_back_to_the_same_calls(hf_tokenizer):
    prompt = _render(hf_tokenizer, render_messages(CONVERSATION), render_tools(TOOLS))
    reply = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(reply)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
])
def test_without_tools_the_template_matches_the_models_own(hf_tokenizer, messages):
    own = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert _render(hf_tokenizer, render_messages(messages)) == own


def test_the_gateways_jinja_environment_renders_the_same(hf_tokenizer, default_model):
    from common.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(default_model.hf_dir)
    tokenizer.__dict__["chat_template"] = TEMPLATE.read_text()  # replaces the cached property
    messages, tools = render_messages(CONVERSATION), render_tools(TOOLS)
    ours = tokenizer._compiled_template.render(
        messages=messages, tools=tools, add_generation_prompt=True, bos_token="", eos_token="")
    assert ours == _render(hf_tokenizer, messages, tools)


# -- guided decoding for a forced call ----------------------------------------------------------
def _schema(tools, choice, parallel=True) -> dict:
    spec = guided_for_tool_choice(tools, choice, parallel)
    assert spec.kind == "json"
    schema = json.loads(spec.spec)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _accepts(schema: dict, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_no_guided_decoding_unless_a_call_is_forced():
    assert guided_for_tool_choice(TOOLS, "auto") is None
    assert guided_for_tool_choice(TOOLS, None) is None
    assert guided_for_tool_choice(TOOLS, "none") is None
    assert guided_for_tool_choice(None, None) is None


def test_named_choice_constrains_the_output_to_the_arguments():
    schema = _schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert schema == WEATHER["function"]["parameters"]
    assert _accepts(schema, {"city": "Paris", "unit": "C"})
    assert not _accepts(schema, {"unit": "C"})
    assert not _accepts(schema, {"city": "Paris", "extra": 1})
    bare = _schema(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_time"}}))
    assert bare == {"type": "object"} and _accepts(bare, {}) and not _accepts(bare, [])


def test_required_choice_constrains_the_output_to_a_list_of_calls():
    schema = _schema(TOOLS, "required")
    weather = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert _accepts(schema, [weather])
    assert _accepts(schema, [weather, {"name": "get_time", "parameters": {}}])
    assert not _accepts(schema, [])
    assert not _accepts(schema, [{"name": "nope", "parameters": {}}])
    assert not _accepts(schema, [{"name": "get_weather", "parameters": {"unit": "C"}}])
    assert not _accepts(schema, [{"name": "get_time"}])
    assert not _accepts(schema, [dict(weather, extra=1)])
    assert not _accepts(schema, weather)
    single = _schema(TOOLS, "required", parallel=False)
    assert _accepts(single, [weather]) and not _accepts(single, [weather, weather])


@pytest.mark.parametrize("choice, good, bad", [
    ("required", ['[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
                  ('[{"name": "get_time", "parameters": {}}, '
                   '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "F"}}]')],
     ["[]", '[{"name": "nope", "parameters": {}}]', '[{"parameters": {}, "name": "get_time"}]']),
    ({"type": "function", "function": {"name": "get_weather"}},
     ['{"city": "Paris"}', '{"city": "Paris", "unit": "C"}'], ['{"unit": "C"}', "[]"]),
])
def test_the_grammar_engine_compiles_the_specs(choice, good, bad):
    """xgrammar (common.engine.guided's engine, compiling as it does) accepts what the parsers
    read, written as they re-serialize it: the arguments come back unchanged."""
    xgr = pytest.importorskip("xgrammar")
    grammar = xgr.Grammar.from_json_schema(guided_for_tool_choice(TOOLS, choice).spec,
                                           any_whitespace=False)
    for text in good:
        assert xgr.testing._is_grammar_accept_string(grammar, text), text
        calls = parse_required(text) if choice == "required" else parse_named(text, "get_weather")
        arguments = [call["function"]["arguments"] for call in calls]
        if choice == "required":
            assert arguments == [json.dumps(c["parameters"]) for c in json.loads(text)]
        else:
            assert arguments == [text]
    for text in bad:
        assert not xgr.testing._is_grammar_accept_string(grammar, text), text
