"""One chat request's tools, from validation to parsed calls (control_plane/serving.py's view).

`RequestTools.from_request` validates `tools` / `tool_choice` / `parallel_tool_calls`
(control_plane/tools.py) and refuses tools for a model whose chat template cannot show them (a
400, never a silent ignore: start the server with `--chat-template` to give it one). It then
renders the conversation and the tools for the template, constrains the output with the grammar
engine where `tool_choice` forces a call (`required`, a named function), and reads the calls
back out of each choice's text (control_plane/tool_parser.py), whole or streamed.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.tokenizer import TextTokenizer
from control_plane.tool_calls import collect
from control_plane.tool_parser import make_tool_parser
from control_plane.tools import (
    check_tool_request,
    guided_for_tool_choice,
    render_tools,
    resolve_tool_choice,
)


class ToolStream:
    """One streamed choice's tool parser: text deltas in, chat deltas out."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.called = False

    def feed(self, text: str) -> list[dict]:
        return self.parser.feed(text) if text else []

    def flush(self) -> list[dict]:
        deltas, self.called = self.parser.finish()
        return deltas


@dataclass
class RequestTools:
    tools: list[dict]
    tool_choice: object
    parallel_tool_calls: bool
    definitions: list[dict] | None  # what the template's `tools` variable gets

    @classmethod
    def from_request(cls, body, tokenizer: TextTokenizer) -> RequestTools | None:
        """None when the request makes no tool calls possible (no tools, or `none`)."""
        fields = check_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        tools = [tool.model_dump(exclude_none=True) for tool in fields.tools or []]
        choice = resolve_tool_choice(tools, body.tool_choice)
        if choice == "none":
            return None
        if not tokenizer.supports_tools:
            raise InvalidRequestError(
                "`tools`: this model's chat template does not render tools; start the server "
                "with --chat-template PATH (a template that does)")
        parallel = body.parallel_tool_calls is not False
        return cls(tools, body.tool_choice, parallel, render_tools(tools))

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """Force a call with the grammar engine where the choice asks for one."""
        guided = guided_for_tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)
        if guided is None:
            return params
        if params.guided is not None:
            raise InvalidRequestError("`tool_choice` forcing a call cannot be combined with "
                                      "`response_format` or guided decoding")
        return msgspec.structs.replace(params, guided=guided)

    def streamer(self) -> ToolStream:
        return ToolStream(make_tool_parser(self.tools, self.tool_choice))

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole choice's text -> (content, tool calls)."""
        parser = make_tool_parser(self.tools, self.tool_choice)
        deltas, _ = parser.finish(text)
        content, calls = collect(deltas)
        return (content or None) if calls else text, calls
