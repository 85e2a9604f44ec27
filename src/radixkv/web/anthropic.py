"""Anthropic's Messages API requests (``POST /v1/messages``, ``/v1/messages/count_tokens``):
the fields, checked, and the conversation as a chat template takes it (`to_chat`). The
server answers them; the router reads them the same way to route by their tokens.

The fields Anthropic defines are each honoured, accepted as changing nothing for this
model, or refused with a 400 naming them (docs/agents.md has the table). An unknown field
is refused, as Anthropic refuses it ("Extra inputs are not permitted").

* ``system`` (a string, or text blocks joined by a newline) becomes the first message, a
  ``system`` message among the messages a system message there; a user message's text
  blocks are joined by a newline; ``tool_result`` blocks become tool
  messages (``is_error`` results start ``Error: ``); an assistant's ``tool_use`` blocks
  its tool calls. A last assistant message of text is a prefill: the answer continues it.
* ``image``, ``document``, ``thinking`` and server tools are refused (this model reads no
  images and never thinks, so it never wrote a thinking block to send back).
* ``cache_control`` (``ephemeral``, ``ttl`` ``5m`` or ``1h``) on a tool, a system block or a
  message's block, at most `MAX_BREAKPOINTS`, longer ttls before shorter ones, as
  Anthropic orders them; a top-level ``cache_control`` marks the prompt's end.

Owns: reading Anthropic's requests. Must not touch: running them (the server's).
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from radixkv.web.errors import ApiError
from radixkv.web.nesting import MAX_DEPTH, depth

MAX_BREAKPOINTS = 4  # cache_control blocks a request may hold (Anthropic's limit)
# tools a request may hold: Anthropic states no limit, and an agent with many MCP servers
# sends hundreds; each is rendered into the prompt, so the context bounds them too
MAX_TOOLS = 1024
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024  # a stop sequence's length: every token searches back this far
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
SEPARATOR = "\n"  # between a system prompt's or a message's text blocks


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def seconds(self) -> float:
        return TTL_SECONDS[self.ttl or "5m"]


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None


class _Refused(BaseModel):
    """A block this server refuses (by its type; its fields are not read)."""

    model_config = ConfigDict(extra="allow")
    cache_control: CacheControl | None = None


class ImageBlock(_Refused):
    type: Literal["image"]


class DocumentBlock(_Refused):
    type: Literal["document"]


class ThinkingBlock(_Refused):
    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock | DocumentBlock,
                                  Field(discriminator="type")]] | None = None  # fmt: skip
    is_error: bool | None = None
    cache_control: CacheControl | None = None


Block = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    """A message; ``system`` ones mid-conversation too (Claude Code sends them, under the
    ``mid-conversation-system`` beta): text only."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(_Strict):
    """A custom tool. ``strict``: a call whose input breaks the schema is no call (the
    answer is text); ``eager_input_streaming`` changes nothing (a call's input streams
    as one delta); the fields that ask for what this server does not do (tool search's
    ``defer_loading``, programmatic callers, ``input_examples`` a template cannot show)
    are refused."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: Literal[False] | None = None
    allowed_callers: list[Literal["direct"]] | None = None
    input_examples: list[Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class Edit(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ContextManagement(_Strict):
    edits: list[Edit] = []


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "max", "xhigh"] | None = None
    format: Any = None


class Metadata(_Strict):
    user_id: str | None = None


class MessagesRequest(_Strict):
    """``POST /v1/messages``'s body (``max_tokens`` required), and radixkv's
    ``cache_salt`` (a tenant, as on the OpenAI routes)."""

    model: str
    messages: list[Message]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one (`tools`)
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: CacheControl | None = None
    container: Any = None
    mcp_servers: Any = None
    inference_geo: Any = None
    speed: Literal["standard"] | None = None
    betas: list[str] | None = None  # (as the anthropic-beta header: accepted)
    user_profile_id: str | None = None  # account ids: accepted, no effect on the answer
    workspace_id: str | None = None
    diagnostics: Any = None
    billing_policy: Any = None
    compaction: Any = None
    fallback_credit_token: Any = None
    fallbacks: Any = None
    thread: Any = None
    cache_salt: str | None = None


class CountTokensRequest(_Strict):
    """``POST /v1/messages/count_tokens``: the prompt's fields of a request."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    mcp_servers: Any = None
    speed: Literal["standard"] | None = None
    betas: list[str] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    cache_salt: str | None = None


# fields Anthropic defines that this server does not implement (set to anything: 400)
REFUSED = {
    "top_k": "top_k sampling is not implemented here: use temperature and top_p",
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported here: give the tools to the client",
    "inference_geo": "this server runs where it runs",
    "diagnostics": "diagnostics are not supported",
    "billing_policy": "this server does not bill",
    "compaction": "server-side compaction is not supported: the client compacts",
    "fallback_credit_token": "this server does not bill",
    "fallbacks": "fallback models are not supported: this server serves one model",
    "thread": "threads are not supported",
}
CLEARED_THINKING = "clear_thinking_20251015"  # nothing to clear: this model never thinks


