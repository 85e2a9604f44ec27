#!/bin/bash
# A real agent comes back to its pages: Claude Code (npm) against `radixkv serve` in the
# session order with a host tier, with and without --prefetch-within. Claude Code's first
# call gets a Bash tool call that sleeps 100 s (a scripted qwen3 folder: the tests'
# support.scripted, real weights computing every token's KV, the answers scripted);
# while the tool runs, another client's long prompt (a turn that ends) pushes part of
# the agent's context down to the host tier. Printed per run: the host tokens Claude
# Code's next call loaded on arrival, the tokens loaded ahead, and its cache reads.
#
# FAMILY qwen3.5 (recurrent layers; the session order needs one byte budget there, sized
# for about the same tokens) loads the agent's deepest checkpoint back with its KV. BUSY
# "busy": from the other prompt's start until Claude Code's end, three more clients keep
# the server busy (back-to-back answers of about 300 tokens), so it is not idle between
# the other prompt's end and Claude Code's next call.
#
#   bash benchmarks/bench_prefetch_cc.sh CLAUDE_DIR OUT [qwen3|qwen3.5] [idle|busy]
#   (CLAUDE_DIR: npm install --prefix CLAUDE_DIR @anthropic-ai/claude-code; ~8 minutes)
set -euo pipefail
CC=$1/node_modules/.bin/claude; OUT=$2; FAMILY=${3:-qwen3}; BUSY=${4:-idle}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
case $FAMILY in
  qwen3) MEMORY="--kv-tokens 140000" ;;
  qwen3.5) MEMORY="--cache-bytes 36000000" ;;  # ~140,000 tokens of its one attention layer
  *) echo "error: FAMILY: qwen3 or qwen3.5, got $FAMILY" >&2; exit 2 ;;
esac
[ -d "$OUT/$FAMILY" ] || radixkv make-model "$FAMILY" "$OUT/$FAMILY" --context 65536 > /dev/null
cat > "$OUT/script.json" <<'JSON'
{"rules": [{"when": "<tool_response>", "reply": "All done: the check printed ok."},
           {"when": "Busy client", "reply": "Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say. Noted, and more to say."}],
 "default": "<tool_call>\n{\"name\": \"Bash\", \"arguments\": {\"command\": \"sleep 100; echo ok\", \"description\": \"Run the slow check\"}}\n</tool_call>"}
JSON
port=8317
for extra in "--prefetch-within 120" ""; do
  name=${extra:+ahead}; name=${name:-plain}
  python -c "import sys; sys.path.insert(0, '$ROOT/tests'); from support.scripted import main; \
sys.argv = ['x', '$OUT/script.json', 'serve', '--model', '$OUT/$FAMILY', '--port', '$port', \
'--served-model-name', 'tiny', '--page-size', '16', '--max-context-len', '131072', \
'--host-tokens', '400000', '--eviction-policy', 'session'] \
+ '$MEMORY $extra'.split(); sys.exit(main())" > "$OUT/server_$name.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 120); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 1; done
  ( cd "$OUT" && ANTHROPIC_BASE_URL=http://127.0.0.1:$port ANTHROPIC_API_KEY=none \
    ANTHROPIC_MODEL=tiny ANTHROPIC_SMALL_FAST_MODEL=tiny DISABLE_TELEMETRY=1 \
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 timeout 600 "$CC" -p "Run the slow check" \
    --allowedTools Bash --output-format json > "cc_$name.json" 2> "cc_$name.err" ) &
  cpid=$!
  rm -f "$OUT/stop"
  python - "$port" "$OUT/cc_$name.json" "$name" "$BUSY" "$OUT/stop" <<'PY' &
import json, os, re, sys, threading, time
import httpx
port, result, name, busy, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
url = f"http://127.0.0.1:{port}"
def client(k):  # back to back until Claude Code is done
    i = 0
    while not os.path.exists(stop):
        body = {"model": "tiny", "max_tokens": 300, "system": f"Busy client {k}.",
                "messages": [{"role": "user", "content": f"Say more, {i}."}]}
        httpx.post(f"{url}/v1/messages", json=body, timeout=600,
                   headers={"x-api-key": "none", "X-Claude-Code-Session-Id": f"busy{k}"})
        i += 1
def metric(n):
    found = re.search(rf"radixkv:{n}\{{[^}}]*\}} ([0-9.e+]+)", httpx.get(f"{url}/metrics").text)
    return float(found.group(1)) if found else 0.0
deadline = time.monotonic() + 300  # Claude Code's first call done: its session waits
while metric("agent_sessions_waiting") < 1 and time.monotonic() < deadline:
    time.sleep(0.5)
threads = [threading.Thread(target=client, args=(k,)) for k in range(3 if busy == "busy" else 0)]
for t in threads:
    t.start()
body = {"model": "tiny", "max_tokens": 200, "system": "You are agent D. " * 4700,
        "messages": [{"role": "user", "content": "hi"}]}
r = httpx.post(f"{url}/v1/messages", json=body, timeout=600,
               headers={"x-api-key": "none", "X-Claude-Code-Session-Id": "other"})
print(name, "the other prompt:", r.json()["usage"]["input_tokens"], "tokens,",
      r.json()["stop_reason"], flush=True)
for t in threads:
    t.join()
PY
  opid=$!
  wait $cpid
  touch "$OUT/stop"; wait $opid
  python - "$port" "$OUT/cc_$name.json" "$name" <<'PY'
import json, re, sys
import httpx
port, result, name = int(sys.argv[1]), sys.argv[2], sys.argv[3]
text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
def metric(n):
    found = re.search(rf"radixkv:{n}\{{[^}}]*\}} ([0-9.e+]+)", text)
    return float(found.group(1)) if found else 0.0
usage = json.load(open(result))["usage"]
print(f"{name}: host tokens loaded on arrival {metric('host_hit_tokens_total'):.0f}, "
      f"loaded ahead {metric('loaded_ahead_tokens_total'):.0f} (checkpoints "
      f"{metric('state_checkpoints_loaded_ahead_total'):.0f}), Claude Code's cache reads "
      f"{usage['cache_read_input_tokens']}")
PY
  kill $spid; wait $spid 2>/dev/null || true
done
