"""What a step's sampled tokens become for the caller: text, stop decisions and outputs.

Owns: incremental detokenizing (`Detokenizer`: a few tokens' window decoded a step, so a
long output costs the same per token as a short one; the text streamed adds up to the
whole output decoded at once), stop conditions (end of sequence, stop strings searched
only where new text could complete one, the token budget), the outputs a step hands out
(text held back while it may still be the start of a stop string), and the usage of
``n`` choices that share one prompt. Must not touch: the KV cache, the scheduler, the
model (`radixkv.engine.engine` runs those and hands each sampled token here). Also the
result types an engine's callers read (`RequestOutput`, `RunStats`, `GenerateResult`,
`EngineCounters`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.engine.request import EngineReq, SamplingParams, StepOutput
from radixkv.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"  # what a decoder shows for the bytes of an unfinished character


@dataclass
class RequestOutput:
    """One request's result."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    finish_reason: str
    error: str | None = None  # with finish reason "error": why it failed


@dataclass
class RunStats:
    """One ``generate`` call, all requests together."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0  # tokens pushed through the model in prefill (recompute included)
    decode_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    wall_s: float = 0.0
    ttft_p50_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Cached ÷ prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput(self) -> float:
        """Prompt + generated tokens per second of wall time."""
        return (self.prompt_tokens + self.decode_tokens) / self.wall_s if self.wall_s else 0.0


@dataclass
class GenerateResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)


@dataclass
class EngineCounters:
    """Totals since the engine started (read by the server's metrics)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    steps: int = 0
    prefill_tokens: int = 0  # tokens pushed through the model in prefill


class Detokenizer:
    """Text of a growing list of token ids, decoding a window of a few tokens each time.

    Text is final once a window decodes without a trailing replacement character (the
    bytes of a multi-byte character may span tokens): the window then moves on, keeping
    the last final token as its left context (a SentencePiece decoder drops the space of
    a window's first token, so the same context must start both decodes it compares).
    `finish` hands out whatever is still pending, exactly as decoding the whole list
    would show it."""

    __slots__ = ("_ids", "_prefix", "_prefix_text", "_read", "_tk")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tk = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # tokens before this one are final text
        self._prefix_text = ""  # decode(ids[prefix:read])

    def push(self, token: int) -> str:
        """Add a token; returns the text that became final (often ``""``)."""
        self._ids.append(token)
        text = self._tk.decode(self._ids[self._prefix :])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            return ""
        new = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._tk.decode(self._ids[self._prefix : self._read])
        return new

    def finish(self) -> str:
        """The text not yet final (an unfinished character shows as decoding shows it)."""
        text = self._tk.decode(self._ids[self._prefix :])
        new = text[len(self._prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return new


class OutputProcessor:
    """Turns each request's sampled tokens into text and decides when it stops.

    Per request it keeps a `Detokenizer` and how far stop strings were searched, on the
    request itself (``r.detok``, ``r.searched``), so nothing here outlives a request."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id

    def append(self, r: EngineReq, token: int) -> str | None:
        """Record a sampled token; returns the finish reason it causes, if any:
        ``stop`` (end of sequence, unless ignored, or a stop string, whose text is cut
        off), ``length`` (the token budget), else ``None``."""
        s = r.sampling
        r.output_ids.append(token)
        if token == self.eos and not s.ignore_eos:
            self._settle(r)
            return "stop"
        if token != self.eos:
            if r.detok is None:
                r.detok = Detokenizer(self.tokenizer)
            r.text += r.detok.push(token)
        if s.stop and self._cut_at_stop(r):
            return "stop"
        if len(r.output_ids) >= s.max_new_tokens:
            self._settle(r)
            return "length"
        return None

    def _cut_at_stop(self, r: EngineReq) -> bool:
        """Search the text a new token could have completed a stop string in (from the
        longest stop string's length back before the last search); cut there."""
        longest = max(len(x) for x in r.sampling.stop)
        start = max(0, r.searched - longest + 1)
        text = r.text
        found = [(i, x) for x in r.sampling.stop if (i := text.find(x, start)) >= 0]
        r.searched = len(text)
        if not found:
            return False
        at, r.stop_string = min(found, key=lambda f: f[0])
        r.text, r.stop_cut = text[:at], True
        return True

    def _settle(self, r: EngineReq) -> None:
        """The request is done: the text still pending is final now."""
        if r.detok is not None and not r.stop_cut:
            r.text += r.detok.finish()

    def finish(self, r: EngineReq) -> None:
        """The request ended another way (aborted): settle its text."""
        self._settle(r)

    @staticmethod
    def output(r: EngineReq) -> StepOutput:
        """The request's news since its last output. While it runs, text is held back
        while it may still be the start of a stop string."""
        text = r.text
        if not r.finished:
            hold = max((len(x) for x in r.sampling.stop), default=1) - 1
            text = text[: max(len(text) - hold, r.sent_text)]
        new_text, r.sent_text = text[r.sent_text :], max(len(text), r.sent_text)
        sent = r.sent_tokens
        new_ids, r.sent_tokens = r.output_ids[sent:], len(r.output_ids)
        return StepOutput(
            r.rid,
            new_ids,
            new_text,
            r.finish_reason,
            len(r.input_ids),
            max(r.prompt_cached, 0),
            len(r.output_ids),
            r.output_logprobs[sent:] if r.sampling.logprobs is not None else None,
            error=r.error,
            stop_string=r.stop_string if r.finished else None,
        )


def choice_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """How choice ``i`` of ``n`` samples: seeded ``seed + i`` (choices of one seeded
    request differ, and each is reproducible); they share the prompt's KV."""
    return dataclasses.replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)


def usage(lasts: Sequence[StepOutput]) -> dict[str, Any]:
    """OpenAI's ``usage`` for ``n`` choices of one prompt (their last outputs): the prompt
    counted once (the choices share it), every choice's completion."""
    first = lasts[0]
    done = sum(out.output_tokens for out in lasts)
    details: dict[str, int] = {"cached_tokens": first.cached_tokens}
    written = [out.cache_write_tokens for out in lasts if out.cache_write_tokens is not None]
    if written:  # it asked for prompt caching (a CacheSpec): what it wrote
        details["cache_write_tokens"] = max(written)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": done,
        "total_tokens": first.prompt_tokens + done,
        "prompt_tokens_details": details,
    }


__all__ = ["Detokenizer", "EngineCounters", "GenerateResult", "OutputProcessor", "RequestOutput",
           "RunStats", "choice_sampling", "usage"]  # fmt: skip