class Breakpoint(NamedTuple):
    """A ``cache_control``: where its block is (tool ``k``; system block ``j``; message
    ``i`` block ``j``; or the prompt's end) and its ttl in seconds."""

    # ("tools", k, 0) | ("system", j, 0) | ("message", i, j) | ("end", 0, 0)
    where: tuple[str, int, int]
    seconds: float


class Chat(NamedTuple):
    """A request as a chat template takes it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # OpenAI-shaped: {"type": "function", "function"}
    choice: str | None  # None / "none" / "auto" / "required" / a tool's name
    parallel: bool
    prefill: str  # the answer's start (a last assistant message's text)
    breakpoints: list[Breakpoint]


def _refuse(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


def check_fields(req: MessagesRequest | CountTokensRequest) -> None:
    """The fields refused, or asking what this model cannot do."""
    for name, why in REFUSED.items():
        if getattr(req, name, None) is not None:
            raise _refuse(f"{name}: {why}", name)
    cm = req.context_management
    for k, edit in enumerate(cm.edits if cm else ()):
        if edit.type != CLEARED_THINKING:  # clearing tool results would change the prompt
            raise _refuse(f"context_management.edits[{k}]: {edit.type!r} is not supported "
                          f"here (only {CLEARED_THINKING!r}, which clears nothing: this model "
                          "never thinks)", "context_management")  # fmt: skip
    if req.output_config is not None and req.output_config.format is not None:
        raise _refuse("output_config.format: structured outputs are not supported",
                      "output_config")  # fmt: skip


def _tools(raw: list[dict[str, Any]]) -> list[Tool]:
    if len(raw) > MAX_TOOLS:  # counted before any is validated
        raise _refuse(f"tools: at most {MAX_TOOLS} tools, got {len(raw):,}", "tools")
    tools = []
    for k, t in enumerate(raw):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in (None, "custom"):
            raise _refuse(f"tools[{k}]: the server tool {str(kind)[:80]!r} is not supported: "
                          "only custom tools (name, description, input_schema)",
                          "tools")  # fmt: skip
        if isinstance(t, dict) and t.get("input_examples"):
            raise _refuse(f"tools[{k}].input_examples: the chat template cannot show them",
                          "tools")  # fmt: skip
        try:
            tools.append(Tool.model_validate(t))
        except ValueError as e:
            first = e.errors()[0] if hasattr(e, "errors") else {}  # type: ignore[attr-defined]
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise _refuse(f"tools[{k}]{'.' + loc if loc else ''}: "
                          f"{first.get('msg', str(e))}", "tools") from None  # fmt: skip
    return tools


def _text_of(blocks: list[Any], where: str) -> str:
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            raise _refuse(f"{where}[{j}]: {b.type} blocks are not supported here (text only)",
                          "messages")  # fmt: skip
        parts.append(b.text)
    return SEPARATOR.join(parts)


def _user(i: int, blocks: list[Any], out: list[dict[str, Any]]) -> None:
    """A user message's blocks as tool messages and user messages, in order."""
    text: list[str] = []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if isinstance(b, ToolResultBlock):
            if text:
                out.append({"role": "user", "content": SEPARATOR.join(text)})
                text = []
            content = b.content if isinstance(b.content, str) else _text_of(
                b.content or [], f"{where}.content")  # fmt: skip
            if b.is_error:
                content = f"Error: {content}"
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif isinstance(b, TextBlock):
            text.append(b.text)
        else:
            raise _refuse(f"{where}: {b.type} blocks are not supported here", "messages")
    if text:
        out.append({"role": "user", "content": SEPARATOR.join(text)})


def _assistant(i: int, blocks: list[Any], out: list[dict[str, Any]]) -> None:
    text, calls = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolUseBlock):
            if depth(b.input) > MAX_DEPTH:
                raise _refuse(f"messages[{i}].content[{j}].input: nested deeper than "
                              f"{MAX_DEPTH} levels", "messages")  # fmt: skip
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": b.input}})  # fmt: skip
        else:
            why = ("this model never thinks, so it wrote no thinking block to send back"
                   if b.type in ("thinking", "redacted_thinking") else "text and tool_use only")
            raise _refuse(f"messages[{i}].content[{j}]: {b.type} blocks are not supported "
                          f"here ({why})", "messages")  # fmt: skip
    msg: dict[str, Any] = {"role": "assistant", "content": SEPARATOR.join(text) if text else None}
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    out.append(msg)


