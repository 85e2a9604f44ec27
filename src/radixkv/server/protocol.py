"""OpenAI request bodies (the fields radixkv honours) and the error body.

Unknown fields are ignored, as OpenAI-compatible servers do; fields radixkv cannot honour
(``n > 1``, ``logprobs``, ``echo``, ``best_of``, tools) are refused with a 400 that says so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_STOP_STRINGS = 4  # OpenAI's limit


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind, self.headers = kind, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


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
    logprobs: Any = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
