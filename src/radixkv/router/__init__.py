"""Cache-aware routing over many replicas: a global index fed by KV events, and the
``radixkv route`` proxy (needs the ``serve`` extra and pyzmq).

Owns: nothing but the package. Must not touch: the server (the router imports no server
module)."""
