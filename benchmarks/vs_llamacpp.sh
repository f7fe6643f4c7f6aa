#!/usr/bin/env bash
# kvserve next to llama.cpp's own llama-server, same GGUF, same machine, same run.
#
#   bash benchmarks/vs_llamacpp.sh [--avx2] [OUT_DIR]  (default docs/perf/<date>_<isa>_vs-llamacpp[-avx2-only])
#
# --avx2 (on an AVX-512 machine): both servers restricted to AVX2 instructions. llama-server is
#    built without AVX-512 (GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C/BMI2 on; its own build dir);
#    kvserve runs with its kernels built for AVX2 (KVSERVE_CPU_MARCH=haswell) and PyTorch's own
#    ops capped at AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2,
#    MKL_ENABLE_INSTRUCTIONS=AVX2). The instruction paths an AVX2-only CPU runs, on this
#    machine's cores and memory: not an AVX2 machine's speed, but a same-run check of kvserve's
#    AVX2 code against llama.cpp's. On an AVX2-only CPU, run without it.
#
# 1. Builds llama-server once from the llama.cpp sources vendored in the llama-cpp-python sdist
#    on PyPI (cmake + ninja, about 10 minutes on 2 cores), cached outside the repository in
#    ${KVSERVE_LLAMACPP_DIR:-~/.cache/kvserve/llamacpp}. Nothing is built inside the repository.
# 2. Serves the embedded model's GGUF (SmolLM2-135M-Instruct Q4_1), or KVSERVE_BENCH_GGUF's
#    (e.g. benchmarks/gemma3_gguf.py's Gemma 3 270M-shaped file; prompts are then sent as
#    token ids, --prompt-token-ids, as two servers' tokenisers of such a file may differ),
#    with both servers, each with 16 slots / sequences and all cores, one after the other
#    (never both at once), both with a 16-bit KV cache: llama-server's default (f16),
#    kvserve's --kv-cache-dtype float16 (KVSERVE_BENCH_KV_DTYPE overrides it, e.g. auto for
#    the model's float32; KVSERVE_BENCH_ARGS adds kvserve serve arguments, e.g.
#    --no-batch-invariant).
# 3. Runs `kvserve bench serve --openai-only` (the same client, OpenAI fields only, tokens
#    counted from the stream) against each: single stream (8 requests, 128 prompt tokens, 128
#    out, concurrency 1), W1 (64 requests, 280 prompt tokens, 64 out, concurrency 16), W2 (32
#    requests behind one shared 1,480-token prefix, 32 out, concurrency 16).
# 4. Writes each run's JSON to OUT_DIR and prints a table with the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
ISA=$(grep -o -m1 -w 'avx512f' /proc/cpuinfo || grep -o -m1 -w 'avx2' /proc/cpuinfo || echo generic)
MACHINE=$ISA
BUILD=build
WHAT=vs-llamacpp
GGML_ISA=(-DGGML_NATIVE=ON)
if [ "${1:-}" = "--avx2" ]; then
    shift
    ISA="avx2-only-on-$ISA"
    WHAT=vs-llamacpp-avx2-only
    BUILD=build-avx2
    GGML_ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
              -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
    export KVSERVE_CPU_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2
fi
OUT=${1:-}
[ -n "$OUT" ] || OUT="docs/perf/$(date +%Y-%m-%d)_${MACHINE}_${WHAT}"
mkdir -p "$OUT"
CACHE=${KVSERVE_LLAMACPP_DIR:-$HOME/.cache/kvserve/llamacpp}
THREADS=$(nproc)
PORT_LLAMA=${PORT_LLAMA:-8091}
PORT_KV=${PORT_KV:-8092}

# ---- 1. llama-server ---------------------------------------------------------------------
SRC=$(ls -d "$CACHE"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | tail -1 || true)
if [ -z "$SRC" ]; then
    mkdir -p "$CACHE"
    python -m pip download -q --no-deps --no-binary :all: llama-cpp-python -d "$CACHE"
    tar -xzf "$(ls "$CACHE"/llama_cpp_python-*.tar.gz | tail -1)" -C "$CACHE"
    SRC=$(ls -d "$CACHE"/llama_cpp_python-*/vendor/llama.cpp | tail -1)
fi
SERVER_BIN="$SRC/$BUILD/bin/llama-server"
if [ ! -x "$SERVER_BIN" ]; then
    echo "building llama-server in $SRC/$BUILD (once; ~10 minutes on 2 cores)"
    cmake -S "$SRC" -B "$SRC/$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        "${GGML_ISA[@]}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build "$SRC/$BUILD" --target llama-server -j "$THREADS"
fi
GGUF=${KVSERVE_BENCH_GGUF:-}
KV_MODEL=()
IDS=()
if [ -n "$GGUF" ]; then
    KV_MODEL=(--model "$GGUF")
    IDS=(--prompt-token-ids)
