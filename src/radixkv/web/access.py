"""Who may reach what on `radixkv serve` and `radixkv route`: an ASGI middleware in front of
the app.

Checked before the app reads a byte of the body, in this order:

* **Host**: while the server binds a loopback address, a request must name a loopback
  host (``127.0.0.1``, ``localhost``, ``[::1]``, any port): a web page that rebinds its
  own DNS name to 127.0.0.1 cannot reach the server through the victim's browser.
  ``--allowed-hosts`` replaces the list.
* **Keys** (vLLM's scheme): with an API key, every path but ``/health`` needs
  ``Authorization: Bearer KEY`` (compared in constant time); otherwise 401. Admin
  endpoints (``/flush_cache`` on a server, ``/workers`` and below on a router) need the
  admin key, always: without ``--admin-key`` they answer 403, so an open API never lets
  a stranger flush the cache or change the fleet.
* **Content type**: a POST to ``/v1/...`` must be ``application/json`` (415 otherwise).
  A browser sends a cross-origin ``text/plain`` POST without asking first; it cannot send
  JSON that way.
* **Size**: a body over ``max_request_bytes`` is refused with 413, by its
  ``Content-Length`` or as soon as that many bytes arrived.

Every refusal is an OpenAI error body.

Owns: the access rules. Must not touch: the apps behind it.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from radixkv.web.errors import ApiError, shaped

OPEN_PATHS = frozenset({"/health"})
ADMIN_PATHS = ("/flush_cache",)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


@dataclass
class Access:
    """The server's access rules.

    Attributes:
        api_key: the key every request but ``/health`` must carry (``None``: open).
        admin_key: the key admin endpoints need (``None``: they are refused).
        max_request_bytes: the largest request body accepted.
        allowed_hosts: host names a request's ``Host`` may name (``None``: any).
        admin_paths: paths that need the admin key, each with everything below it.
    """

    api_key: str | None = None
    admin_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allowed_hosts: tuple[str, ...] | None = None
    admin_paths: tuple[str, ...] = ADMIN_PATHS

    def is_admin(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.admin_paths)

    def __post_init__(self) -> None:
        for name in ("api_key", "admin_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string")
        n = self.max_request_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_request_bytes must be a positive int, got {n!r}")

    @classmethod
    def for_bind(cls, host: str, **kw: Any) -> Access:
        """The rules for a server bound to ``host``: loopback names only while it binds
        a loopback address (unless ``allowed_hosts`` is given)."""
        if kw.get("allowed_hosts") is None and (host in LOOPBACK_HOSTS or host.startswith("127.")):
            kw["allowed_hosts"] = (*LOOPBACK_HOSTS, host)
        return cls(**kw)


def _host_name(raw: str) -> str:
    raw = raw.strip().lower()
    if raw.startswith("["):  # [::1]:8000
        return raw[: raw.find("]") + 1] if "]" in raw else raw
    return raw.rsplit(":", 1)[0] if raw.count(":") == 1 else raw


def _bearer(headers: dict[bytes, bytes]) -> str | None:
    """The key sent as ``Authorization: Bearer KEY``, else as ``x-api-key`` (Anthropic's
    clients send that)."""
    value = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    key = headers.get(b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


def _key_matches(given: str | None, want: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), want.encode())


class AccessMiddleware:
    """Applies `Access` to every HTTP request (see the module docstring)."""

    def __init__(self, app: Any, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            receive = self._check(scope, receive)
        except ApiError as e:
            return await _answer(send, e, scope.get("path", ""))
        await self.app(scope, receive, send)

    def _check(self, scope: dict, receive: Any) -> Any:
        access = self.access
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if access.allowed_hosts is not None:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in access.allowed_hosts:
                raise ApiError(400, f"the Host header {host!r} is not allowed here", "Host",
                               "invalid_host")  # fmt: skip
        if access.is_admin(path):
            if access.admin_key is None:
                raise ApiError(403, f"{path} is an admin endpoint: start the server with "
                               "--admin-key to use it", code="admin_disabled",
                               kind="permission_error")  # fmt: skip
            if not _key_matches(_bearer(headers), access.admin_key):
                raise _unauthorized("the admin key")
        elif (
            path not in OPEN_PATHS
            and access.api_key is not None
            and not _key_matches(_bearer(headers), access.api_key)
        ):
            raise _unauthorized("an API key")
        if scope.get("method") == "POST" and path.startswith("/v1/"):
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                raise ApiError(415, "the body must be JSON: send Content-Type: "
                               "application/json", "Content-Type",
                               "unsupported_media_type")  # fmt: skip
        limit = access.max_request_bytes
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(limit)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _too_large(limit)
            return message

        return counted


def _unauthorized(what: str) -> ApiError:
    return ApiError(401, f"this server needs {what}: send Authorization: Bearer KEY (or "
                    "x-api-key: KEY)",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is over {limit} bytes (--max-request-bytes)",
                    code="request_too_large")  # fmt: skip


async def _answer(send: Any, e: ApiError, path: str) -> None:
    status, shape = shaped(e, path)
    body = json.dumps(shape).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (e.headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
