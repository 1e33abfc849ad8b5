"""Tool calling on the chat API, the request side: what a request may say and what the model sees.

Owns the OpenAI request shapes (`tools`, `tool_choice`, assistant `tool_calls`, `tool`
messages) and their validation, the translation of a conversation into the dicts Hugging Face
chat templates expect (`render_messages`, `render_tools`), whether a template can show tools
(`template_supports_tools`), and the guided-decoding spec that forces a call when `tool_choice`
asks for one (`guided_for_tool_choice`). Reading calls back out of the model's text is
control_plane.tool_parser's job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common.errors import InvalidRequestError
from common.sampling_params import GuidedSpec

# OpenAI's rule for function names (FunctionDefinition.name in its API reference).
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
# What `parameters` means when a function omits it: no parameters, so an empty object.
EMPTY_PARAMETERS = {"type": "object"}


# -- request shapes ----------------------------------------------------------------------------
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments object
    strict: bool | None = None  # accepted; calls are parsed the same either way


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: the model must call this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolRequestFields(BaseModel):
    """The tool fields of a chat completion request, validated against each other. A request
    model inherits them; `tools` is declared before `tool_choice`, so its validator sees it."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: OpenAI's default, true

    @field_validator("tools")
    @classmethod
    def _names_are_unique(cls, tools: list[Tool] | None) -> list[Tool] | None:
        names = [_function(tool)["name"] for tool in tools or ()]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"function names must be unique; repeated: {', '.join(duplicates)}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_fits_tools(cls, choice, info: ValidationInfo):
        if "tools" not in info.data:  # tools itself was invalid; that error is reported
            return choice
        names = [_function(tool)["name"] for tool in info.data["tools"] or ()]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"function {choice.function.name!r} is not one of the tools "
                             f"({', '.join(names) or 'none given'})")
        if choice == "required" and not names:
            raise ValueError('"required" needs at least one tool in tools')
        return choice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as every request model: no field ignored
    name: str
    arguments: str  # a JSON object, as text (as the model wrote it; not checked here)


class ToolCall(BaseModel):
    """One call in an assistant message the client sends back with the conversation."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolMessageFields(BaseModel):
    """The tool fields of a chat message. A message model with `role` and `content` inherits
    them: an assistant message may carry `tool_calls` (its content then may be null), and a
    `tool` message answers one call by `tool_call_id`."""

    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _fields_fit_role(self):
        role = getattr(self, "role", None)
        if self.tool_calls and role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not {role}")
        if role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self


def check_tool_request(tools: Sequence | None, tool_choice=None,
                       parallel_tool_calls: bool | None = None) -> ToolRequestFields:
    """Validate a request's tool fields given as plain JSON values; a problem raises
    InvalidRequestError whose message starts with the field's path (`tools.0.function.name`)."""
    try:
        return ToolRequestFields.model_validate({"tools": tools, "tool_choice": tool_choice,
                                                 "parallel_tool_calls": parallel_tool_calls})
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequestError(f"{path}: {message}") from None


def resolve_tool_choice(tools: Sequence | None, tool_choice) -> str | NamedToolChoice:
    """The choice in force: "none", "auto", "required" or the named function. OpenAI's
    defaults: "auto" when there are tools, "none" when there are none."""
    if isinstance(tool_choice, Mapping):
        tool_choice = NamedToolChoice.model_validate(tool_choice)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice asks for a call but tools is empty")
        return "none"
    return "auto" if tool_choice is None else tool_choice


# -- what the chat template sees ---------------------------------------------------------------
def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the Jinja template reads a `tools` variable (so it can show tools to the model)."""
    if not chat_template:
        return False
    from jinja2 import Environment, TemplateSyntaxError, meta
    from jinja2.ext import loopcontrols

    try:
        tree = Environment(extensions=[loopcontrols]).parse(chat_template)
    except TemplateSyntaxError:  # a tag of an extension we do not load: judge by the text
        return re.search(r"\btools\b", chat_template) is not None
    return "tools" in meta.find_undeclared_variables(tree)


def render_tools(tools: Sequence) -> list[dict]:
    """`tools` (models or dicts) as the list a template's `tools` variable takes."""
    return [{"type": "function", "function": _template_function(_function(tool))}
            for tool in tools]


def render_messages(messages: Sequence) -> list[dict]:
    """OpenAI chat messages (models or dicts) as the dicts Hugging Face chat templates take:
    content as plain text ("" when null); an assistant's `tool_calls` with `function.arguments`
    parsed into a dict (templates iterate them; arguments that are not a JSON object stay
    text); a tool message with `tool_call_id` and, when known, the `name` of the function it
    answers (OpenAI's tool messages do not carry it; templates may show it). A `developer`
    message becomes `system`, its meaning in OpenAI's API."""
    names: dict[str, str] = {}  # tool call id -> function name
    rendered = []
    for message in messages:
        message = _as_dict(message)
        role = "system" if message["role"] == "developer" else message["role"]
        item: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
        if message.get("tool_calls"):
            item["tool_calls"] = [_template_call(_as_dict(call))
                                  for call in message["tool_calls"]]
            names.update((call["id"], call["function"]["name"]) for call in item["tool_calls"])
        if role == "tool":
            item["tool_call_id"] = message.get("tool_call_id")
            name = message.get("name") or names.get(item["tool_call_id"])
            if name:
                item["name"] = name
        rendered.append(item)
    return rendered


def _as_dict(value) -> dict:
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_none=True)
    return dict(value)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(_as_dict(part).get("text", "") for part in content)


def _template_call(call: dict) -> dict:
    function = _as_dict(call["function"])
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments
    if isinstance(parsed, dict):
        arguments = parsed
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _function(tool) -> dict:
    """A tool's function definition as a dict, from a Tool model or a dict."""
    return _as_dict(_as_dict(tool)["function"])


def _template_function(function: dict) -> dict:
    # `strict` is about the API's schema checking, not something the model needs to read.
    return {key: function[key] for key in ("name", "description", "parameters")
            if function.get(key) is not None}


# -- guided decoding for a forced call ---------------------------------------------------------
def guided_for_tool_choice(tools: Sequence | None, tool_choice,
                           parallel_tool_calls: bool | None = True) -> GuidedSpec | None:
    """What the output must match when `tool_choice` forces a call; None for "none"/"auto".

    A named function: the output is that function's arguments object (its `parameters`
    schema; parse it with tool_parser.parse_named). "required": a JSON array of at least one
    `{"name": <a tool's name>, "parameters": <its arguments>}` (at most one when
    parallel_tool_calls is false; parse with tool_parser.parse_required)."""
    choice = resolve_tool_choice(tools, tool_choice)
    if choice in ("none", "auto"):
        return None
    functions = [_function(tool) for tool in tools]
    if isinstance(choice, NamedToolChoice):
        schema = named_schema(functions, choice.function.name)
    else:
        schema = required_schema(functions, parallel_tool_calls is not False)
    return GuidedSpec(kind="json", spec=json.dumps(schema))


def arguments_schema(function: dict) -> dict:
    return function.get("parameters") or dict(EMPTY_PARAMETERS)


def named_schema(functions: Sequence[dict], name: str) -> dict:
    for function in functions:
        if function["name"] == name:
            return arguments_schema(function)
    raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools")


def required_schema(functions: Sequence[dict], parallel_tool_calls: bool = True) -> dict:
    calls = [{"type": "object",
              "properties": {"name": {"const": function["name"]},
                             "parameters": arguments_schema(function)},
              "required": ["name", "parameters"],
              "additionalProperties": False}
             for function in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema
