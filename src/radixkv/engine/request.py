"""Requests as the engine sees them: sampling parameters, state, and what a step returns.

Owns: a request's sampling parameters and state, and what a step returns. Must not
touch: scheduling or caching."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.key import as_bool
from radixkv.kvcache.lifecycle import Req

# "error": the request failed alone (its logits went non-finite, or processing its token
# raised); its slots, states and locks were freed and the others went on
FINISH_REASONS = ("stop", "length", "abort", "error")
# a temperature below this samples greedily (vLLM's _SAMPLING_EPS): dividing the logits by
# one that rounds to 0 in float32 made every probability NaN and stopped the engine
SAMPLING_EPS = 1e-5
# repetition_penalty's range: it divides (multiplies) logits, so a tiny one turned them
# into inf; SGLang takes [0, 2], vLLM any value > 0
REPETITION_PENALTY_RANGE = (0.01, 2.0)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Attributes:
        max_new_tokens: generated tokens at most.
        temperature: 0 for greedy; otherwise softmax sampling at this temperature (one
            below `SAMPLING_EPS` is greedy).
        top_p: nucleus sampling mass, in (0, 1].
        seed: seeds this request's sampler (same seed, same tokens); ``None``: unseeded.
        stop: strings that end the output (not included in the text).
        ignore_eos: keep generating past the end-of-sequence token.
        presence_penalty: subtracted from the logit of every token the output holds
            (OpenAI's; in [-2, 2]).
        frequency_penalty: subtracted once per occurrence in the output (in [-2, 2]).
        repetition_penalty: divides the positive logits (multiplies the negative ones)
            of every token in the prompt or output (vLLM's and Hugging Face's; in
            `REPETITION_PENALTY_RANGE`).
        logit_bias: ``(token id, bias)`` pairs added to the logits (bias in [-100, 100]).
        logprobs: report each output token's log-probability and this many of the most
            likely alternatives (``None``: none; 0: the chosen token's only). They are
            of the distribution after penalties and bias, before temperature and top-p.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {n!r}")
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        as_bool(self.ignore_eos, "ignore_eos")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo}, {hi}], got "
                             f"{self.repetition_penalty}")  # fmt: skip
        bias = tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items())
        if any(t < 0 or not -100 <= b <= 100 for t, b in bias):
            raise ValueError("logit_bias takes token ids >= 0 and biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        lp = self.logprobs
        bad = isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 20
        if lp is not None and bad:
            raise ValueError(f"logprobs must be an int in [0, 20], got {lp!r}")

    @property
    def greedy(self) -> bool:
        """Whether it takes the most likely token (a temperature below `SAMPLING_EPS`)."""
        return self.temperature < SAMPLING_EPS

    @property
    def shapes_logits(self) -> bool:
        """True when a penalty or a bias changes the logits before sampling."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias
        )  # fmt: skip


class MarkedIds(list):
    """Token ids with ``boundaries``: positions worth caching a prefix at (the end of a
    chat's system message), where a recurrent model writes a state checkpoint during
    the prefill (`radixkv.kvcache.recurrent`). A list, so it goes wherever ids go."""

    boundaries: tuple[int, ...] = ()

    def __init__(self, ids: Any = (), boundaries: tuple[int, ...] = ()) -> None:
        super().__init__(ids)
        self.boundaries = tuple(boundaries)


@dataclass(frozen=True)
class CacheSpec:
    """What a request asks of the prompt cache (OpenAI's prompt-caching fields, as
    `radixkv.server` reads them).

    Attributes:
        retain: (prompt position, seconds) pairs: keep the prefix up to that position
            cached at least that long after the request (`radixkv.kvcache.retention`); on a
            recurrent model each position is also a checkpoint boundary.
        limit: cache only the first ``limit`` tokens (``None``: all; OpenAI's
            ``mode: "explicit"``: up to the last breakpoint).
        read: False: match nothing (``explicit`` without a breakpoint: the request does
            not use the prompt cache).
    """

    retain: tuple[tuple[int, float], ...] = ()
    limit: int | None = None
    read: bool = True


@dataclass(frozen=True)
class SessionTag:
    """The agent session a request belongs to (``--eviction-policy session``:
    `radixkv.kvcache.sessions`); ``key`` None: the one whose last answer its prompt
    continues, found from the tree at admission (else a new one). ``called_tool(text,
    output_ids)``: whether a finished answer called a tool (the session comes back in
    seconds), else it ended its turn."""

    key: str | None
    called_tool: Callable[[str, list[int]], bool] | None = None


@dataclass(eq=False)
class EngineReq(Req):
    """A request with its sampling state, timings and decoded text."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    order: int = 0
    group: Any = None  # the request whose n choices this one is (None: on its own)
    session: SessionTag | None = None  # the agent session it belongs to
    arrival: float = 0.0
    arrived_step: int = 0  # the engine's step count when it was queued (its served log)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    prompt_cached: int = -1  # prompt tokens served from cache at first admission
    preemptions: int = 0
    prefetched: bool = False  # shared-store pages looked up
    text: str = ""  # the output's final text so far, stop string removed
    stop_cut: bool = False  # ``text`` was cut at a stop string: it is final
    stop_string: str | None = None  # the stop string it was cut at
    detok: Any = None  # its incremental detokenizer (radixkv.engine.output)
    searched: int = 0  # characters of ``text`` searched for stop strings
    sent_text: int = 0  # characters of ``text`` already handed out in step outputs
    sent_tokens: int = 0  # output tokens already handed out
    # per output token (with sampling.logprobs): (its logprob, [(token, logprob), ...])
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    retain: tuple[tuple[int, float], ...] = ()  # CacheSpec.retain
    cache_spec: bool = False  # it came with a CacheSpec: report cache_write_tokens
    error: str | None = None  # why it failed (finish reason "error")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.kv_len < len(self.input_ids)


@dataclass
class StepOutput:
    """What one step produced for one request.

    Attributes:
        rid: the request id.
        token_ids: output tokens new since the last output of this request.
        text: output text new since the last output (held back while it may still turn
            out to be part of a stop string or of an incomplete character).
        finish_reason: ``stop``, ``length`` or ``abort`` once finished, else ``None``.
        prompt_tokens, cached_tokens, output_tokens: counts so far.
        logprobs: with ``SamplingParams.logprobs``, one ``(logprob, top alternatives)``
            per token of ``token_ids``.
        cache_write_tokens: for a request with a `CacheSpec`, in its last output: prompt
            tokens it added to what the cache retains (its longest retained prefix less
            what it found cached).
        error: with finish reason ``error``: why the request failed (it failed alone;
            the engine goes on).
    """

    rid: Any
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cache_write_tokens: int | None = None  # with a CacheSpec, once finished: tokens retained
    error: str | None = None
    stop_string: str | None = None  # once finished by a stop string: which one

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