else
    GGUF=$(python -c "from engine.loading.embedded import embedded_gguf_path; print(embedded_gguf_path())")
fi
echo "llama-server: $SERVER_BIN"
echo "GGUF: $GGUF ($ISA, $THREADS threads)"

# ---- 2./3. serve and measure ---------------------------------------------------------------
wait_health() {
    for _ in $(seq 1 300); do
        if curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    echo "server on port $1 did not become healthy" >&2
    return 1
}

bench() {  # bench NAME PORT
    local name=$1 port=$2 url="http://127.0.0.1:$2"
    local common=(--base-url "$url" --openai-only --no-yardstick --warmup 1 "${IDS[@]}")
    kvserve bench serve "${common[@]}" --workload random --num-requests 8 --input-len 128 \
        --output-len 128 --concurrency 1 --label "$name single" --json "$OUT/$name-single.json"
    kvserve bench serve "${common[@]}" --workload random --num-requests 64 --input-len 280 \
        --output-len 64 --concurrency 16 --label "$name W1" --json "$OUT/$name-w1.json"
    kvserve bench serve "${common[@]}" --workload shared-prefix --num-groups 1 \
        --prefix-len 1480 --input-len 20 --num-requests 32 --output-len 32 --concurrency 16 \
        --label "$name W2" --json "$OUT/$name-w2.json"
}

PID=""
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null || true; }
trap cleanup EXIT

start_llama() {  # start_llama [EXTRA_ARGS...]: returns non-zero if it died before serving
    "$SERVER_BIN" -m "$GGUF" --host 127.0.0.1 --port "$PORT_LLAMA" -c 32768 -np 16 \
        -t "$THREADS" "$@" > "$OUT/llama-server.log" 2>&1 &
    PID=$!
    for _ in $(seq 1 300); do
        if curl -sf "http://127.0.0.1:$PORT_LLAMA/health" >/dev/null 2>&1; then return 0; fi
        kill -0 "$PID" 2>/dev/null || { PID=""; return 1; }
        sleep 1
    done
    return 1
}
LLAMA_ARGS=""
if ! start_llama; then
    # Seen 2026-12-01 on an AMX (Sapphire Rapids) VM: llama-server segfaults at "threadpool
    # init" in its AMX weight-repacking path; without repacking it serves (AVX-512 VNNI kernels).
    echo "llama-server died at start-up; retrying with --no-repack" | tee -a "$OUT/notes.txt"
    LLAMA_ARGS="--no-repack"
    start_llama --no-repack
fi
bench llamacpp "$PORT_LLAMA"
kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""

KV_DTYPE=${KVSERVE_BENCH_KV_DTYPE:-float16}
read -r -a KV_EXTRA <<< "${KVSERVE_BENCH_ARGS:-}"
echo "kvserve --kv-cache-dtype $KV_DTYPE ${KV_EXTRA[*]} (llama-server: its default f16 KV cache)" \
    | tee -a "$OUT/notes.txt"
kvserve serve "${KV_MODEL[@]}" --host 127.0.0.1 --port "$PORT_KV" --max-num-seqs 16 --kv-cache-dtype "$KV_DTYPE" \
    "${KV_EXTRA[@]}" > "$OUT/kvserve.log" 2>&1 &
PID=$!
wait_health "$PORT_KV"
bench kvserve "$PORT_KV"
kill "$PID"; wait "$PID" 2>/dev/null || true; PID=""

# ---- 4. table ----------------------------------------------------------------------------
python - "$OUT" "$ISA" <<'EOF'
import json, sys
from pathlib import Path
out, isa = Path(sys.argv[1]), sys.argv[2]
rows = []
for wl, title in (("single", "single stream, 128 out: TPOT p50 (ms)"),
                  ("w1", "W1 (64 x 280 in, 64 out, c=16): out tok/s"),
                  ("w2", "W2 (shared 1,480 prefix, 32 out, c=16): out tok/s")):
    r = {n: json.loads((out / f"{n}-{wl}.json").read_text())["runs"][0]
         for n in ("llamacpp", "kvserve")}
    if wl == "single":
        a, b = r["llamacpp"]["tpot_ms"]["p50"], r["kvserve"]["tpot_ms"]["p50"]
        rows.append((title, a, b, a / b))
    else:
        a, b = r["llamacpp"]["output_throughput"], r["kvserve"]["output_throughput"]
        rows.append((title, a, b, b / a))
print(f"\n| ({isa}) | llama-server | kvserve | kvserve advantage |\n|---|---:|---:|---:|")
for title, a, b, ratio in rows:
    print(f"| {title} | {a:.1f} | {b:.1f} | {ratio:.2f}x |")
notes = (out / "notes.txt").read_text() if (out / "notes.txt").exists() else ""
(out / "summary.json").write_text(json.dumps(
    {"isa": isa, "notes": notes, "rows": [dict(zip(("metric", "llamacpp", "kvserve", "advantage"), r))
                          for r in rows]}, indent=1))
EOF
