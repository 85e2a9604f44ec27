"""What radixkv's HTTP servers share, below both `radixkv.server` and `radixkv.router`:
access rules (keys, hosts, body limits), the OpenAI error body, running uvicorn, and
starting a server in a child process (tests, benchmarks).

Owns: nothing but the package. Must not touch: the engine, the server's or the router's
logic."""
