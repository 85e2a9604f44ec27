"""The fleet at run time: list, add and remove workers (``/workers``). Admin paths: with
an admin key only the router's ``--admin-key`` reaches them, and without one nobody
(`radixkv.web.access`), so the fleet cannot be changed by a client.

Owns: the ``/workers`` endpoints. Must not touch: forwarding (`radixkv.router.proxy`) or
the fleet's bookkeeping (`radixkv.router.fleet`: adding checks a worker as start-up does).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixkv.router.fleet import Router, Worker, WorkerSpec, check_workers, read_card
from radixkv.web.errors import ApiError

ADMIN_PATHS = ("/workers",)  # changing the fleet: the router's --admin-key only
CHECK_TIMEOUT_S = 5.0  # a new worker's card and check answer within this


def describe(w: Worker) -> dict[str, Any]:
    return {"id": w.id, "url": w.url, "events": w.spec.events, "alive": w.alive,
            "healthy": w.healthy, "breaker": w.breaker.state}


def _refuse(status: int, message: str, code: str | None = None) -> ApiError:
    return ApiError(status, message, code=code, kind="router_error")


async def _spec(request: Request) -> WorkerSpec:
    """The worker a ``POST /workers`` body names."""
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise _refuse(400, f"the body is not valid JSON: {e}") from None
    url = body.get("url") if isinstance(body, dict) else None
    events = body.get("events") if isinstance(body, dict) else None
    if not isinstance(url, str) or not (events is None or isinstance(events, str)):
        raise _refuse(400, 'send {"url": "http://HOST:PORT", "events": "tcp://HOST:PORT"} '
                      "(events optional)", "invalid_worker")  # fmt: skip
    try:
        return WorkerSpec.parse(url if events is None else f"{url},{events}")
    except ValueError as e:
        raise _refuse(400, str(e), "invalid_worker") from None


def fleet_routes(router: Router, client: httpx.AsyncClient) -> APIRouter:
    """``GET /workers``, ``POST /workers`` (checked as start-up checks the fleet: the same
    model, tokenizer and block size) and ``DELETE /workers/{id}`` (never the last one)."""
    api = APIRouter()

    @api.get("/workers")
    async def list_workers() -> dict:
        return {"workers": [describe(w) for w in router.workers]}

    @api.post("/workers")
    async def add_worker(request: Request) -> Response:
        spec = await _spec(request)
        if router.find(spec.url) is not None:
            raise _refuse(409, f"the router already has the worker {spec.url}", "worker_exists")
        others = [w.spec for w in router.workers]
        headers = router.worker_headers
        card = await read_card(client, spec, CHECK_TIMEOUT_S)
        problems = await asyncio.to_thread(  # (the card's own fields first: card_problems)
            check_workers, [*others, spec], router.tokenizer, CHECK_TIMEOUT_S, headers,
            {**router.cards, spec.url: card},
        )  # fmt: skip
        if problems:
            raise _refuse(400, "; ".join(problems), "worker_mismatch")
        try:
            w = router.add_worker(spec, card=card)
        except ValueError as e:  # added meanwhile by another request
            raise _refuse(409, str(e), "worker_exists") from None
        return JSONResponse(describe(w), status_code=201)

    @api.delete("/workers/{worker_id:path}")
    async def remove_worker(worker_id: str) -> Response:
        w = router.find(worker_id)
        if w is None:
            raise _refuse(404, f"no worker {worker_id!r}: GET /workers lists them", "no_worker")
        if len(router.workers) == 1:
            raise _refuse(409, "that is the last worker: add another first", "last_worker")
        await asyncio.to_thread(router.remove_worker, w)
        return JSONResponse(describe(w))

    return api
