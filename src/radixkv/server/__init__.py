"""The OpenAI-compatible HTTP server (``radixkv serve``), its metrics and ``bench-serve``.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus_client, httpx).

Owns: nothing but the package. Must not touch: the router, the load generator."""
