#!/bin/bash
# Live, with a client no one here wrote: `radixkv serve` with LRU against the session
# order, in interleaved runs, driven by kv-cache-tester's own trace_replay_tester.py
# (a peer tool in its own venv: ../shared/peers/setup.sh kvtester). Per run: the
# server's hit rate (prefix_cache_hits / prefix_cache_queries from /metrics) and the
# client's TTFT p50 / p90 (its detailed_results.csv); appended to OUT/results.txt.
#
#   bash benchmarks/bench_kvtester.sh DURATION_S PAIRS KV_TOKENS MAX_CONTEXT OUT
#   (e.g. 300 3 24576 16384 /tmp/kvt: 3 pairs of 5-minute runs, ~35 min)
#
# Needs: the shared traces gunzipped in /tmp/traces, a tiny model folder /tmp/kvm
# (radixkv make-model qwen3 /tmp/kvm --context 65536). RADIXKV_SRC: run the server from
# another source tree (a worktree), so editing this one does not change a run.
set -euo pipefail
DUR=$1; PAIRS=$2; KV=$3; CTX=$4; OUT=$5
V=${KVTESTER:-$HOME/.cache/radixkv-peers/kvtester}
mkdir -p "$OUT"
for i in $(seq 1 "$PAIRS"); do
  for pol in lru session; do
    port=8200
    PYTHONPATH=${RADIXKV_SRC:-} radixkv serve --model /tmp/kvm --port $port \
      --max-context-len 65536 --kv-tokens "$KV" --served-model-name kvm --max-running 8 \
      --eviction-policy $pol > "$OUT/server_${pol}_$i.log" 2>&1 &
    spid=$!
    for _ in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
    "$V/bin/python" "$V/trace_replay_tester.py" --api-endpoint http://127.0.0.1:$port \
      --trace-directory /tmp/traces --output-dir "$OUT/client_${pol}_$i" --tokenizer /tmp/kvm \
      --max-context "$CTX" --max-users 8 --start-users 8 --test-duration "$DUR" --seed "$i" \
      --skip-graphs --time-scale 0.1 --max-ttft 1000 --recycle > "$OUT/client_${pol}_$i.log" 2>&1
    curl -s http://127.0.0.1:$port/metrics > "$OUT/metrics_${pol}_$i.txt"
    kill $spid; wait $spid 2>/dev/null || true
    python3 - "$OUT" $pol "$i" <<'PY'
import csv, glob, re, statistics, sys
out, pol, i = sys.argv[1:]
m = open(f"{out}/metrics_{pol}_{i}.txt").read()
def val(name):
    r = re.search(rf"^radixkv:{name}_total(?:{{[^}}]*}})? ([0-9.e+]+)", m, re.M)
    return float(r.group(1)) if r else float("nan")
q, h = val("prefix_cache_queries"), val("prefix_cache_hits")
ttft = sorted(float(row["ttft"]) for f in glob.glob(f"{out}/client_{pol}_{i}/**/detailed_results.csv", recursive=True)
              for row in csv.DictReader(open(f)) if row.get("ttft") and float(row["ttft"]) > 0)
p90 = ttft[int(0.9 * (len(ttft) - 1))] if ttft else float("nan")
p50 = statistics.median(ttft) if ttft else float("nan")
with open(f"{out}/results.txt", "a") as fh:
    fh.write(f"run {i} {pol}: hit {h / q if q else float('nan'):.4f} ({h:.0f}/{q:.0f}) "
             f"requests {len(ttft)} ttft p50 {p50:.2f} p90 {p90:.2f}\n")
PY
  done
done
