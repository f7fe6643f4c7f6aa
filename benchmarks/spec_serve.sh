#!/usr/bin/env bash
# Speculative decoding through the real server: kvserve with and without n-gram speculation,
# same machine, one after the other in one run, measured by `kvserve bench serve`.
#
#   bash benchmarks/spec_serve.sh [OUT_DIR]     (default docs/perf/<date>_<isa>_spec-serve)
#
# Workloads: `copy` single stream (input-grounded: a 200-token passage and its first 100 tokens
# again, 128 out, 6 requests, concurrency 1), the case n-gram lookup is for; and W1 (64 random
# requests, 280 prompt tokens, 64 out, concurrency 16), where the adaptive switch must keep the
# step plain. Prints TPOT / throughput both ways with the ratio, and the drafts, draft tokens,
# accepted tokens and acceptance per draft position read from the server's /metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-}
ISA=$(grep -o -m1 -w 'avx512f' /proc/cpuinfo || grep -o -m1 -w 'avx2' /proc/cpuinfo || echo generic)
[ -n "$OUT" ] || OUT="docs/perf/$(date +%Y-%m-%d)_${ISA}_spec-serve"
mkdir -p "$OUT"
PORT=${PORT:-8093}
SPEC='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
PID=""
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null || true; }
trap cleanup EXIT

for mode in plain ngram; do
    extra=()
    [ "$mode" = ngram ] && extra=(--speculative-config "$SPEC")
    kvserve serve --host 127.0.0.1 --port "$PORT" --max-num-seqs 16 "${extra[@]}" \
        > "$OUT/$mode.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
    common=(--base-url "http://127.0.0.1:$PORT" --no-yardstick --warmup 1)
    kvserve bench serve "${common[@]}" --workload copy --num-requests 6 --input-len 300 \
        --output-len 128 --concurrency 1 --label "$mode copy" --json "$OUT/$mode-copy.json"
    curl -s "http://127.0.0.1:$PORT/metrics" | grep '^kvserve:spec_decode' > "$OUT/$mode-copy.metrics" || true
    kvserve bench serve "${common[@]}" --workload random --num-requests 64 --input-len 280 \
        --output-len 64 --concurrency 16 --label "$mode W1" --json "$OUT/$mode-w1.json"
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""
done

python - "$OUT" "$ISA" <<'PY'
import json, re, sys
from pathlib import Path
out, isa = Path(sys.argv[1]), sys.argv[2]
run = {f"{m}-{w}": json.loads((out / f"{m}-{w}.json").read_text())["runs"][0]
       for m in ("plain", "ngram") for w in ("copy", "w1")}
a, b = run["plain-copy"]["tpot_ms"]["p50"], run["ngram-copy"]["tpot_ms"]["p50"]
c, d = run["plain-w1"]["output_throughput"], run["ngram-w1"]["output_throughput"]
print(f"\n| ({isa}) | plain | ngram | ratio |\n|---|---:|---:|---:|")
print(f"| copy, single stream: TPOT p50 (ms) | {a:.2f} | {b:.2f} | {a / b:.2f}x faster |")
print(f"| W1, concurrency 16: out tok/s | {c:.1f} | {d:.1f} | {d / c:.2f}x |")
m = {}
for line in (out / "ngram-copy.metrics").read_text().splitlines():
    name, value = line.rsplit(" ", 1)
    m[name] = float(value)
def total(key):
    return sum(v for k, v in m.items() if k.startswith(f"kvserve:{key}"))
drafts, tokens = total("spec_decode_num_drafts_total"), total("spec_decode_num_draft_tokens_total")
accepted = total("spec_decode_num_accepted_tokens_total{")
print(f"copy workload: {drafts:.0f} drafts, {tokens:.0f} draft tokens, {accepted:.0f} accepted "
      f"({accepted / max(tokens, 1):.1%}); per position:", end="")
for k, v in sorted(m.items()):
    pos = re.search(r'position="(\d+)"', k)
    if pos and "per_pos" in k:
        print(f" {pos.group(1)}: {v / max(drafts, 1):.2f}", end="")
print()
(out / "summary.json").write_text(json.dumps({"isa": isa, "copy_tpot_p50_ms": [a, b],
                                              "w1_out_tok_s": [c, d], "drafts": drafts,
                                              "draft_tokens": tokens, "accepted": accepted}))
PY
