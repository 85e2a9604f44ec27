"""`ApiError`: an error answered as an OpenAI error body, by the server and the router, or
as Anthropic's on its Messages API's paths (`shaped`: ``{"type": "error", "error":
{"type", "message"}}``, its error types by status, a full queue its 529
``overloaded_error``).

Owns: the error bodies' shapes. Must not touch: anything else (no FastAPI, no engine).
"""

from __future__ import annotations

from typing import Any


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


# Anthropic's error types by status (docs.claude.com: API errors)
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
                    529: "overloaded_error"}  # fmt: skip
ANTHROPIC_PATHS = ("/v1/messages",)  # (and /v1/messages/count_tokens)


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's API (its errors take Anthropic's shape)."""
    return path.startswith(ANTHROPIC_PATHS)


def shaped(e: ApiError, path: str) -> tuple[int, dict[str, Any]]:
    """The status and body ``e`` is answered with on ``path``: OpenAI's, or Anthropic's
    on its paths (a full queue, OpenAI's 503, as Anthropic's 529 ``overloaded_error``)."""
    if not is_anthropic(path):
        return e.status, e.body()
    status = 529 if e.code == "queue_full" else e.status
    kind = ANTHROPIC_ERRORS.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": e.message}}


__all__ = ["ANTHROPIC_ERRORS", "ApiError", "is_anthropic", "shaped"]
