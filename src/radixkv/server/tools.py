"""Tool calls in a model's output, one parser per way a family writes them, and the
streaming split of an output into text and calls.

Parsers (``--tool-call-parser``; by default the one whose marker the folder's chat template
writes: `parser_for`):

* ``hermes`` (Qwen2, Qwen3, Qwen3.5, and make-model's folders): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, any number, text before them the message's content;
* ``llama3_json`` (Llama 3.1+): the whole output one JSON object ``{"name": ...,
  "parameters": {...}}`` (or several joined by ``;``), after an optional ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (v3) or
  ``name[ARGS]{...}`` pairs (v11+).

Contract: `Parser.parse` never raises on a model's output (a nest deep enough to make
``json`` recurse past Python's limit included): what does not parse is the message's text
(``calls`` empty). A call's ``arguments`` is the JSON text of an object.
`Parser.opening` is what a ``tool_choice`` of ``required`` or a named function puts at the
start of the answer (the answer is constrained to open a call; the model writes the rest),
and `Stream` splits a streamed output: text that cannot be the start of a call goes out at
once; from a call's marker on, the output is held and parsed when it ends.

Owns: parsing tool calls. Must not touch: rendering tools (the chat template's).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from typing import Any, NamedTuple

PARSERS = ("hermes", "llama3_json", "mistral")
# what a chat template that renders tools shows the model, and so the parser for its calls
# (Qwen's templates show <tool_call>, Mistral's [TOOL_CALLS], Llama 3.1's <|python_tag|>
# or "parameters" in its JSON example)
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
    ('"parameters"', "llama3_json"),
)  # fmt: skip
_ID_CHARS = string.ascii_letters + string.digits


class Call(NamedTuple):
    """A tool call: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


class Parsed(NamedTuple):
    """An output split: its text (None when it is only calls) and its calls."""

    content: str | None
    calls: list[Call]


def call_id(prefix: str = "call_") -> str:
    """A fresh call id (OpenAI's look: ``call_`` and 24 letters and digits)."""
    return prefix + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _call(obj: Any, args_key: str = "arguments") -> Call | None:
    """A call from a parsed ``{"name": ..., args_key: {...}}`` (None: not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # (a deep nest: not a call)
            return None
    if not isinstance(args, dict):
        return None
    try:
        return Call(call_id(), obj["name"], json.dumps(args, ensure_ascii=False))
    except RecursionError:
        return None


def _text(text: str) -> str | None:
    return text if text.strip() else None


class Parser:
    """A family's way of writing calls (see the module docstring)."""

    name = ""
    marker = ""  # the text a call starts with ("": the output's first character decides)

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def opening(self, function: str | None) -> str:
        """The start of an answer that must be a call (``function``: of that one)."""
        raise NotImplementedError

    def starts_call(self, head: str) -> bool | None:
        """Whether an output beginning ``head`` holds calls: True, False, or None (not
        known yet). Only for parsers whose calls are the whole output."""
        return False


class Hermes(Parser):
    name, marker = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(text, [])
        calls = []
        for m in self._CALL.finditer(text, at):
            try:
                call = _call(json.loads(m.group(1)))
            except (ValueError, RecursionError):  # (a deep nest: not a call)
                call = None
            if call is None:  # one broken call: the whole output is text
                return Parsed(text, [])
            calls.append(call)
        return Parsed(_text(text[:at].rstrip()), calls)

    def opening(self, function: str | None) -> str:
        if function is None:
            return '<tool_call>\n{"name": "'
        return f'<tool_call>\n{{"name": {json.dumps(function)}, "arguments": '


class Llama3Json(Parser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip()
        body = body.removeprefix(self.tag).strip()
        if not body.startswith("{"):
            return Parsed(text, [])
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):  # (a deep nest: not a call)
                return Parsed(text, [])
            call = _call(obj, "parameters")
            if call is None:
                return Parsed(text, [])
            calls.append(call)
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return Parsed(text, [])
            at = len(body) - len(rest)
        return Parsed(None, calls)

    def opening(self, function: str | None) -> str:
        if function is None:
            return '{"name": "'
        return f'{{"name": {json.dumps(function)}, "parameters": '

    def starts_call(self, head: str) -> bool | None:
        body = head.lstrip()
        if not body:
            return None
        if body.startswith("{"):
            return True
        if self.tag.startswith(body) or body.startswith(self.tag):
            return None if len(body) <= len(self.tag) else body[len(self.tag):].lstrip(
                ).startswith("{") or None  # fmt: skip
        return False


