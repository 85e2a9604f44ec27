"""Requests of the OpenAI API, checked and turned into token ids (`Api`): validation
with one clear error naming the field, chat templates and prompts off the event loop,
sampling parameters, ``n`` choices started together, usage and logprobs in OpenAI's
shapes.

``usage.prompt_tokens_details.cached_tokens`` is the number of prompt tokens served from
the prefix cache. A request's ``cache_salt`` becomes its cache namespace: requests with
different salts never share a cached token (unsalted ones share only with each other).

Owns: request validation, prompts' token ids, sampling and usage. Must not touch: the
engine's internals (it talks to `AsyncEngine`; tokenizing off the loop uses only what
`radixkv.engine.engine` states thread-safe), HTTP routing (`radixkv.server.routes`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from radixkv.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    QueueFull,
    RequestFailed,
)
from radixkv.engine.output import choice_sampling, usage
from radixkv.engine.request import CacheSpec, MarkedIds, SamplingParams, SessionTag, StepOutput
from radixkv.engine.scheduler import DoesNotFit
from radixkv.server import chat, prompt_cache
from radixkv.server.chat import NO_TOOLS, ToolPlan
from radixkv.server.metrics import ServerMetrics
from radixkv.server.protocol import (
    MAX_CACHE_KEY,
    MAX_CONTENT_PARTS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
)
from radixkv.server.tools import Parser, make_parser, parser_for
from radixkv.tokenizer import NoToolTemplate, special_token_id, supports_tools

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # when the request names none
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a token id, as ASCII digits
RETRY_AFTER_S = 1


class Prompt(NamedTuple):
    """A request's prompt: its token ids, what it asks of the prompt cache (if anything),
    and what its answer does with tool calls."""

    ids: list[int]
    cache: CacheSpec | None
    tools: ToolPlan = NO_TOOLS


def _validation_error(e: ValidationError) -> ApiError:
    """The deepest of pydantic's errors (a union tries each branch: the one that got
    furthest says what is wrong), its location without branch labels (``str``,
    ``list[ContentPart]``); ``param`` the top-level field."""
    errors = e.errors()

    def where(err: Any) -> list[str]:
        return [str(x) for x in err.get("loc", ()) if not _BRANCH.fullmatch(str(x))]

    err = max(errors, key=lambda x: len(where(x)))
    loc = where(err)
    param = loc[0] if loc else None
    return ApiError(400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}", param)


# pydantic's location labels for a union's branches and validators, not fields
_BRANCH = re.compile(r"function-.*|str|int|float|bool|list\[.*\]|dict\[.*\]|[A-Z]\w*")


def parse_body(body: bytes, model: type[BaseModel]) -> Any:
    try:
        data = json.loads(body)
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    messages = data.get("messages")
    if isinstance(messages, list):  # counted before validating them one by one
        parts = sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"),
                    list) else 1 for m in messages)  # fmt: skip
        if parts > MAX_CONTENT_PARTS:
            raise ApiError(400, f"messages: {parts:,} messages and content parts, more than "
                           f"the {MAX_CONTENT_PARTS:,} a request may hold", "messages")  # fmt: skip
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise _validation_error(e) from None


class Api:
    """The request handling, separate from the routes so it reads top to bottom."""

    def __init__(self, aeng: AsyncEngine, model_name: str, tool_parser: str = "auto") -> None:
        """``tool_parser``: a name of `radixkv.server.tools.PARSERS`, ``auto`` (the one the
        chat template writes calls for, if any) or ``none``."""
        self.aeng, self.engine, self.model_name = aeng, aeng.engine, model_name
        self.metrics = ServerMetrics(aeng.engine, model_name)
        self.created = int(time.time())
        tk = aeng.engine.tokenizer
        name = parser_for(getattr(tk, "chat_template", None)) if tool_parser == "auto" else (
            None if tool_parser == "none" else tool_parser)  # fmt: skip
        self.tool_parser: Parser | None = make_parser(name) if name else None
        marker = self.tool_parser.marker if self.tool_parser else ""
        # a marker the tokenizer holds as one special token: decoding drops it, so the
        # output's text gets it back where its id was (`marked`)
        self.marker_id = special_token_id(tk, marker) if marker else None

    # --- validation -------------------------------------------------------------------------
    def check_common(self, req: Any) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist; this server serves `{self.model_name}`.",
                "model",
                "model_not_found",
            )
        refused = req.refused_field()
        if refused is not None:
            raise ApiError(400, f"{refused} is not supported by this server", refused,
                           "unsupported_parameter")  # fmt: skip
        if not 1 <= req.n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got {req.n}", "n")
        if req.n > self.aeng.max_queue:  # its choices wait as n requests: they never fit
            raise ApiError(400, f"n must be at most {self.aeng.max_queue} on this server "
                           f"(--max-queue), got {req.n}", "n")  # fmt: skip
        if not 0 <= req.temperature <= 2:
            raise ApiError(400, f"temperature must be in [0, 2], got {req.temperature}",
                           "temperature")  # fmt: skip
        if not 0 < req.top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {req.top_p}", "top_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(req, name) <= 2:
                raise ApiError(400, f"{name} must be in [-2, 2], got {getattr(req, name)}", name)
        if not req.repetition_penalty > 0:
            raise ApiError(400, f"repetition_penalty must be > 0, got {req.repetition_penalty}",
                           "repetition_penalty")  # fmt: skip
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise ApiError(400, f"seed must be in [-2**63, 2**64), got {req.seed}", "seed")
        vocab = self.engine.config.vocab_size
        if len(req.logit_bias or ()) > MAX_LOGIT_BIAS:  # each entry costs every step
            raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens",
                           "logit_bias")  # fmt: skip
        for token, bias in (req.logit_bias or {}).items():
            # ASCII digits only, and few of them: "²" is a digit to str.isdigit but not to
            # int(), and int() of a 5,000-digit key raises (both used to answer 500)
            if not (_TOKEN_ID.fullmatch(token) and int(token) < vocab) or not -100 <= bias <= 100:
                raise ApiError(400, f"logit_bias maps token ids in [0, {vocab}) to biases in "
                               f"[-100, 100]; got {token!r}: {bias}", "logit_bias")  # fmt: skip
        if req.cache_salt is not None and not req.cache_salt:
            raise ApiError(400, "cache_salt must be a non-empty string", "cache_salt")
        key = req.prompt_cache_key
        if key is not None and not 0 < len(key) <= MAX_CACHE_KEY:
            raise ApiError(400, f"prompt_cache_key must be 1 to {MAX_CACHE_KEY} characters",
                           "prompt_cache_key")  # fmt: skip
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ApiError(400, f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", "stop")

    @staticmethod
    def logprobs_count(req: Any) -> int | None:
        """Top alternatives per token to report (``None``: no logprobs)."""
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            n = (req.top_logprobs or 0) if req.logprobs else None
            name = "top_logprobs"
        else:
            n, name = req.logprobs, "logprobs"
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {n}", name)
        return n

    def sampling(self, req: Any, ids: list[int], max_tokens: int | None, kind: str) -> Any:
        limit = self.engine.scheduler.max_tokens()  # read-only: safe off the engine thread
        if max_tokens is None:  # the default, shortened to what fits
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS[kind], limit - len(ids)))
        self.fits(ids, max_tokens)
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            return SamplingParams(
                max_tokens, req.temperature, req.top_p, req.seed, stop, req.ignore_eos,
                req.presence_penalty, req.frequency_penalty, req.repetition_penalty,
                tuple((int(t), b) for t, b in (req.logit_bias or {}).items()),
                self.logprobs_count(req),
            )  # fmt: skip
        except ValueError as e:
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None

    def fits(self, ids: list[int], max_tokens: int, prompt_param: str = "prompt") -> None:
        """``max_tokens`` is at least 1 and fits after the prompt in the context.

        Raises:
            ApiError: (400) either does not.
        """
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        try:
            self.engine.scheduler.check_fits(len(ids), max_tokens)
        except DoesNotFit as e:
            raise ApiError(
                400,
                f"This model's maximum context length is {e.limit} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                f"{max_tokens} for the completion).",
                "max_tokens" if len(ids) < e.limit else prompt_param,
                "context_length_exceeded",
            ) from None

    def _encode(self, prompt: Any, chat: bool, tools: list[dict] | None = None,
                param: str | None = None) -> list[int]:  # fmt: skip
        param = param or ("messages" if chat else "prompt")
        if isinstance(prompt, str) or chat:
            texts = [prompt] if isinstance(prompt, str) else [
                m["content"] or "" for m in prompt]  # fmt: skip
            per_token = getattr(self.engine.tokenizer, "max_token_chars", None)
            limit = self.engine.scheduler.max_tokens()
            # a prompt's tokens cover at most per_token characters each, so this many
            # characters cannot fit: refuse before tokenizing
            if per_token and sum(map(len, texts)) > limit * per_token:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens; the prompt "
                    f"has over {limit} tokens.",
                    param,
                    "context_length_exceeded",
                )
        try:
            ids = self.engine.encode(prompt, chat, tools) if tools else self.engine.encode(
                prompt, chat)  # fmt: skip
        except NoToolTemplate as e:
            raise ApiError(400, f"tools: {e}", "tools") from None
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param) from None
        if not ids:
            raise ApiError(400, "the prompt is empty", param)
        return ids

    def completion_ids(self, req: CompletionRequest) -> Prompt:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "a batch of prompts is not supported: send one", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        ids = self._encode(prompt, chat=False)
        return Prompt(ids, prompt_cache.cache_spec(req, len(ids), []))

    def chat_ids(self, req: ChatCompletionRequest) -> Prompt:
        if not req.messages:
            raise ApiError(400, "messages must not be empty", "messages")
        messages, tools, plan = chat.openai_chat(req, self.tool_parser)
        cuts = prompt_cache.breakpoints(req)  # refuses too many before rendering
        ids = self.chat_encode(messages, tools, plan)
        marks = prompt_cache.positions(self.engine, req, messages, ids, cuts, tools)
        return Prompt(ids, prompt_cache.cache_spec(req, len(ids), marks), plan)

    def chat_encode(self, messages: list[dict], tools: list[dict] | None, plan: ToolPlan,
                    param: str = "messages", prefill: str = "") -> list[int]:  # fmt: skip
        """The rendered chat's ids, then the answer's given start (``prefill``) and the
        opening a forced tool call starts with."""
        if not supports_tools(self.engine.tokenizer):
            for i, m in enumerate(messages):
                if m.get("tool_calls") or m["role"] == "tool":
                    raise ApiError(400, f"{param}[{i}]: this model's chat template does not "
                                   "render tool calls or tool results", param)  # fmt: skip
        ids = self._encode(messages, chat=True, tools=tools, param=param)
        if prefill or plan.opening:  # (tool_choice required or named: a call)
            tk = self.engine.tokenizer
            plain = getattr(tk, "encode_plain", tk.encode)  # (no BOS in mid-prompt)
            more = list(ids) + plain(prefill + plan.opening)
            ids = MarkedIds(more, ids.boundaries) if isinstance(ids, MarkedIds) else more
        return ids

    def session(self, key: str | None, salt: str | None, plan: ToolPlan) -> SessionTag | None:
        """The agent session a request names (``key``; within its tenant's ``salt``; none:
        the engine finds it from the tree), and how its answer's tool call is recognised
        (``plan``'s parser; no tools: none)."""
        parser, marker_id = plan.parser, self.marker_id

        def called_tool(text: str, ids: list[int]) -> bool:
            if marker_id is not None and marker_id in ids:
                return True
            return bool(parser.parse(plan.opening + text).calls)  # type: ignore[union-attr]

        named = f"{salt or ''}\0{key}"[:2048] if key else None
        return SessionTag(named, called_tool if parser else None)

    def marked(self, ids: list[int], text: str) -> str:
        """A step's output text with the parser's marker where its special token was (the
        step's first token, as decoding steps are one token each)."""
        if self.marker_id is not None and self.marker_id in ids and self.tool_parser:
            return self.tool_parser.marker + text
        return text

    @staticmethod
    def stream_end(plan: ToolPlan, stream: Any) -> tuple[str | None, list]:
        """A streamed answer's end: the text still held and its calls (calls
        `ToolPlan.accepts` refuses go out as text)."""
        rest, calls = stream.end(plan.accepts)
        return rest, calls[:1] if plan.single else calls

    def parse_calls(self, plan: ToolPlan, ids: list[int], text: str) -> tuple[str | None, list]:
        """A finished answer's text and tool calls (a marker token's text restored)."""
        if plan.parser is None:
            return text, []
        if self.marker_id is not None and self.marker_id in ids:
            at = ids.index(self.marker_id)
            text = self.engine.tokenizer.decode(ids[:at]) + plan.parser.marker + (
                self.engine.tokenizer.decode(ids[at + 1 :]))  # fmt: skip
        content, calls = plan.parser.parse(plan.opening + text)
        if not calls or not plan.accepts(calls):
            return text, []
        return content, calls[:1] if plan.single else calls

    # --- running ----------------------------------------------------------------------------
    async def first(self, outputs: AsyncIterator[StepOutput]) -> StepOutput:
        """A request's first output: a refusal becomes an HTTP error here, before any
        response starts."""
        try:
            return await anext(outputs)
        except QueueFull as e:
            raise ApiError(
                503,
                f"the server is busy ({e}); retry later",
                code="queue_full",
                kind="server_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except (EngineDead, RequestFailed) as e:
            raise failure(e) from None
        except DoesNotFit as e:
            raise ApiError(400, str(e), "max_tokens", "context_length_exceeded") from None
        except ValueError as e:  # the engine refused the request: no one field to name
            raise ApiError(400, str(e)) from None

    async def timed(
        self, outputs: AsyncIterator[StepOutput], arrival: float
    ) -> AsyncIterator[StepOutput]:
        """Pass outputs through, observing TTFT, inter-token and end-to-end latency."""
        last = None
        async with aclosing(outputs):
            async for out in outputs:
                now = time.perf_counter()
                if out.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                if out.finished:
                    self.metrics.e2e.observe(now - arrival)
                yield out

    async def start_all(
        self,
        ids: list[int],
        sampling: SamplingParams,
        n: int,
        salt: str | None,
        arrival: float,
        cache: CacheSpec | None = None,
        session: SessionTag | None = None,
    ) -> list[tuple[StepOutput | None, AsyncIterator[StepOutput]]]:
        """Submit the ``n`` choices as one group (choice ``i`` seeded ``seed + i``; they
        share the prompt's KV through the cache; they count as ``n`` against the queue,
        and hold at most their share of the running slots) and wait for the first
        choice's first output. The group is taken or refused as a whole (a refusal is
        every choice's first item), so that one output decides the response's status;
        the other choices may still wait for a slot (a group holds at most its share),
        and waiting for theirs too held a stream's first token back until the first
        choices had finished. A refusal aborts them all. Returns (first output or None,
        the rest) per choice."""
        samplings: list[SamplingParams | None] = [choice_sampling(sampling, i) for i in range(n)]
        submitted = await self.aeng.submit_choices(ids, samplings, salt, chat=False, cache=cache,
                                                   session=session)  # fmt: skip
        outputs = [self.timed(o, arrival) for o in submitted]
        try:
            first = await self.first(outputs[0])
        except BaseException:
            for o in outputs:
                await o.aclose()  # type: ignore[attr-defined]
            raise
        return [(first, outputs[0])] + [(None, o) for o in outputs[1:]]

    @staticmethod
    def usage(lasts: list[StepOutput]) -> dict[str, Any]:
        """The prompt counted once (the choices share it), every choice's completion."""
        return usage(lasts)

    # --- logprobs in OpenAI's two shapes ----------------------------------------------------
    def _token(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def completion_logprobs(self, ids: list[int], lps: list, offset: int) -> dict | None:
        """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""
        tokens = [self._token(t) for t in ids]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{self._token(t): v for t, v in alts} for _, alts in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, ids: list[int], lps: list) -> dict:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}``."""

        def entry(token: int, lp: float) -> dict:
            text = self._token(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = [
            {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in alts]}
            for t, (lp, alts) in zip(ids, lps, strict=True)
        ]
        return {"content": content, "refusal": None}


def failure(e: EngineDead | RequestFailed) -> ApiError:
    """What a request that failed after it was taken answers: 500 when it failed alone
    (the engine goes on), 503 when the engine is not running."""
    if isinstance(e, RequestFailed):
        return ApiError(500, f"the request failed: {e}", code="request_failed",
                        kind="server_error")  # fmt: skip
    return ApiError(503, str(e), code="engine_dead", kind="server_error")
