"""A model spec (a preset, a JSON file) replayed through the engine itself
(`radixkv.sim.spec_model`, ``simulate --policy serve`` without a folder): byte for byte
the folder's engine, request for request, and the spec's bad values refused."""

from __future__ import annotations

import json
import random

import pytest

from radixkv.cli import main
from radixkv.sim import hybrid, traces
from radixkv.sim.serve_replay import serve_result
from radixkv.sim.spec_model import SpecModel, layer_specs


def _chats() -> traces.Trace:
    """8 chats x 3 turns behind 2 system prompts, token ids a tiny model's vocabulary
    holds; each round arrives together."""
    rng = random.Random(3)
    systems = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(2)]
    history = [list(systems[i % 2]) for i in range(8)]
    records = []
    for turn in range(3):
        for h in history:
            h.extend(rng.randrange(3, 300) for _ in range(12))
            answer = [rng.randrange(3, 300) for _ in range(6)]
            records.append((list(h), {"output_ids": answer, "boundaries": [40],
                                      "timestamp": turn}))  # fmt: skip
            h.extend(answer)
    return traces.from_tokens("chats", records, 4)


@pytest.mark.parametrize(("family", "budget"), [("qwen3.5", 60_000), ("gemma3", 300_000)])
def test_a_folders_spec_replays_as_the_folder_request_for_request(tmp_path, family, budget):
    folder = str(tmp_path / family)
    assert main(["make-model", family, folder]) == 0
    spec, trace = hybrid.model_spec(folder), _chats()
    for running in (1, 8):
        served = serve_result(trace, folder, spec, budget, running, chunk_size=32)
        alone = serve_result(trace, None, spec, budget, running, chunk_size=32)
        assert alone.cached == served.cached
        assert alone.mean_bytes == served.mean_bytes
        roomy = serve_result(trace, folder, spec, 40 * budget, running, chunk_size=32)
        assert 0 < served.token_hit_rate < roomy.token_hit_rate  # under pressure, hitting


def test_a_preset_is_served_at_its_own_bytes(capsys, tmp_path):
    spec = hybrid.PRESETS["qwen3.5-4b"]
    specs = layer_specs(spec)
    assert specs.recurrent.state_bytes == spec.checkpoint
    model = SpecModel(spec, 100)
    from radixkv.sim.spec_model import DTYPE

    assert specs.full.token_bytes(DTYPE) == spec.full_kv
    with pytest.raises(RuntimeError, match="only has a shape"):
        model()
    out = tmp_path / "rows.json"
    assert main(["simulate", "--workload", "chat", "--model-spec", "qwen3.5-4b", "--capacity",
                 "256MiB", "--policy", "serve", "--requests", "24", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["policy"] == "serve" and len(row["cached"]) == 24 and row["hit_tokens"] > 0
    assert sum(row["cached"]) == row["hit_tokens"]


def test_an_odd_kv_bytes_spec_is_refused(tmp_path, capsys):
    odd = hybrid.ModelSpec("odd", 2, 4097)
    with pytest.raises(ValueError, match="kv_bytes must be even"):
        layer_specs(odd)
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"full_layers": 2, "kv_bytes": 4097}))
    assert main(["simulate", "--workload", "chat", "--model-spec", str(path), "--capacity",
                 "64MiB", "--policy", "serve", "--requests", "4"]) == 2
    assert "kv_bytes must be even" in capsys.readouterr().err