def template_messages(system: Any, messages: list[Message]) -> list[dict[str, Any]]:
    """``system`` and ``messages`` as the chat template's messages."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text = system if isinstance(system, str) else _text_of(system, "system")
        out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else (
            m.content)  # fmt: skip
        if m.role == "system":
            out.append({"role": "system", "content": _text_of(blocks, f"messages[{i}].content")})
        else:
            (_user if m.role == "user" else _assistant)(i, blocks, out)
    return out


def breakpoints(req: MessagesRequest | CountTokensRequest, tools: list[Tool]) -> list[Breakpoint]:
    """The request's ``cache_control`` marks in the prompt's order (tools, system,
    messages, the end).

    Raises:
        ApiError: more than `MAX_BREAKPOINTS`, or a longer ttl after a shorter one.
    """
    found = [Breakpoint(("tools", k, 0), t.cache_control.seconds)
             for k, t in enumerate(tools) if t.cache_control]  # fmt: skip
    if isinstance(req.system, list):
        found += [Breakpoint(("system", j, 0), b.cache_control.seconds)
                  for j, b in enumerate(req.system) if b.cache_control]  # fmt: skip
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list):
            found += [Breakpoint(("message", i, j), b.cache_control.seconds)
                      for j, b in enumerate(m.content) if b.cache_control]  # fmt: skip
    if req.cache_control is not None:
        found.append(Breakpoint(("end", 0, 0), req.cache_control.seconds))
    if len(found) > MAX_BREAKPOINTS:
        raise _refuse(f"cache_control: a maximum of {MAX_BREAKPOINTS} blocks with "
                      f"cache_control may be provided, found {len(found)}",
                      "cache_control")  # fmt: skip
    for a, b in itertools.pairwise(found):
        if b.seconds > a.seconds:
            raise _refuse("cache_control: a ttl='1h' breakpoint must not come after a "
                          "ttl='5m' one (longer ttls first)", "cache_control")  # fmt: skip
    return found


def to_chat(req: MessagesRequest | CountTokensRequest) -> Chat:
    """The request as a chat template takes it (see the module docstring).

    Raises:
        ApiError: a refused field or block (400 naming it).
    """
    check_fields(req)
    tools = _tools(req.tools or [])
    marks = breakpoints(req, tools)
    messages = template_messages(req.system, req.messages)
    prefill = ""
    last = req.messages[-1] if req.messages else None
    if last is not None and last.role == "assistant":
        if messages[-1].get("tool_calls"):
            raise _refuse("messages: the last message is an assistant's tool_use: send its "
                          "tool_result in a user message", "messages")  # fmt: skip
        prefill = messages.pop()["content"] or ""
    choice = req.tool_choice
    name = None if choice is None else {"auto": "auto", "any": "required", "none": "none",
                                        "tool": choice.name}[choice.type]  # fmt: skip
    if choice is not None and choice.type == "tool" and not choice.name:
        raise _refuse("tool_choice: a tool_choice of type tool needs the tool's name",
                      "tool_choice")  # fmt: skip
    if name not in (None, "auto", "required", "none") and name not in {t.name for t in tools}:
        raise _refuse(f"tool_choice: no tool named {str(name)[:80]!r}", "tool_choice")
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return Chat(messages, template_tools(tools), name, parallel, prefill, marks)


def template_tools(tools: list[Tool]) -> list[dict[str, Any]] | None:
    """Tools as chat templates take them (OpenAI's function shape)."""
    return [{"type": "function", "function": {k: v for k, v in (
        ("name", t.name), ("description", t.description), ("parameters", t.input_schema),
        ("strict", t.strict),
    ) if v is not None}} for t in tools] or None  # fmt: skip


def cut_chat(req: MessagesRequest | CountTokensRequest, where: tuple[str, int, int]) -> Any:
    """What the template renders up to and including the breakpoint's block: (messages,
    tools), or None for the prompt's end."""
    head = cut(req, where)
    if head is None:
        return None
    return template_messages(head.system, head.messages), template_tools(_tools(head.tools or []))


def cut(req: MessagesRequest | CountTokensRequest, where: tuple[str, int, int]) -> Any:
    """The request up to and including the block at ``where`` (what a breakpoint there
    caches), or None for the prompt's end."""
    kind, a, b = where
    if kind == "end":
        return None
    if kind == "tools":
        return req.model_copy(update={"tools": (req.tools or [])[: a + 1], "system": None,
                                      "messages": [], "cache_control": None})  # fmt: skip
    if kind == "system":
        return req.model_copy(update={"system": req.system[: a + 1],  # type: ignore[index]
                                      "messages": [], "cache_control": None})  # fmt: skip
    m = req.messages[a]
    head = m.model_copy(update={"content": m.content[: b + 1]})  # type: ignore[index]
    return req.model_copy(update={"messages": [*req.messages[:a], head], "cache_control": None})


__all__ = ["MAX_BREAKPOINTS", "Breakpoint", "Chat", "CountTokensRequest", "MessagesRequest",
           "cut", "cut_chat", "template_messages", "template_tools", "to_chat"]  # fmt: skip
