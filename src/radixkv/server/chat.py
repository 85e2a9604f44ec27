"""A chat request's messages and tools as the chat template takes them, checked, and what
its answer does with tool calls (`ToolPlan`). Shared by the OpenAI route (`openai_chat`)
and the Anthropic one (`radixkv.server.messages` builds the same lists).

Rules (each refusal a 400 naming the field):

* ``tools``: at most `MAX_TOOLS` (OpenAI's 128), names ``[A-Za-z0-9_-]{1,64}`` and unique,
  ``parameters`` a JSON Schema (checked by ``jsonschema``) nested at most `MAX_DEPTH`;
  the model's template must render tools and the server must have a parser for them.
* ``tool_choice``: ``none`` (tools rendered, the output never parsed), ``auto`` (the
  default with tools), ``required`` or a named function: the answer is constrained to
  open a call (`radixkv.server.tools.Parser.opening` is put at its start; the model writes
  the rest); output that then does not parse is returned as text, never an error.
* ``parallel_tool_calls: false``: only the first call is returned.
* History: an assistant's ``tool_calls`` need ids and arguments that are a JSON object;
  a ``tool`` message must answer a call made before it (``tool_call_id``).

Owns: checking tools and tool history; template messages. Must not touch: rendering,
the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from radixkv.server.protocol import ApiError
from radixkv.server.tools import Parser
from radixkv.web.nesting import MAX_DEPTH, depth

MAX_TOOLS = 128  # OpenAI's limit on a request's tools
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolPlan(NamedTuple):
    """What an answer does with tool calls: ``parser`` (None: the output is text),
    ``opening`` (put at the answer's start: the call it must make), ``single``
    (``parallel_tool_calls: false``: the first call only), ``tools``: each tool's
    name and, for a ``strict`` one, its schema (a call's arguments must match it)."""

    parser: Parser | None
    opening: str = ""
    single: bool = False
    tools: Mapping[str, Any] = MappingProxyType({})  # name -> a strict one's validator

    def accepts(self, calls: list[Any]) -> bool:
        """Whether ``calls`` are calls of the request's tools, a strict tool's arguments
        valid against its schema (otherwise the output is text: a call the client never
        offered, or one that breaks a schema it asked to be kept, is no call)."""
        for c in calls:
            if c.name not in self.tools:
                return False
            check = self.tools[c.name]
            try:
                if check is not None and not check.is_valid(json.loads(c.arguments)):
                    return False
            except RecursionError:
                return False
        return True


def _validator(schema: dict[str, Any]) -> Any:
    """A strict tool's validator, made off the event loop. The schema's regular
    expressions (``pattern``, ``patternProperties``) are left out: a client's pattern run
    against a model's output on the event loop could take any time (a catastrophic
    backtrack), so they are not checked (said in docs/agents.md)."""
    from jsonschema import Draft202012Validator

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in _REGEX_KEYS}
        return [strip(x) for x in v] if isinstance(v, list) else v

    return Draft202012Validator(strip(schema))


_REGEX_KEYS = frozenset({"pattern", "patternProperties"})


NO_TOOLS = ToolPlan(None)


def check_schema(schema: Any, where: str, param: str) -> None:
    """``schema`` is a JSON Schema object (Draft 2020-12's meta-schema says so)."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{where}: must be a JSON Schema object", param)
    if depth(schema) > MAX_DEPTH:
        raise ApiError(400, f"{where}: nested deeper than {MAX_DEPTH} levels", param)
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise ApiError(400, f"{where}{path}: not a valid JSON Schema ({e.message[:200]})",
                       param) from None  # fmt: skip
    except RecursionError:
        raise ApiError(400, f"{where}: nested too deeply", param) from None


def check_tools(tools: list[dict[str, Any]], param: str, schema_key: str,
                most: int = MAX_TOOLS) -> None:  # fmt: skip
    """Count (at most ``most``), names and schemas of tools given as ``{"name",
    schema_key}`` dicts."""
    if len(tools) > most:
        raise ApiError(400, f"{param}: at most {most} tools, got {len(tools):,}", param)
    seen: set[str] = set()
    for i, t in enumerate(tools):
        name = t["name"]
        if not _NAME.fullmatch(name):
            raise ApiError(400, f"{param}[{i}]: the name {name[:80]!r} must be 1 to 64 letters, "
                           "digits, _ or -", param)  # fmt: skip
        if name in seen:
            raise ApiError(400, f"{param}[{i}]: the name {name!r} is used twice", param)
        seen.add(name)
        if t.get(schema_key) is not None:
            check_schema(t[schema_key], f"{param}[{i}].{schema_key}", param)


def arguments(text: str, where: str) -> dict[str, Any]:
    """A call's arguments (JSON text of an object) as a dict, for the template."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ApiError(400, f"{where}: arguments must be a JSON object", "messages") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object", "messages")
    if depth(value) > MAX_DEPTH:
        raise ApiError(400, f"{where}: arguments nest deeper than {MAX_DEPTH} levels",
                       "messages")  # fmt: skip
    return value


def check_answers(messages: list[dict[str, Any]], param: str = "messages") -> None:
    """Every ``tool`` message answers a call an assistant message made before it."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        for c in m.get("tool_calls") or ():
            called.add(c["id"])
        if m["role"] == "tool" and m.get("tool_call_id") not in called:
            raise ApiError(400, f"{param}[{i}]: a tool result for the call "
                           f"{str(m.get('tool_call_id'))[:80]!r}, which no earlier assistant "
                           "message made", param)  # fmt: skip


def plan(
    parser: Parser | None, tools: list[dict[str, Any]], choice: str | None, parallel: bool,
    param: str = "tools", schema_key: str = "parameters",
) -> ToolPlan:  # fmt: skip
    """What the answer does with calls of ``tools`` (``{"name", schema_key, "strict"}``),
    for ``choice`` (``none``, ``auto``, ``required`` or a function's name)."""
    has_tools = bool(tools)
    if not has_tools:
        if choice is not None:  # (OpenAI's rule: tool_choice only with tools)
            raise ApiError(400, "tool_choice is only allowed when tools are specified",
                           "tool_choice")  # fmt: skip
        return NO_TOOLS
    if parser is None:
        raise ApiError(400, f"{param}: this server has no tool call parser for its model: "
                       "start it with --tool-call-parser", param)  # fmt: skip
    if choice == "none":
        return NO_TOOLS
    opening = "" if choice in (None, "auto") else parser.opening(
        None if choice == "required" else choice)  # fmt: skip
    known = {t["name"]: _validator(t.get(schema_key) or {"type": "object"})
             if t.get("strict") else None for t in tools}  # fmt: skip
    return ToolPlan(parser, opening, not parallel, known)


def openai_chat(req: Any, parser: Parser | None) -> tuple[list[dict], list[dict] | None, ToolPlan]:
    """An OpenAI chat request's template messages, tools and plan."""
    tools = [t.function.model_dump(exclude_none=True) for t in req.tools or ()]
    check_tools(tools, "tools", "parameters")
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.function.name
        if choice not in {t["name"] for t in tools}:
            raise ApiError(400, f"tool_choice: no tool named {choice[:80]!r}", "tool_choice")
    if req.parallel_tool_calls is not None and not tools:
        raise ApiError(400, "parallel_tool_calls is only allowed when tools are specified",
                       "parallel_tool_calls")  # fmt: skip
    p = plan(parser, tools, choice, req.parallel_tool_calls is not False)
    messages = []
    for i, m in enumerate(req.messages):
        if m.role == "function" or m.function_call is not None:
            raise ApiError(400, f"messages[{i}]: function messages (the deprecated "
                           "function_call API) are not supported: use tools",
                           "messages")  # fmt: skip
        out: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, f"messages[{i}]: only an assistant message makes "
                               "tool_calls", "messages")  # fmt: skip
            out["content"] = m.text() if m.content is not None else None
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": arguments(c.function.arguments, f"messages[{i}].tool_calls[{k}]"),
                }}
                for k, c in enumerate(m.tool_calls)
            ]  # fmt: skip
        elif m.content is None:
            raise ApiError(400, f"messages[{i}]: content is missing", "messages")
        if m.role == "tool":
            out["tool_call_id"] = m.tool_call_id
        messages.append(out)
    check_answers(messages)
    return messages, ([{"type": "function", "function": t} for t in tools] or None), p


__all__ = ["MAX_DEPTH", "MAX_TOOLS", "NO_TOOLS", "ToolPlan", "arguments", "check_answers",
           "check_schema", "check_tools", "depth", "openai_chat", "plan"]  # fmt: skip
