"""``radixkv serve``: build the engine, serve the app with uvicorn, shut down cleanly.

On SIGINT or SIGTERM the server stops accepting connections, aborts every request in
flight (streams end with finish reason ``abort``, their KV is freed), stops the engine
loop and exits 0.

Owns: building and shutting down a server. Must not touch: request handling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.web.access import Access
from radixkv.web.serving import uvicorn_server

log = logging.getLogger("radixkv.serve")


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


def served_name(engine: Engine, model: str) -> str:
    """The model id clients send: the loaded model, not the word that picked it."""
    if engine.model_name.startswith("SmolLM2"):
        return "SmolLM2-135M-Instruct"
    if engine.model_name.startswith("tiny random"):
        return "random"
    return Path(model).name or model


def build_server(serve: ServeConfig, engine_config: EngineConfig) -> tuple[Any, AsyncEngine]:
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

    aeng = AsyncEngine(build, serve.max_queue)
    aeng.start()  # builds the engine on its own thread (see AsyncEngine)
    name = serve.served_model_name or served_name(aeng.engine, serve.model)
    app = build_app(aeng, name, access=serve.access or Access.for_bind(serve.host))

    def abort_in_flight() -> None:
        if aeng.alive:  # end the streams now, so open connections close at once
            aeng.abort_all()

    return uvicorn_server(app, serve.host, serve.port, serve.log_level, abort_in_flight), aeng