class Mistral(Parser):
    name, marker = "mistral", "[TOOL_CALLS]"

    def parse(self, text: str) -> Parsed:
        at = text.find(self.marker)
        if at < 0:
            return Parsed(text, [])
        rest = text[at:].replace(self.marker, " ").strip()
        calls = self._v3(rest) if rest.startswith("[") else self._v11(rest)
        if calls is None:
            return Parsed(text, [])
        return Parsed(_text(text[:at].rstrip()), calls)

    @staticmethod
    def _v3(rest: str) -> list[Call] | None:
        try:
            items = json.loads(rest)
        except (ValueError, RecursionError):  # (a deep nest: not a call)
            return None
        calls = [_call(o) for o in items] if isinstance(items, list) and items else [None]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    @staticmethod
    def _v11(rest: str) -> list[Call] | None:
        calls, decoder = [], json.JSONDecoder()
        while rest:
            name, sep, after = rest.partition("[ARGS]")
            if not sep or not name.strip():
                return None
            try:
                args, end = decoder.raw_decode(after.lstrip())
            except (ValueError, RecursionError):  # (a deep nest: not a call)
                return None
            call = _call({"name": name.strip(), "arguments": args})
            if call is None:
                return None
            calls.append(call)
            rest = after.lstrip()[end:].strip()
        return calls or None

    def opening(self, function: str | None) -> str:
        if function is None:
            return '[TOOL_CALLS][{"name": "'
        return f'[TOOL_CALLS][{{"name": {json.dumps(function)}, "arguments": '


_PARSERS: dict[str, Callable[[], Parser]] = {
    "hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}  # fmt: skip


def make_parser(name: str) -> Parser:
    """The parser called ``name`` (one of `PARSERS`).

    Raises:
        ValueError: no such parser.
    """
    if name not in _PARSERS:
        raise ValueError(f"tool call parser {name!r}: expected one of {', '.join(PARSERS)}")
    return _PARSERS[name]()


def parser_for(template: str | None) -> str | None:
    """The parser for the calls a chat template teaches its model to write (None: the
    template renders no tools, or in no way radixkv knows)."""
    if not template or "tools" not in template:
        return None
    return next((name for marker, name in _TEMPLATE_MARKERS if marker in template), None)


class Stream:
    """A streamed output split as it comes: `feed` a step's text, get the text that may go
    out now; `end` gives the calls (and any held text that turned out not to be calls).
    Text that could still be the start of a call's marker is held back."""

    def __init__(self, parser: Parser, opening: str = "") -> None:
        self.parser = parser
        self.opening = opening
        self.held = opening  # a forced opening starts the call at once
        self.in_call = bool(opening)
        self.head = ""  # (parsers whose calls are the whole output) the output so far
        self.decided = bool(opening) or parser.marker != ""

    def feed(self, text: str) -> str:
        if self.in_call:
            self.held += text
            return ""
        if not self.decided:  # the first characters decide (llama3_json)
            self.head += text
            starts = self.parser.starts_call(self.head)
            if starts is None:
                return ""
            self.decided = True
            if starts:
                self.in_call, self.held, self.head = True, self.head, ""
                return ""
            out, self.head = self.head, ""
            return out
        if not self.parser.marker:
            return text
        self.held += text
        at = self.held.find(self.parser.marker)
        if at >= 0:  # (the whitespace before a call is not the message's: as `parse`)
            out, self.held, self.in_call = self.held[:at].rstrip(), self.held[at:], True
            return out
        keep = _partial_suffix(self.held, self.parser.marker)
        out = self.held[: len(self.held) - keep]
        out = out.rstrip()  # whitespace waits: it may come before a call
        self.held = self.held[len(out):]
        return out

    def end(self, accepts: Callable[[list[Call]], bool] | None = None) -> Parsed:
        """What is left: (text to send, calls). Calls ``accepts`` refuses are text (the
        held output, without the forced opening the client never saw)."""
        rest = self.held + self.head
        self.held = self.head = ""
        if not self.in_call:
            return Parsed(rest or None, [])
        parsed = self.parser.parse(rest)
        if parsed.calls and accepts is not None and not accepts(parsed.calls):
            return Parsed(rest.removeprefix(self.opening) or None, [])
        return parsed


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


__all__ = ["PARSERS", "Call", "Parsed", "Parser", "Stream", "call_id", "make_parser",
           "parser_for"]  # fmt: skip
