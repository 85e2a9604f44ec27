"""Prometheus metrics under ``radixkv:`` (scraped at ``GET /metrics``).

Engine totals and gauges are read from the engine at scrape time (plain ints written by
the engine thread; a read is a snapshot). Latency histograms are observed by the HTTP
handlers, where a client sees them: time to first token from the request's arrival,
inter-token latency between streamed outputs, end-to-end latency to the last one.

Prefix-cache queries and hits mean what vLLM's ``prefix_cache_queries`` and
``prefix_cache_hits`` mean: prompt tokens looked up, and of them served from the cache
(counted once per request, at its first admission).

Owns: the server's Prometheus names. Must not touch: the engine (it reads counters at
scrape time).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixkv.engine.engine import Engine
from radixkv.engine.request import FINISH_REASONS
from radixkv.kvcache.retention import REASONS

# seconds; fine at the low end (a tiny model's steps are milliseconds)
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


# (family, name without the radixkv: prefix, help text, value)
Value = tuple[type, str, str, float]
FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}  # the parts' kinds


def _engine_values(e: Engine) -> list[Value]:
    """The engine's counters and the cache's sizes."""
    values: list[Value] = [
        (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the "
         "prefix cache (once per request, at first admission)", e.scheduler.queried_tokens),
        (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens served from the prefix "
         "cache", e.scheduler.hit_tokens),
        (CounterMetricFamily, "prompt_tokens", "Prompt tokens received",
         e.counters.prompt_tokens),
        (CounterMetricFamily, "generation_tokens", "Tokens generated",
         e.counters.generation_tokens),
        (CounterMetricFamily, "prefill_computed_tokens", "Prompt tokens computed by the "
         "model (recomputation after preemption included)", e.counters.prefill_tokens),
        (CounterMetricFamily, "evicted_tokens", "Cached tokens evicted from the KV pool",
         e.mgr.evicted_tokens),
        (CounterMetricFamily, "num_preemptions", "Requests preempted (KV freed, "
         "recomputed later)", e.scheduler.preemptions),
        (GaugeMetricFamily, "num_requests_running", "Requests admitted and running",
         e.num_running()),
        (GaugeMetricFamily, "num_requests_waiting", "Requests waiting for admission",
         e.num_waiting()),
        (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of the KV pool in use "
         "(running requests and cached prefixes)", e.kv_usage()),
        (GaugeMetricFamily, "prefix_cache_tokens", "Tokens held by the prefix cache",
         e.cache.total_size()),
        (GaugeMetricFamily, "prompt_cache_retained_tokens", "Tokens of prefixes retained "
         "on request (prompt_cache_options, prompt_cache_retention, breakpoints)",
         e.retention.total),
        (GaugeMetricFamily, "prompt_cache_retained_prefixes", "Prefixes retained on "
         "request", len(e.retention.pins)),
        (CounterMetricFamily, "prompt_cache_retain_refused", "Prefixes asked for but not "
         "retained (over the quota alone, or not cached)", e.retention.refused),
    ]  # fmt: skip
    if e.sessions is not None:  # --eviction-policy session (ints: safe off the engine thread)
        clock = e.sessions.clock
        values += [
            (GaugeMetricFamily, "agent_sessions_running", "Agent sessions with a request "
             "running", clock.running),
            (GaugeMetricFamily, "agent_sessions_waiting", "Agent sessions known, none of "
             "their requests running (a tool or a person away)",
             len(clock.sessions) - clock.running),
        ]  # fmt: skip
    full_bytes = e.cache.total_size() * e.kv.bytes_per_token()
    values.append((GaugeMetricFamily, "prefix_cache_kv_bytes", "Bytes of full-attention "
                   "KV held by the prefix cache", full_bytes))  # fmt: skip
    return values


def _layer_values(e: Engine) -> list[Value]:
    """The memory shape's (the one budget's size), and each layer type's own values
    (`LayerManager.metrics`)."""
    parts = [e.memory.shape.metrics()] + [m.metrics(e.cache) for m in e.mgr.managers]
    return [(FAMILIES[kind], name, text, value) for p in parts for kind, name, text, value in p]


def _tier_values(e: Engine) -> list[Value]:
    """The host tier and the shared store: full-attention pages and window pages."""
    values: list[Value] = [(FAMILIES[kind], name, text, value)  # each layer type's tiers
                           for t in e.layer_tiers for kind, name, text, value in t.metrics()]
    tier = e.tier
    if tier is not None:
        st = tier.stats
        values += [
            (CounterMetricFamily, "host_hit_tokens", "Prompt tokens loaded from the host "
             "tier (part of prefix_cache_hits)", st.host_hit_tokens),
            (CounterMetricFamily, "storage_hit_tokens", "Prompt tokens read from the "
             "shared store (part of prefix_cache_hits)", st.store_hit_tokens),
            (CounterMetricFamily, "host_demoted_pages", "Pages copied to the host tier "
             "as the device evicted them", st.demoted_pages),
            (CounterMetricFamily, "host_load_bytes", "Bytes loaded from the host tier",
             st.host_load_bytes),
            (CounterMetricFamily, "loaded_ahead_tokens", "Tokens loaded back from the host "
             "tier or the store for a waiting agent session before its request came "
             "(--prefetch-within; its request then hits them on the device)",
             st.ahead_tokens),
            (CounterMetricFamily, "host_load_seconds", "Time loading from the host tier",
             st.host_load_s),
            (CounterMetricFamily, "storage_pages_read", "Pages read from the store",
             st.pages_read),
            (CounterMetricFamily, "storage_pages_written", "Pages written to the store",
             st.pages_written),
            (CounterMetricFamily, "storage_bytes_read", "Bytes read", st.bytes_read),
            (CounterMetricFamily, "storage_bytes_written", "Bytes written", st.bytes_written),
            (CounterMetricFamily, "storage_read_seconds", "Time reading pages", st.read_s),
            (CounterMetricFamily, "storage_write_seconds", "Time writing pages", st.write_s),
            (CounterMetricFamily, "storage_errors", "Store calls that failed (down, "
             "full, timed out)", tier.errors),
            (CounterMetricFamily, "storage_corrupt_pages", "Values that failed the "
             "header check (treated as misses)", st.corrupt),
            (CounterMetricFamily, "storage_unauthenticated_pages", "Values whose MAC "
             "failed under --storage-secret (treated as misses)", st.unauthenticated),
            (CounterMetricFamily, "storage_evicted_pages", "Pages a capped file store "
             "removed (--storage-max-bytes)", tier.store_stats("evicted_pages")),
            (CounterMetricFamily, "storage_evicted_bytes", "Bytes a capped file store "
             "removed", tier.store_stats("evicted_bytes")),
        ]  # fmt: skip
    return values


class EngineCollector(Collector):
    """Counters and gauges read from the engine at scrape time."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        values = _engine_values(e) + _layer_values(e) + _tier_values(e)
        for family, name, doc, value in values:
            m = family(f"radixkv:{name}", doc, labels=["model_name"])
            m.add_metric([self.model_name], value)
            yield m
        yield from self.by_label(e)

    def by_label(self, e: Engine) -> Iterator[Metric]:
        """The families with a second label: finish reasons, release reasons, kinds."""
        done = CounterMetricFamily(
            "radixkv:request_success", "Finished requests by finish reason",
            labels=["model_name", "finished_reason"],
        )  # fmt: skip
        for reason in FINISH_REASONS:
            done.add_metric([self.model_name, reason], e.counters.finished.get(reason, 0))
        yield done
        released = CounterMetricFamily(
            "radixkv:prompt_cache_retain_released", "Retained prefixes released, by reason "
            "(expired, quota, pressure: a request needed the room, flush)",
            labels=["model_name", "reason"],
        )  # fmt: skip
        for reason in REASONS:
            released.add_metric([self.model_name, reason], e.retention.released[reason])
        yield released
        held = GaugeMetricFamily(
            "radixkv:cache_kind_bytes", "Bytes of cache memory held (running requests and "
            "cached prefixes), by kind: full-attention KV, sliding-window KV, recurrent-state "
            "checkpoints", labels=["model_name", "kind"],
        )  # fmt: skip
        evicted = CounterMetricFamily(
            "radixkv:cache_kind_evicted_bytes", "Bytes of cache memory evicted to make room, "
            "by kind", labels=["model_name", "kind"],
        )  # fmt: skip
        gone = e.cache_bytes_evicted()
        for kind, n in e.cache_bytes_held().items():
            held.add_metric([self.model_name, kind], n)
            evicted.add_metric([self.model_name, kind], gone[kind])
        yield held
        yield evicted
        if e.sessions is not None:  # --eviction-policy session (ints: safe off its thread)
            why = CounterMetricFamily(
                "radixkv:session_evicted_tokens", "Cached tokens evicted under the session "
                "order, by what their stamp said: no_session, back_within_1m (an agent "
                "predicted back within a minute), back_later", labels=["model_name", "reason"],
            )  # fmt: skip
            for reason, n in e.sessions.reasons.tokens.items():
                why.add_metric([self.model_name, reason], n)
            yield why


class ServerMetrics:
    """A registry of its own (several servers may live in one process, as in tests)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.model_name = model_name

        def hist(name: str, doc: str) -> Any:
            return Histogram(
                f"radixkv:{name}", doc, ["model_name"], registry=self.registry,
                buckets=LATENCY_BUCKETS,
            ).labels(model_name)  # fmt: skip

        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between streamed outputs")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to last output")
        self.cache_keys = Counter(
            "radixkv:prompt_cache_key_requests", "Requests with a prompt_cache_key (a "
            "router keeps a key's requests on one worker; one server has one cache)",
            ["model_name"], registry=self.registry,
        ).labels(model_name)  # fmt: skip
