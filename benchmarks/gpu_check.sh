#!/usr/bin/env bash
# Every GPU claim of kvserve, checked in one command (<= 8 minutes on one H200).
#
#   bash benchmarks/gpu_check.sh OUT_DIR [SECTION ...]
#
# Sections (default: all, in this order): env decode kernels moe serve parity pytest sweep
#   env      nvidia-smi, torch / Triton / CUDA versions
#   kernels  benchmarks/attention_kernels.py: Triton paged decode vs SDPA vs the copy bandwidth
#   decode   an 8B-shaped model (--load-format dummy) decode step at batch 1/16/64, graphs on/off
#   moe      benchmarks/moe_paths.py: a Qwen3-30B-A3B-shaped MoE layer on the fused Triton
#            grouped GEMMs vs the per-expert loop vs dense, eager and in CUDA graphs
#   parity   tiny Llama/Mistral/Qwen2/Qwen3/Gemma 2/Gemma 3/Qwen3-MoE/Mixtral: fp32 greedy identical
#            to HF (Triton backend, graphs on and off); bf16 agreement with HF's bf16 forward
#   serve    `kvserve serve` on the 8B shape + `kvserve bench serve` at concurrency 1/16/64
#   pytest   tests/kernels (compiled for the GPU, not interpreted), the graph bookkeeping and
#            the CUDA-only unit tests (host pools, copies, memory snapshot)
#   sweep    decode-kernel launch choices (KVSERVE_DECODE_CONFIG) on a few cases
#
# Needs torch, Triton and transformers; fastapi, uvicorn, pydantic and gguf may come as wheels
# in ./.whl (installed into /tmp/site). No model is downloaded: everything runs on tiny random
# checkpoints made on the spot and on configs/models/llama-3.1-8b with random weights.
# Results in OUT_DIR: summary.txt, log.txt (every section's output), kernels.json, decode.json,
# moe.json, parity.json, serve.json, server.log: 8 files, no subfolders.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUT_DIR [SECTION ...]}
shift
SECTIONS=${*:-env decode kernels moe serve parity pytest sweep}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
: >"$OUT/log.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# run NAME SECONDS CMD...: one section, time-boxed, its output in OUT/NAME.log, a line in the
# summary. A section that fails or times out does not stop the others.
run() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)"
    local log=/tmp/gpu_check.$name.log
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    local status=ok
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="TIMEOUT"
    [ $rc -ne 0 ] && [ "$status" = ok ] && status="FAILED rc=$rc"
    printf '%-8s %-14s %4ds\n' "$name" "$status" $((SECONDS - t0)) | tee -a "$SUMMARY"
    { echo "===== $name: $status"; cat "$log"; } >>"$OUT/log.txt"
    tail -n 25 "$log"
}

for section in $SECTIONS; do
    case $section in
    env)
        run env 30 bash -c "nvidia-smi; $PY -c 'import torch, triton, transformers, sys; \
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \
\"triton\", triton.__version__, \"transformers\", transformers.__version__); \
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))'; \
$PY -c 'import engine, server.app; print(\"kvserve imports ok\")'"
        ;;
    kernels)
        run kernels 60 $PY benchmarks/attention_kernels.py --batches 1,8,32,64,128 \
            --contexts 1024,4096,16384 --iters 10 --json "$OUT/kernels.json"
        ;;
    decode)
        run decode 90 $PY benchmarks/gpu_check.py decode --out "$OUT"
        ;;
    moe)
        run moe 60 $PY benchmarks/moe_paths.py --json "$OUT/moe.json"
        ;;
    parity)
        run parity 110 $PY benchmarks/gpu_check.py parity --out "$OUT"
        ;;
    serve)
        run serve 110 $PY benchmarks/gpu_check.py serve --out "$OUT"
        ;;
    pytest)
        run pytest 120 $PY -m pytest -q -p no:cacheprovider -n 8 \
            tests/kernels tests/engine/runner/test_decode_graphs.py tests/engine/kv_cache/host/test_host_pool.py \
            tests/engine/kv_cache/host/test_host_copy.py tests/engine/runner/test_memory_budget.py tests/engine/runner/test_device.py \
            --deselect tests/kernels/test_gpu_compile.py::test_kernels_compile_for_sm90
        ;;
    sweep)
        # Decode-kernel launch choices (kvserve_kernels/launch_config.py), same cases for each.
        run sweep 75 bash -c 'for cfg in "" "BLOCK_N=32" "BLOCK_N=128,num_warps=8" \
            "num_warps=8" "num_stages=3" "programs_per_sm=2" "programs_per_sm=8"; do
            echo "--- KVSERVE_DECODE_CONFIG=$cfg"
            KVSERVE_DECODE_CONFIG="$cfg" '"$PY"' benchmarks/attention_kernels.py --batches 1,64,128 \
                --contexts 4096,16384 --iters 10 2>/dev/null | tail -n 9
        done'
        ;;
    *)
        echo "unknown section $section" | tee -a "$SUMMARY"
        ;;
    esac
done
rm -rf "$OUT/work"
echo "=== summary"
cat "$SUMMARY"
