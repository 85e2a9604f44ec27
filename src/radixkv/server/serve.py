"""``radixkv serve``: build the engine, serve the app with uvicorn, shut down cleanly.

On SIGINT or SIGTERM the server stops accepting connections, aborts every request in
flight (streams end with finish reason ``abort``, their KV is freed), stops the engine
loop and exits 0.

When the engine itself fails (`radixkv.engine.engine.EngineFault`, or any exception out
of a step: a request's own failure never gets there), the requests in flight get 503,
``/health`` answers 503 with the reason for ``FAULT_LINGER_S`` (a router or a supervisor
polling it learns why), and then the server stops and ``radixkv serve`` exits 1: a
supervisor restarts it, rather than it lingering as a 503 forever.

Owns: building and shutting down a server. Must not touch: request handling.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.web.access import Access
from radixkv.web.serving import uvicorn_server


class BuiltServer(NamedTuple):
    """The uvicorn server and the engine loop it serves (`build_server`)."""

    server: Any
    engine: AsyncEngine


log = logging.getLogger("radixkv.serve")
FAULT_LINGER_S = 2.0  # /health tells why the engine failed this long before the exit


@dataclass
class ServeConfig:
    """Where and how to serve."""

    model: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_queue: int = 1024
    log_level: str = "warning"
    kv_events: str | None = None  # PUB endpoint for KV events
    kv_events_replay: str | None = None  # ROUTER endpoint (default: the next port)
    access: Access | None = None  # keys, hosts, body limit (default: Access.for_bind(host))
    kv_events_key: str | None = None  # keys the namespace tags on the wire
    kv_events_tokens: bool = True  # False: block hashes only (radixkv.events)
    tool_call_parser: str = "auto"  # radixkv.server.tools: a parser, auto or none


def served_name(engine: Engine, model: str) -> str:
    """The model id clients send: the loaded model, not the word that picked it."""
    if engine.model_name.startswith("SmolLM2"):
        return "SmolLM2-135M-Instruct"
    if engine.model_name.startswith("tiny random"):
        return "random"
    return Path(model).name or model


def build_server(serve: ServeConfig, engine_config: EngineConfig) -> BuiltServer:
    """A uvicorn server (not yet running) and its engine loop."""
    from radixkv.server.app import build_app

    publisher = None
    if serve.kv_events:
        from radixkv.events import ZmqEventPublisher, replay_endpoint

        replay = serve.kv_events_replay or replay_endpoint(serve.kv_events)
        publisher = ZmqEventPublisher(serve.kv_events, replay)

    def build() -> Engine:
        engine = Engine(serve.model, engine_config)
        if publisher is not None:
            key = serve.kv_events_key.encode() if serve.kv_events_key else None
            # the publisher's thread encodes, so the step hands over arrays, not lists
            engine.publish_kv_events(publisher.publish, key, serve.kv_events_tokens, arrays=True)
        return engine

    server: Any = None

    def died(error: BaseException) -> None:  # on the engine's thread
        log.error("the engine failed (%r): the server exits in %s s", error, FAULT_LINGER_S)

        def stop() -> None:
            if server is not None:
                server.should_exit = True  # uvicorn's main loop polls it

        timer = threading.Timer(FAULT_LINGER_S, stop)
        timer.daemon = True
        timer.start()

    aeng = AsyncEngine(build, serve.max_queue, on_death=died)
    aeng.start()  # builds the engine on its own thread (see AsyncEngine)
    name = serve.served_model_name or served_name(aeng.engine, serve.model)
    app = build_app(aeng, name, access=serve.access or Access.for_bind(serve.host),
                    tool_parser=serve.tool_call_parser)  # fmt: skip

    def abort_in_flight() -> None:
        if aeng.alive:  # end the streams now, so open connections close at once
            aeng.abort_all()

    server = uvicorn_server(app, serve.host, serve.port, serve.log_level, abort_in_flight)
    return BuiltServer(server, aeng)


def engine_failure(aeng: AsyncEngine) -> BaseException | None:
    """What made the engine fail, if it did (a stop is not a failure)."""
    from radixkv.engine.async_engine import EngineDead

    return None if aeng.error is None or isinstance(aeng.error, EngineDead) else aeng.error
