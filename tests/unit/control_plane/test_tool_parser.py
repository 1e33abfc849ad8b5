"""control_plane.tool_parser and json_stream: tool calls read from whole outputs and from every
split of them into deltas, checked against OpenAI's own response and chunk types."""

from __future__ import annotations

import json
import random
import re

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageToolCall

from control_plane.json_stream import JsonError, canonical_json
from control_plane.tool_calls import collect
from control_plane.tool_parser import (
    HermesToolParser,
    NamedToolParser,
    RequiredToolParser,
    make_tool_parser,
    parse_named,
    parse_required,
    parse_tool_calls,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WELL_FORMED = [
    "Let me check.\n" + CALL,
    CALL + "\n" + CALL.replace("Paris", "Oslo") + "\n",
    ('Sure. <tool_call>{"arguments": {"q": "a \\"quoted\\" </tag>\\n", "n": [1, -2.5e3, true, '
     'null, {}]}, "name": "search", "id": 7}</tool_call> Done: 1 < 2.'),
    ('<tool_call>\n{"name":"f","arguments":{"s":"\\u00e9\\ud83d\\ude00 caf\u00e9","t":"<tool"}}'
     "\n</tool_call>"),
    'No calls here, only a < sign and <tool and </tool_call> text',
    "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # the closing tag cut off: still a call
]
MALFORMED = [
    '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',  # bad JSON
    '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "f", "arguments": {}} extra\n</tool_call>',
    '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>',
    '<tool_call>\n["f", {}]\n</tool_call>',
    '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # cut off inside the JSON
    "<tool_call><tool_call></tool_call>",
]
ID = re.compile(r"^call_[0-9a-f]{24}$")


def _chunk(delta: dict) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def _stream(parser, pieces: list[str]) -> tuple[list[dict], bool]:
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    last, called = parser.finish()
    return deltas + last, called


def _without_ids(calls: list[dict]) -> list[dict]:
    assert all(ID.match(call["id"]) for call in calls)
    assert len({call["id"] for call in calls}) == len(calls)
    return [dict(call, id=None) for call in calls]


def _splits(text: str, seed: int = 0) -> list[list[str]]:
    """Every split in two, one character at a time, and seeded random splits into many."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text))
    rng = random.Random(seed)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return splits


def _check_deltas(deltas: list[dict]) -> None:
    """Each delta is a valid chunk delta; each call's header comes first, with empty arguments."""
    announced = set()
    for delta in deltas:
        _chunk(delta)
        for part in delta.get("tool_calls", ()):
            if part["index"] not in announced:
                assert part["type"] == "function" and ID.match(part["id"])
                assert part["function"]["arguments"] == "" and part["function"]["name"]
                announced.add(part["index"])
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == \
                    {"arguments"}
    assert announced == set(range(len(announced)))


# -- Hermes: whole outputs -----------------------------------------------------------------------
def test_whole_output_with_content_and_calls():
    content, calls = parse_tool_calls(WELL_FORMED[0])
    assert content == "Let me check."
    assert _without_ids(calls) == [{"id": None, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    content, calls = parse_tool_calls(WELL_FORMED[1])
    assert content is None
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Oslo"]


def test_arguments_are_re_serialized_and_other_keys_ignored():
    content, [call] = parse_tool_calls(WELL_FORMED[2])
    assert content == "Sure. Done: 1 < 2."  # one separating space, not both
    assert call["function"]["name"] == "search"
    # json.dumps's separators, strings re-escaped, numbers as the model wrote them
    assert call["function"]["arguments"] == \
        '{"q": "a \\"quoted\\" </tag>\\n", "n": [1, -2.5e3, true, null, {}]}'
    _, [call] = parse_tool_calls(WELL_FORMED[3])
    assert json.loads(call["function"]["arguments"]) == {"s": "\u00e9\U0001F600 caf\u00e9",
                                                         "t": "<tool"}


def test_calls_without_arguments_or_closing_tag():
    assert parse_tool_calls(WELL_FORMED[4]) == (WELL_FORMED[4], [])
    _, [call] = parse_tool_calls(WELL_FORMED[5])
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    _, [call] = parse_tool_calls(WELL_FORMED[6])
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}


@pytest.mark.parametrize("block", MALFORMED)
def test_malformed_calls_stay_content(block):
    text = "Before " + block
    assert parse_tool_calls(text) == (text, [])
    content, [call] = parse_tool_calls(block + "\n" + CALL)  # a good call after a bad one
    assert content == block and call["function"]["name"] == "get_weather"


def test_results_validate_as_an_openai_response():
    content, calls = parse_tool_calls(WELL_FORMED[1])
    for call in calls:
        ChatCompletionMessageToolCall.model_validate(call)
    ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                     "message": {"role": "assistant", "content": content, "tool_calls": calls}}]})


# -- Hermes: streaming ---------------------------------------------------------------------------
@pytest.mark.parametrize("number", range(len(WELL_FORMED)))
def test_every_split_streams_what_the_whole_output_gives(number):
    text = WELL_FORMED[number]
    content, calls = parse_tool_calls(text)
    for pieces in _splits(text, seed=number):
        deltas, called = _stream(HermesToolParser(), pieces)
        _check_deltas(deltas)
        streamed_content, streamed_calls = collect(deltas)
        assert streamed_content == content, pieces
        assert _without_ids(streamed_calls) == _without_ids(calls), pieces
        assert called == bool(calls)
        if calls:  # no tag text leaks into content
            assert all("<tool" not in d.get("content", "") for d in deltas), pieces


