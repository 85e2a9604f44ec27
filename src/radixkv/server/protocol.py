"""OpenAI request bodies (the fields radixkv honours) and the error body.

Every field of OpenAI's request types is either honoured or refused with a 400 naming it
(`REFUSED`: structured output, the deprecated functions, audio, ...;
``tests/server/test_server_fields.py`` walks them all). ``user`` is accepted as OpenAI's
end-user id, which changes no output. Fields OpenAI does not define are ignored, as
OpenAI-compatible servers do (``ignore_eos``, ``cache_salt`` and ``repetition_penalty`` are
vLLM's and honoured). Tools: `radixkv.server.chat`.

Owns: the request schemas and the refused fields. Must not touch: running requests.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixkv.web.errors import ApiError as ApiError  # re-exported: the server's errors

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_N = 128  # OpenAI's limit on choices
MAX_LOGIT_BIAS = 300  # tokens a logit_bias may name: each one costs every decode step
MAX_TOP_LOGPROBS = 20  # OpenAI's (chat); completions' logprobs take the same range here
MAX_CACHE_KEY = 1024  # characters of a prompt_cache_key
# messages and content parts a chat request may hold in all (a string content is one):
# 100k parts took 1.0-1.2 s to validate and refuse, stalling /health up to 0.74 s
MAX_CONTENT_PARTS = 8192
# OpenAI fields radixkv does not implement, with the values that ask for nothing and so
# are accepted (a client library's explicit default)
REFUSED: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
    "metadata": ({},),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "safety_identifier": (),
    "moderation": (),
    "echo": (False,),
    "best_of": (1,),
    "suffix": (),
}


# OpenAI's prompt caching (radixkv.kvcache.retention keeps a retained prefix for its lifetime)
TTL_SECONDS = {"30m": 1800.0, "12h": 43200.0, "24h": 86400.0}
MAX_BREAKPOINTS = 4  # explicit breakpoints a request may write (OpenAI's limit)


class PromptCacheOptions(BaseModel):
    """``prompt_cache_options``: ``mode`` implicit (cache as always, and retain the
    prompt) or explicit (cache only up to the last breakpoint); ``ttl`` how long."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m"] = "30m"


class PromptCacheBreakpoint(BaseModel):
    """A content block's ``prompt_cache_breakpoint``: retain the prefix ending with it."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI's prompt caching: requests sharing a key should reach the same cache (the
    # router keeps them on one worker; counted here); retention and explicit caching
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # refused unless a value in REFUSED (checked by the server)
    response_format: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    moderation: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    def refused_field(self) -> str | None:
        """The first OpenAI field set to something radixkv does not implement."""
        for name, fine in REFUSED.items():
            value = getattr(self, name)
            if value is not None and value not in fine:
                return name
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None  # top alternatives per token (0: the chosen one's only)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class FunctionDef(BaseModel):
    """A tool's function: ``parameters`` a JSON Schema (`radixkv.server.chat` checks it)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Any = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content or ())


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
