"""Structured output and tool calls: request fields to one grammar, and tool calls back out.

A request may constrain its output through OpenAI's ``response_format`` or a forced tool call,
or through vLLM's ``guided_*`` fields or ``structured_outputs``; each becomes one
``StructuredOutputsParams`` (``engine/grammar.py`` applies it, speculation included). Asking in
two ways at once, a grammar that does not compile, accepts no string or exceeds a limit, or a
``tool_choice`` this server cannot honour is a 400 naming the field. A grammar that fails during
generation all the same is a 422 (``grammar_failed``), never output passed off as complete. A
forced tool call's output is the function's arguments, returned as ``message.tool_calls``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from multiguess.api.errors import APIError
from multiguess.api.schemas import (
    AssistantMessage,
    ChatCompletionRequest,
    FunctionCall,
    FunctionDefinition,
    SamplingFields,
    ToolCall,
)
from multiguess.engine.grammar import Grammars
from multiguess.errors import InvalidRequestError
from multiguess.params import StructuredOutputsParams
from multiguess.scheduler import Event

# A function without ``parameters`` takes none: its arguments are an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Structure:
    """The grammar a request asked for, and the field that asked (named in its errors)."""

    field: str
    spec: StructuredOutputsParams


def requested_structure(body: SamplingFields) -> Structure | None:
    """The one grammar a body asks for (None: free text)."""
    asks = _asks(body)
    if len(asks) > 1:
        (first, _), (second, _) = asks[:2]
        raise APIError(
            400,
            f"{second}: a request constrains its output in one way only, and {first} is set too",
            param=second,
        )
    if not asks:
        return None
    name, fields = asks[0]
    try:
        if "json" in fields:
            fields["json"] = _schema(fields["json"])
        return Structure(name, StructuredOutputsParams(**fields))
    except InvalidRequestError as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from None


def _asks(body: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """Each field of ``body`` that constrains the output, with the grammar's fields."""
    asks: list[tuple[str, dict[str, Any]]] = []
    fmt = body.response_format
    if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
        raise APIError(
            400,
            "response_format: json_schema goes with type json_schema, and only there",
            param="response_format",
        )
    if fmt is not None and fmt.type == "json_object":
        asks.append(("response_format", {"json_object": True}))
    if fmt is not None and fmt.json_schema is not None:
        if fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format: json_schema needs a schema", param="response_format")
        asks.append(("response_format", {"json": fmt.json_schema.schema_}))
    for name, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(body, name) is not None:
            asks.append((name, {key: getattr(body, name)}))
    if body.structured_outputs is not None:
        asks.append(
            ("structured_outputs", body.structured_outputs.model_dump(by_alias=True, exclude_none=True))
        )
    if isinstance(body, ChatCompletionRequest):
        tool = forced_tool(body)
        if tool is not None:
            asks.append(("tool_choice", {"json": tool.parameters or NO_PARAMETERS}))
    return asks


def _schema(schema: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """vLLM takes a schema as an object or as its JSON text."""
    if not isinstance(schema, str):
        return schema
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise InvalidRequestError(f"the schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError("the schema must be a JSON object")
    return parsed


def check_structure(grammars: Grammars, structure: Structure) -> None:
    """Check the grammar before admission (``Grammars.check``), so that one that cannot be
    followed is a 400 naming its field and why."""
    try:
        grammars.check(structure.spec)
    except InvalidRequestError as exc:
        raise APIError(400, f"{structure.field}: {exc}", param=structure.field) from None


def check_event(event: Event) -> Event:
    """``event``, unless its sample's grammar matcher failed: then a 422 saying why. The sample's
    output stops before the failure and does not follow the grammar to its end, so it is not
    returned as if it were complete (the 422 is the response, or the stream's error event)."""
    if event.error is not None:
        raise APIError(
            422,
            f"choice {event.index}: the output could not follow its grammar: {event.error}",
            code="grammar_failed",
        )
    return event


def forced_tool(body: ChatCompletionRequest) -> FunctionDefinition | None:
    """The function a chat request forces a call of (None: it answers in text).

    ``none`` answers in text; a named function, or ``required`` with one tool, is called;
    ``auto`` (the default when tools are given) would let the model choose between text and a
    call in its own tool-call syntax, which differs between models, so it is a 400, and so is
    ``required`` with several tools."""
    tools, choice = body.tools or [], body.tool_choice
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    if choice == "none":
        return None
    if not tools:
        if choice is None:
            return None
        raise APIError(400, "tool_choice: needs tools to choose from", param="tool_choice")
    if choice is None or choice == "auto":
        raise APIError(
            400,
            "tool_choice: 'auto' (the default with tools) is not supported: the model would choose "
            "between text and a call in its own syntax; set tool_choice to a function, "
            "'required' with one tool, or 'none'",
            param="tool_choice",
        )
    if choice == "required":
        if len(tools) > 1:
            raise APIError(
                400,
                "tool_choice: 'required' with several tools is not supported; name the function",
                param="tool_choice",
            )
        return tools[0].function
    assert not isinstance(choice, str)
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice: no tool is named {choice.function.name!r}", param="tool_choice")
    return tools[names.index(choice.function.name)].function


@dataclass(frozen=True)
class Reply:
    """How a chat reply carries its text: as content, or as the arguments of a forced call
    (``tool``), one call id per choice."""

    tool: FunctionDefinition | None
    ids: tuple[str, ...]

    @classmethod
    def of(cls, body: ChatCompletionRequest, choices: int) -> Reply:
        tool = forced_tool(body)
        return cls(tool, tuple(f"call_{uuid.uuid4().hex[:24]}" for _ in range(choices if tool else 0)))

    def message(self, index: int, text: str) -> AssistantMessage:
        if self.tool is None:
            return AssistantMessage(content=text)
        call = ToolCall(id=self.ids[index], function=FunctionCall(name=self.tool.name, arguments=text))
        return AssistantMessage(content=None, tool_calls=[call])

    def opening_delta(self, index: int) -> dict[str, Any]:
        """A streamed choice's first delta: the role, and the call being made."""
        if self.tool is None:
            return {"role": "assistant", "content": ""}
        call = {"index": 0, "id": self.ids[index], "type": "function"}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [call | {"function": {"name": self.tool.name, "arguments": ""}}],
        }

    def delta(self, text: str) -> dict[str, Any]:
        if not text:
            return {}
        if self.tool is None:
            return {"content": text}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def finish_reason(self, reason: str | None) -> str | None:
        """A call whose arguments are complete finishes with ``tool_calls`` (OpenAI's); one cut
        by ``max_tokens`` keeps ``length``."""
        return "tool_calls" if self.tool is not None and reason == "stop" else reason
