"""The engine: a real model over the prefix cache (model families, weights, tokenizers,
scheduler, model runner, output processing, the engine and its async loop).

Owns: running requests through a model. Must not touch: HTTP (`radixkv.server`), routing
(`radixkv.router`); it uses the cache, memory, events and storage below it."""
