"""The Grafana dashboard (`examples/grafana/radixkv.json`): well formed, and every metric
it queries exists on a live `radixkv serve`'s and `radixkv route`'s ``/metrics`` (so a
renamed metric cannot leave a panel silently empty)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from radixkv.web.process import ServerProcess, free_port_pair

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "radixkv.json"
METRIC = re.compile(r"\b(radixkv(?:_router)?:[A-Za-z0-9_]+)")


def queries(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for p in dash["panels"]:
        assert p["title"] and p["targets"] and p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert METRIC.search(t["expr"]), t["expr"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "serve_job", "route_job"} <= names


def exposed(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}  # fmt: skip


@pytest.mark.slow
def test_every_metric_it_queries_exists_on_a_live_server_and_router():
    events = free_port_pair()
    worker = ServerProcess("--model", "random", "--kv-events", f"tcp://127.0.0.1:{events}",
                           timeout=60)  # fmt: skip
    with worker:
        spec = f"{worker.url},tcp://127.0.0.1:{events}"
        with ServerProcess("--model", "random", "--worker", spec, command="route",
                           timeout=60) as router:  # fmt: skip
            r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                           json={"prompt": "hello", "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200, r.text
            have = exposed(worker.url) | exposed(router.url)
    wanted = {m for e in queries(json.loads(DASHBOARD.read_text())) for m in METRIC.findall(e)}
    assert {m.split(":")[0] for m in wanted} == {"radixkv", "radixkv_router"}
    assert wanted - have == set(), f"queried but not exposed: {sorted(wanted - have)}"
