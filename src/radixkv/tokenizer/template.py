"""A checkpoint's chat template, rendered as ``transformers`` renders it (Jinja in an
immutable sandbox: no attribute or method that changes state, no private attributes),
with bounded work, time and memory, so that no template and no request can make a render
take unbounded time or memory (nested ``range(100000)`` loops once grew a request to
7.6 GB; a string doubled by ``~``, ``+``, ``replace``, ``format`` or ``join`` in a loop or
a recursive macro reached 2.5 GB in a second; a macro calling itself twice per level never
returned).

The bounds, each a `TemplateLimit` (a ``ValueError``: the server answers 400), against a
per-render `_Budget` (``limit``: the caller's output bound, roughly what its context can
hold):

* **steps**: every ``for`` loop's iteration and every call (a macro, a method, a filter,
  a function) takes one of `MAX_STEPS`;
* **time**: the render stops past `MAX_RENDER_S` seconds (checked at every step);
* **values**: every value a call, filter, ``+``, ``*``, ``%`` or ``~`` makes is at most
  ``limit`` long (a container counts 8 per element), checked *before* the operation where
  it could multiply a size (``*``, ``+``, ``~``, ``%``, ``replace``, ``join``, ``format``,
  ``expandtabs``, ``indent``), after it otherwise; and all of them together at most
  `PRODUCED` x ``limit``, which bounds the memory a render holds and the work it does;
* **output**: the text stops beyond ``limit`` characters;
* integer arguments beyond ``limit`` (``"x".center(10**9)``, ``"%*s" % (10**9, x)``), a
  ``str.format`` field width of seven digits or more and ``**`` past 4096 are refused
  before they run; a macro recursing without end is stopped by Python's recursion limit.

Templates compile once per text (cached); each render has its own budget (a context
variable, so filters that take no context see it too), so renders on several threads at
once are safe.

Owns: rendering a chat template. Must not touch: tokenizing (the tokenizer's).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

MAX_STEPS = 1_000_000  # loop iterations and calls a render may take in all (a second or so)
MAX_RENDER_S = 3.0  # seconds a render may take
PRODUCED = 32  # every value a render makes, together, at most this many times its limit
_WIDE = re.compile(r"\{[^{}]*:[^{}]*\d{7}")  # a format field of width >= 1,000,000
_SIZED = (str, list, tuple, dict, set, frozenset)


class TemplateLimit(ValueError):
    """A chat template's render went beyond its bounds (see the module docstring)."""


def _size(value: Any) -> int:
    """What a value costs against the budget: a string its length, a container 8 per
    element (a pointer each), anything else nothing."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, _SIZED):
        return 8 * len(value)
    return 0


def _text_len(value: Any) -> int:
    """The length of ``str(value)`` without making it where that could be large."""
    return len(value) if isinstance(value, str) else 8 * len(value) if isinstance(
        value, _SIZED) else 32  # fmt: skip


class _Budget:
    def __init__(self, limit: int) -> None:
        self.steps, self.limit = MAX_STEPS, limit
        self.produced, self.most = 0, PRODUCED * limit
        self.deadline = time.monotonic() + MAX_RENDER_S

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise TemplateLimit(f"the chat template took over {MAX_STEPS:,} loop steps and "
                                "calls")  # fmt: skip
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"the chat template took over {MAX_RENDER_S:g} s to render")

    def iterate(self, items: Iterable[Any]) -> Iterator[Any]:
        for item in items:
            self.step()
            yield item

    def check_int(self, *values: Any) -> None:
        for v in values:
            if type(v) is int and abs(v) > self.limit:
                raise TemplateLimit(f"the chat template used a size of {v:,}, beyond the "
                                    f"{self.limit:,} characters its output may take")  # fmt: skip

    def check_size(self, n: int) -> None:
        """A value of ``n`` is about to be made (or was)."""
        if n > self.limit:
            raise TemplateLimit(f"the chat template made a value of {n:,} (characters, or 8 "
                                f"an element), beyond the {self.limit:,} its output may "
                                "take")  # fmt: skip

    def charge(self, value: Any) -> Any:
        n = _size(value)
        self.check_size(n)
        self.produced += n
        if self.produced > self.most:
            raise TemplateLimit(f"the chat template made over {self.most:,} characters of "
                                "values in all")  # fmt: skip
        return value

    def concat(self, values: list[Any]) -> str:
        """``a ~ b ~ ...`` (the parsed template's ``Concat`` nodes call this)."""
        self.step()
        self.check_size(sum(map(_text_len, values)))
        return self.charge("".join(map(str, values)))


_current: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "radixkv_template_budget", default=None
)


