"""The load generator (``radixkv bench-serve``): a client of OpenAI-compatible servers, kept
apart from the server package (``import radixkv.server`` does not import it).

Owns: nothing but the package. Must not touch: the server or the engine (it talks HTTP)."""
