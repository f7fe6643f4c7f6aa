"""Every environment variable kvserve reads, in one table, with one typed accessor each.

This is the only module of ``engine/``, ``kvserve_kernels/``, ``server/`` and ``loadgen/`` that touches
``os.environ`` (tests/house/test_envs.py holds the rule). Each accessor reads the environment
when called, never at import, so a test that monkeypatches a variable sees its value at the
next call, and so does a running engine (what reads a variable once per process, such as
``kvserve_kernels.launch_config``, caches it itself and says so). docs/envs.md is this table in prose;
tests/house/test_envs.py checks the two agree.

``VARIABLES`` names each variable with its default and meaning. Values are strings; a flag is
on or off by the comparison its accessor documents (``"0"`` turns off a default-on feature,
``"1"`` turns on a default-off one; anything else leaves the default), exactly as the code
read them before they were gathered here. Most are switches for A/B runs and for tests:
what a user configures goes in the options table (``server/config_file.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """One variable: its ``name``, the ``default`` when unset (as documented, in words when
    it is no single string), what it does, and whether it is kvserve's own (``KVSERVE_*``)
    or a standard one whose value kvserve also consults."""

    name: str
    default: str
    meaning: str
    ours: bool = True


CACHE_DIR = "KVSERVE_CACHE_DIR"
CPU_KERNELS = "KVSERVE_CPU_KERNELS"
CPU_MARCH = "KVSERVE_CPU_MARCH"
CPU_AMX = "KVSERVE_CPU_AMX"
KERNEL_BUILD_WAIT = "KVSERVE_KERNEL_BUILD_WAIT"
DECODE_STACK = "KVSERVE_DECODE_STACK"
STACK_PREFETCH = "KVSERVE_STACK_PREFETCH"
MOE_CONCURRENT = "KVSERVE_MOE_CONCURRENT"
PACKED_LINEAR = "KVSERVE_PACKED_LINEAR"
QUANT_PACKED_ONLY = "KVSERVE_QUANT_PACKED_ONLY"
QUANT_FORCE = "KVSERVE_QUANT_FORCE"
QUANT_REPROBE = "KVSERVE_QUANT_REPROBE"
DECODE_CONFIG = "KVSERVE_DECODE_CONFIG"
PREFILL_CONFIG = "KVSERVE_PREFILL_CONFIG"
API_KEY = "KVSERVE_API_KEY"
ALLOW_RUNTIME_LORA_UPDATING = "KVSERVE_ALLOW_RUNTIME_LORA_UPDATING"
GOMP_SPINCOUNT = "GOMP_SPINCOUNT"
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"

# What limits the instructions the measured paths use: our kernels' build target and the caps
# on PyTorch's own (ATen's vectorised ops, oneDNN's matmuls, MKL's dense float32 matmuls). The
# quantisation probe's verdicts are keyed by their values.
ISA_CAP_VARIABLES = (CPU_MARCH, CPU_AMX, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                     "MKL_ENABLE_INSTRUCTIONS")
# torchrun's rendezvous variables (engine/distributed/launcher.py reads them).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(CACHE_DIR, "~/.cache/kvserve",
           "where kvserve keeps what it builds once per machine: converted GGUF files, the "
           "compiled CPU kernels, the quantisation probe's verdicts (a `cache_dir` argument "
           "of the Python loader, `resolve_model`, wins over it)"),
    EnvVar(API_KEY, "unset",
           "the API key when no `--api-key`/`api-key` option is given: requests to /v1/* "
           "must carry `Authorization: Bearer KEY`"),
    EnvVar(ALLOW_RUNTIME_LORA_UPDATING, "0",
           "`1` (or `true`, vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` spelling) mounts "
           "POST /v1/load_lora_adapter and /v1/unload_lora_adapter when no "
           "`--[no-]allow-runtime-lora-updating` option is given"),
    EnvVar(CPU_KERNELS, "1", "`0` turns the C++ CPU kernels off (the PyTorch route runs)"),
    EnvVar(CPU_MARCH, "native",
           "the `-march` the CPU kernels are built for, under their own name (e.g. `haswell` "
           "runs the AVX2 paths on an AVX-512 machine, for their correctness)"),
    EnvVar(CPU_AMX, "1",
           "`0` keeps the AMX int8 tiles (interleaved 8-bit and blocked 4-bit weights) out of "
           "the start-up probe's choices "
           "(they are used only where built, granted by the OS and measured faster); part of "
           "the probe verdict's key"),
    EnvVar(KERNEL_BUILD_WAIT, "900",
           "seconds to wait for another live process building the CPU kernels before the "
           "start fails naming the folder"),
    EnvVar(DECODE_STACK, "1",
           "`0` turns off the C++ decode-step layer loop (engine/models/cpu_decode_stack.py); "
           "the Python layer loop runs (A/B runs, profiling)"),
    EnvVar(STACK_PREFETCH, "4194304",
           "bytes of the next linears' weights the C++ decode stack's idle thread may load "
           "ahead while a single-task attention runs (engine/cpu/csrc/weight_prefetch.h); "
           "`0` turns it off (A/B runs)"),
    EnvVar(MOE_CONCURRENT, "1",
           "the C++ decode stack runs a step's packed experts one per thread "
           "(engine/cpu/csrc/decode_stack_cpu.cpp moe_forward; the same bits); `0`: one "
           "expert at a time on every thread (A/B runs)"),
    EnvVar(PACKED_LINEAR, "auto",
           "float32 CPU linears: `0` keeps plain `nn.Linear`, `onednn`, `avx2-panels` or "
           "`hybrid` forces that packing where it is available"),
    EnvVar(QUANT_PACKED_ONLY, "0",
           "`1` serves a GGUF's packed weights without building the float32 model beside "
           "them (float is then no candidate of the start-up probe)"),
    EnvVar(QUANT_FORCE, "0",
           "`1` uses the packed quantised weights at every batch size, whatever the start-up "
           "probe measured (tests)"),
    EnvVar(QUANT_REPROBE, "0",
           "`1` ignores the stored probe verdict and measures again (as `--cpu-probe force`)"),
    EnvVar(DECODE_CONFIG, "unset",
           "Triton decode kernel launch override, e.g. `BLOCK_N=32,num_warps=4,num_stages=2,"
           "programs_per_sm=4`; read once per process (for benchmarks)"),
    EnvVar(PREFILL_CONFIG, "unset",
           "Triton prefill kernel launch override, e.g. `BLOCK_M=32,BLOCK_N=64,num_warps=4,"
           "num_stages=2`; read once per process (for benchmarks)"),
    EnvVar("ATEN_CPU_CAPABILITY", "unset",
           "PyTorch's cap on its vectorised CPU ops; part of the probe verdict's key",
           ours=False),
    EnvVar("ONEDNN_MAX_CPU_ISA", "unset",
           "oneDNN's instruction-set cap; part of the probe verdict's key", ours=False),
    EnvVar("MKL_ENABLE_INSTRUCTIONS", "unset",
           "MKL's instruction-set cap; part of the probe verdict's key", ours=False),
    EnvVar(GOMP_SPINCOUNT, "3000 under `kvserve` (libgomp's own: 300000)",
           "how many times a waiting OpenMP thread spins before it sleeps; `kvserve` sets "
           "3000 before torch loads unless this or `OMP_WAIT_POLICY` is set "
           "(engine/cpu/omp_spin.py: libgomp's default spinning stalls requests for seconds "
           "on cores that other processes share)", ours=False),
    EnvVar(OMP_WAIT_POLICY, "unset",
           "OpenMP's wait policy; when set, `kvserve` leaves `GOMP_SPINCOUNT` alone",
           ours=False),
    EnvVar("CXX", "c++", "the C++ compiler; part of the CPU kernels' build key", ours=False),
    EnvVar("CUDA_VISIBLE_DEVICES", "unset",
           "empty or `-1` hides every GPU; kvserve says so when `--device cuda` finds none",
           ours=False),
    EnvVar("RANK, WORLD_SIZE, LOCAL_RANK", "unset",
           "set by torchrun: one process per tensor-parallel rank, nothing is spawned; a "
           "`serve` with RANK > 0 runs its rank only (no HTTP server)", ours=False),
    EnvVar("MASTER_ADDR, MASTER_PORT", "unset",
           "the tensor-parallel meeting point when `--distributed-init-method` is not given",
           ours=False),
)

_NAMES = frozenset(n.strip() for v in VARIABLES for n in v.name.split(","))


def _get(name: str) -> str | None:
    if name not in _NAMES:  # every variable read is in the table (and so in docs/envs.md)
        raise KeyError(f"{name} is not in engine/envs.py's VARIABLES")
    return os.environ.get(name)


def get(name: str) -> str | None:
    """The raw value of a variable of the table, None when unset."""
    return _get(name)


def set_default(name: str, value: str) -> None:
    """Set a variable of the table for this process unless it is already set (a tool that
    wants another default for what it starts, e.g. ``kvserve bench profile``)."""
    _get(name)
    os.environ.setdefault(name, value)


def cache_dir() -> str | None:
    """``$KVSERVE_CACHE_DIR``, None when unset or empty."""
    return _get(CACHE_DIR) or None


def api_key() -> str | None:
    """``$KVSERVE_API_KEY``, None when unset or empty."""
    return _get(API_KEY) or None


def allow_runtime_lora_updating() -> bool:
    """True only when ``KVSERVE_ALLOW_RUNTIME_LORA_UPDATING`` is ``1`` or ``true`` (any
    case: vLLM's variable is documented as ``True``)."""
    return (_get(ALLOW_RUNTIME_LORA_UPDATING) or "").strip().lower() in ("1", "true")


def cpu_kernels_enabled() -> bool:
    """False only when ``KVSERVE_CPU_KERNELS=0``."""
    return _get(CPU_KERNELS) != "0"


def cpu_march() -> str:
    """``$KVSERVE_CPU_MARCH``, ``native`` when unset."""
    value = _get(CPU_MARCH)
    return "native" if value is None else value


def cpu_amx_enabled() -> bool:
    """False only when ``KVSERVE_CPU_AMX=0``."""
    return _get(CPU_AMX) != "0"


def kernel_build_wait_s() -> float | None:
    """``$KVSERVE_KERNEL_BUILD_WAIT`` in seconds, None when unset (the builder's default
    applies); a value that is no number raises ValueError."""
    value = _get(KERNEL_BUILD_WAIT)
    return None if value is None else float(value)


def decode_stack_enabled() -> bool:
    """False only when ``KVSERVE_DECODE_STACK=0``."""
    return _get(DECODE_STACK) != "0"


def stack_prefetch_bytes() -> int:
    """``$KVSERVE_STACK_PREFETCH`` (bytes, 4 MiB when unset); a value that is not a
    non-negative integer raises ValueError naming the variable."""
    value = _get(STACK_PREFETCH)
    if value is None:
        return 4 << 20
    if not value.isdigit():
        raise ValueError(f"{STACK_PREFETCH} must be a number of bytes (0 turns it off); "
                         f"got {value!r}")
    return int(value)


def moe_concurrent() -> bool:
    """False only when ``KVSERVE_MOE_CONCURRENT=0``."""
    return _get(MOE_CONCURRENT) != "0"


def packed_linear_choice() -> str:
    """``$KVSERVE_PACKED_LINEAR``, ``auto`` when unset (its callers give the other values
    their meaning)."""
    value = _get(PACKED_LINEAR)
    return "auto" if value is None else value


def quant_packed_only() -> bool:
    """True only when ``KVSERVE_QUANT_PACKED_ONLY=1``."""
    return _get(QUANT_PACKED_ONLY) == "1"


def quant_force() -> bool:
    """True only when ``KVSERVE_QUANT_FORCE=1``."""
    return _get(QUANT_FORCE) == "1"


def quant_reprobe() -> bool:
    """True only when ``KVSERVE_QUANT_REPROBE=1``."""
    return _get(QUANT_REPROBE) == "1"


def isa_caps() -> tuple[str, ...]:
    """The values of :data:`ISA_CAP_VARIABLES`, in order, ``""`` for each one unset."""
    return tuple(_get(name) or "" for name in ISA_CAP_VARIABLES)


def launch_override(name: str) -> str:
    """The text of a Triton launch override (``KVSERVE_DECODE_CONFIG`` or
    ``KVSERVE_PREFILL_CONFIG``), ``""`` when unset."""
    if name not in (DECODE_CONFIG, PREFILL_CONFIG):
        raise KeyError(f"{name} is no launch override variable")
    return _get(name) or ""


def cxx() -> str:
    """``$CXX``, ``c++`` when unset."""
    value = _get("CXX")
    return "c++" if value is None else value


def cuda_visible_devices() -> str | None:
    """``$CUDA_VISIBLE_DEVICES`` as set, None when unset."""
    return _get("CUDA_VISIBLE_DEVICES")


def torchrun_env() -> dict[str, str]:
    """The torchrun rendezvous variables (:data:`TORCHRUN_VARIABLES`) that are set."""
    return {n: v for n in TORCHRUN_VARIABLES if (v := _get(n)) is not None}


def is_torchrun_worker(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a torchrun rank other than 0 (``WORLD_SIZE`` set and
    ``RANK`` > 0); ``env`` defaults to :func:`torchrun_env`."""
    env = torchrun_env() if env is None else env
    return "WORLD_SIZE" in env and int(env.get("RANK", "0")) > 0