def _grows(name: str, value: Any, args: tuple, kwargs: dict) -> int:
    """An upper bound on the size of ``value.name(*args)`` (or the filter ``name``) where
    the operation can multiply sizes; 0 where it cannot."""
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = str(args[0]), args[1]
        hits = value.count(old) if old else len(value) + 1
        return len(value) + hits * max(0, _text_len(new) - len(old))
    if name == "join" and isinstance(value, (list, tuple)):
        sep = args[0] if args else kwargs.get("d", "")
        return sum(map(_text_len, value)) + _text_len(sep) * len(value)
    if name == "join" and isinstance(value, str) and args and isinstance(args[0], (list, tuple)):
        return sum(map(_text_len, args[0])) + len(value) * len(args[0])
    if name in ("format", "format_map") and isinstance(value, str):
        parts = [*args, *kwargs.values()]
        if args and isinstance(args[0], dict):
            parts = list(args[0].values())
        widest = max(map(_text_len, parts), default=0)
        return len(value) + (value.count("{") + value.count("%")) * widest
    if name in ("expandtabs", "indent") and isinstance(value, str):
        width = next((a for a in args if type(a) is int), 8)
        return len(value) + (value.count("\t") + value.count("\n") + 1) * abs(width)
    return 0


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Budgeted(NodeTransformer):
        """Every loop draws on the budget; every ``~`` is the budget's `_Budget.concat`."""

        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            fn = nodes.Getattr(nodes.Name("_radixkv_budget", "load"), "iterate", "load")
            node.iter = nodes.Call(fn, [node.iter], [], None, None)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            fn = nodes.Getattr(nodes.Name("_radixkv_budget", "load"), "concat", "load")
            return nodes.Call(fn, [nodes.List(node.nodes)], [], None, None)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            return Budgeted().visit(super()._parse(source, name, filename))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _current.get()
            if budget is None:
                return super().call_binop(context, operator, left, right)
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int:
                        budget.check_int(len(seq) * n)
                        budget.check_size(_size(seq) * n)
            elif operator == "+":
                budget.check_size(_size(left) + _size(right))
            elif operator == "**":
                if isinstance(right, (int, float)) and right > 4096:
                    raise TemplateLimit(f"the chat template raised a number to the {right:,}")
            elif operator == "%" and isinstance(left, str):
                values = right if isinstance(right, tuple) else (right,)
                budget.check_int(*values)
                budget.check_size(len(left) + left.count("%") * max(map(_text_len, values)))
            return budget.charge(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget = _current.get()
            if budget is None:
                return super().call(__context, __obj, *args, **kwargs)
            budget.step()
            budget.check_int(*args, *kwargs.values())
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            budget.check_size(_grows(name, owner, args, kwargs))
            return budget.charge(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value: Any) -> Any:  # str.format, str.format_map
            f_self = getattr(value, "__self__", None)
            if isinstance(f_self, str) and _WIDE.search(f_self):
                raise TemplateLimit("the chat template formats a field a million wide")
            return super().wrap_str_format(value)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    for name, fn in list(env.filters.items()):  # a filter's sizes are bounded too
        env.filters[name] = _bounded_filter(name, fn)
    return env.from_string(source)


def _bounded_filter(name: str, fn: Any) -> Any:
    """``fn`` drawing on the render's budget: a step, its integer arguments, what it may
    grow to before, what it made after (a filter passed a context or environment first
    keeps that)."""
    passes = getattr(fn, "jinja_pass_arg", None) is not None

    @functools.wraps(fn)
    def bounded(*all_args: Any, **kwargs: Any) -> Any:
        budget = _current.get()
        if budget is None:
            return fn(*all_args, **kwargs)
        value, *args = all_args[1:] if passes else all_args
        budget.step()
        budget.check_int(*args, *kwargs.values())
        budget.check_size(_grows(name, value, tuple(args), kwargs))
        return budget.charge(fn(*all_args, **kwargs))

    return bounded


def raise_exception(message: str) -> None:
    """What transformers gives templates to refuse a conversation."""
    raise ValueError(message)


def render(source: str, limit: int, **context: Any) -> str:
    """``source`` rendered with ``context`` (plus ``raise_exception``), within the bounds
    of the module docstring for an output of at most ``limit`` characters.

    Raises:
        TemplateLimit: a bound was exceeded. ValueError: the template refused the
            conversation (``raise_exception``), or failed to render (Jinja's errors).
    """
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    budget = _Budget(limit)
    token = _current.set(budget)
    try:
        template = _compiled(source)
        pieces, size = [], 0
        for piece in template.generate(
            **context, _radixkv_budget=budget, raise_exception=raise_exception
        ):
            size += len(piece)
            if size > limit:
                raise TemplateLimit(f"the chat template's output went beyond {limit:,} "
                                    "characters")  # fmt: skip
            pieces.append(piece)
    except RecursionError:
        raise TemplateLimit("the chat template recursed too deeply") from None
    except SecurityError as e:
        raise ValueError(f"the chat template did something the sandbox refuses ({e})") from None
    except TemplateError as e:
        raise ValueError(f"the chat template failed ({type(e).__name__}: {e})") from None
    except OverflowError as e:
        raise TemplateLimit(f"the chat template overflowed ({e})") from None
    except MemoryError:
        raise TemplateLimit("the chat template ran out of memory") from None
    finally:
        _current.reset(token)
    return "".join(pieces)


def output_limit(messages: list[dict[str, Any]], tools: list | None = None) -> int:
    """How many characters a render of ``messages`` (and ``tools``) may take: twice their
    text (a tool call's or a tool's as JSON), 256 a message (a template's markers), and
    1 MiB."""
    text = 0
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            text += len(content) if isinstance(content, str) else 0
            if m.get("tool_calls"):
                text += len(json.dumps(m["tool_calls"], ensure_ascii=False, default=str))
    if tools:
        text += len(json.dumps(tools, ensure_ascii=False, default=str))
    return 2 * text + 256 * len(messages) + (1 << 20)


def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
           separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    """``tojson`` as transformers gives templates (no HTML escaping, which Jinja's own
    does: ``<`` would render as ``\\u003c`` and the prompt differ from transformers')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)  # fmt: skip


__all__ = ["MAX_RENDER_S", "MAX_STEPS", "TemplateLimit", "output_limit", "render"]
