"""A checkpoint's chat template, rendered as ``transformers`` renders it (Jinja in an
immutable sandbox: no attribute or method that changes state, no private attributes),
with bounded work and output, so that no template and no request can make a render take
unbounded time or memory (nested ``range(100000)`` loops once grew a request to 7.6 GB).

The bounds, each a `TemplateLimit` (a ``ValueError``: the server answers 400):

* **work**: every ``for`` loop's iterable is wrapped (the parsed template is rewritten
  before it is compiled) so that the render takes at most `MAX_STEPS` loop iterations in
  all; a macro recursing without end is stopped by Python's recursion limit;
* **output**: the text is produced in pieces and stops beyond ``limit`` characters (the
  caller's: roughly what its context can hold);
* **sizes**: ``*`` and ``**`` whose result would exceed the output bound, ``%``
  formatting and any call or filter given an integer beyond it (``"x" * 10**9``,
  ``"x".center(10**9)``, ``"%*s" % (10**9, x)``), and a ``str.format`` field width of
  seven digits or more, are refused before they run; ``range`` is bounded by the output
  bound too.

Templates compile once per text (cached); each render has its own budget, so renders on
several threads at once are safe.

Owns: rendering a chat template. Must not touch: tokenizing (the tokenizer's).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import Any

MAX_STEPS = 1_000_000  # loop iterations a render may take in all (a second or so)
_WIDE = re.compile(r"\{[^{}]*:[^{}]*\d{7}")  # a format field of width >= 1,000,000


class TemplateLimit(ValueError):
    """A chat template's render went beyond its bounds (see the module docstring)."""


class _Budget:
    def __init__(self, limit: int) -> None:
        self.steps, self.limit = MAX_STEPS, limit

    def iterate(self, items: Iterable[Any]) -> Iterator[Any]:
        for item in items:
            self.steps -= 1
            if self.steps < 0:
                raise TemplateLimit(f"the chat template took over {MAX_STEPS:,} loop steps")
            yield item

    def check_int(self, *values: Any) -> None:
        for v in values:
            if type(v) is int and abs(v) > self.limit:
                raise TemplateLimit(f"the chat template used a size of {v:,}, beyond the "
                                    f"{self.limit:,} characters its output may take")  # fmt: skip


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):  # every loop draws on the budget
                budget = nodes.Name("_radixkv_budget", "load")
                fn = nodes.Getattr(budget, "iterate", "load")
                loop.iter = nodes.Call(fn, [loop.iter], [], None, None)
            return tree

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget: _Budget = context["_radixkv_budget"]
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int:
                        budget.check_int(len(seq) * n)
            elif operator == "**":
                if isinstance(right, (int, float)) and right > 4096:
                    raise TemplateLimit(f"the chat template raised a number to the {right:,}")
            elif operator == "%" and isinstance(left, str):
                budget.check_int(*(right if isinstance(right, tuple) else (right,)))
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget: _Budget | None = __context.get("_radixkv_budget")
            if budget is not None:
                budget.check_int(*args, *kwargs.values())
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value: Any) -> Any:  # str.format, str.format_map
            f_self = getattr(value, "__self__", None)
            if isinstance(f_self, str) and _WIDE.search(f_self):
                raise TemplateLimit("the chat template formats a field a million wide")
            return super().wrap_str_format(value)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    for name, fn in list(env.filters.items()):  # a filter's size arguments are bounded too
        env.filters[name] = _bounded_filter(fn)
    return env.from_string(source)


def _bounded_filter(fn: Any) -> Any:
    from jinja2.utils import pass_context

    if getattr(fn, "jinja_pass_arg", None) is not None:  # passes its own context, env...
        return fn

    @pass_context
    @functools.wraps(fn)
    def bounded(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget: _Budget | None = context.get("_radixkv_budget")
        if budget is not None:
            budget.check_int(*args, *kwargs.values())
        return fn(value, *args, **kwargs)

    return bounded


def raise_exception(message: str) -> None:
    """What transformers gives templates to refuse a conversation."""
    raise ValueError(message)


def render(source: str, limit: int, **context: Any) -> str:
    """``source`` rendered with ``context`` (plus ``raise_exception``), at most ``limit``
    characters of output and `MAX_STEPS` loop steps.

    Raises:
        TemplateLimit: a bound was exceeded. ValueError: the template refused the
            conversation (``raise_exception``), or failed to render (Jinja's errors).
    """
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    budget = _Budget(limit)
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
    return "".join(pieces)


def output_limit(messages: list[dict[str, Any]]) -> int:
    """How many characters a render of ``messages`` may take: twice their text, 256 a
    message (a template's markers), and 1 MiB."""
    text = sum(len(m.get("content") or "") for m in messages if isinstance(m, dict))
    return 2 * text + 256 * len(messages) + (1 << 20)


__all__ = ["MAX_STEPS", "TemplateLimit", "output_limit", "render"]
