"""Simulation: traces replayed through the real cache (one cache, tiers, routed replicas).

Owns: nothing but the package. Must not touch: the server."""