@pytest.mark.parametrize("block", MALFORMED)
def test_malformed_calls_stream_without_error(block):
    text = "Before " + block + " after"
    whole = parse_tool_calls(text)
    for pieces in _splits(text):
        deltas, called = _stream(HermesToolParser(), pieces)
        _check_deltas(deltas)
        if not called:  # unless streaming committed to the call, it is the same content
            assert collect(deltas) == whole
        else:  # the call stands, cut off; content goes on after its block
            after = " after" if "</tool_call>" in block else ""
            assert collect(deltas)[0] == "Before" + after


def test_random_text_never_breaks_the_parser():
    parts = ["<tool_call>", "</tool_call>", '{"name": "f"', ', "arguments": ', "{", "}", '"x"',
             ":", "1", " ", "\n", "<", "<tool", "text", ",", "[", "]", '"\\u00', "\\"]
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 25)))
        content, calls = parse_tool_calls(text)
        for call in calls:
            json.loads(call["function"]["arguments"])
        pieces = _splits(text, seed=len(text))[-1]
        deltas, called = _stream(HermesToolParser(), pieces)
        _check_deltas(deltas)
        if not called:
            assert collect(deltas) == (content, calls)


def test_streaming_announces_a_call_before_its_arguments_end():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool_") == [{"content": "Hi"}]
    assert parser.feed('call>{"name": "f') == []  # the name is known when its string ends
    [header] = parser.feed('", "argu')
    assert header["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert parser.feed('ments": {"city": "Pa') == [{"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": "Pa'}}]}]
    assert parser.feed("") == [] and parser.feed("ris") == [{"tool_calls": [
        {"index": 0, "function": {"arguments": "ris"}}]}]
    # The model stops (max_tokens) mid-arguments: the announced call stands, cut off.
    deltas, called = parser.finish()
    assert called and deltas == []


def test_a_partial_tag_is_held_back_until_it_is_known():
    parser = HermesToolParser()
    assert parser.feed("x <tool_c") == [{"content": "x"}]
    assert parser.feed("ar") == [{"content": " <tool_car"}]
    assert parser.feed("\n\n") == []  # trailing whitespace waits: a call may follow
    assert parser.finish() == ([{"content": "\n\n"}], False)


# -- forced calls: named and required --------------------------------------------------------------
def test_named_output_is_the_arguments():
    [call] = parse_named(' {"city" :"Paris",\n "days": [1, 2]} ', "get_weather")
    assert call["function"] == {"name": "get_weather",
                                "arguments": '{"city": "Paris", "days": [1, 2]}'}
    assert parse_named('{"city": "Pa', "get_weather")[0]["function"]["arguments"] == \
        '{"city": "Pa'  # cut off by max_tokens: cut off arguments, as OpenAI's
    assert parse_named("", "f")[0]["function"] == {"name": "f", "arguments": ""}


def test_required_output_is_a_list_of_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}},\n {"parameters": {}, ' \
           '"name": "get_time"}]'
    calls = parse_required(text)
    assert [c["function"] for c in _without_ids(calls)] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": "{}"}]
    assert parse_required("not json") == []
    assert len(parse_required('[{"name": "f", "parameters": {}}, 3]')) == 1


@pytest.mark.parametrize("make, text", [
    (lambda: NamedToolParser("get_weather"), '{"city": "Paris", "n": [1.5, {"d": null}]}'),
    (RequiredToolParser, ('[{"name": "a", "parameters": {"x": "<tool_call>"}}, '
                          '{"name": "b", "parameters": {"y": [true]}}]')),
])
def test_forced_calls_stream_the_same_under_every_split(make, text):
    whole, _ = make().finish(text)
    for pieces in _splits(text):
        deltas, called = _stream(make(), pieces)
        _check_deltas(deltas)
        assert called
        assert _without_ids(collect(deltas)[1]) == _without_ids(collect(whole)[1])


def test_make_tool_parser_follows_tool_choice():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert make_tool_parser(tools, "none") is None
    assert make_tool_parser(None, None) is None
    assert isinstance(make_tool_parser(tools, None), HermesToolParser)
    assert isinstance(make_tool_parser(tools, "required"), RequiredToolParser)
    named = make_tool_parser(tools, {"type": "function", "function": {"name": "f"}})
    assert isinstance(named, NamedToolParser)


# -- json_stream -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ['{"a": 1, "b": [1, 2.5e3, true, null, {}]}', "[ ]", " -0.5 ",
                                  '"\\ud800 \\u00e9\\/\\t"', '{"k\\"": {"q": []}}'])
def test_canonical_json_is_the_same_value(text):
    assert json.loads(canonical_json(text)) == json.loads(text)
    canonical_json(text).encode()  # even a lone surrogate comes out encodable


@pytest.mark.parametrize("text", ["{,}", "[1,]", '{"a" 1}', "01", "tru", "truex", '{"a":1,}',
                                  '"\\x"', "[}", '"\\u12g4"', "{"])
def test_canonical_json_rejects_what_json_rejects(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(JsonError):
        canonical_json(text)
