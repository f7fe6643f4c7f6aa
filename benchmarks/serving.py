"""The full serving benchmark of docs/performance.md ("The CPU engine"), in one command.

    python benchmarks/serving.py --out bench-results/        # CPU, embedded model

Starts `kvserve serve` on a free loopback port (its own subprocess, so the client's measurements
do not share the engine's interpreter), then runs `kvserve bench serve`:

1. the target: 64 requests of ~280 prompt tokens and 64 output tokens at concurrency 16,
   printing the efficiency against the matmul peak measured in the same run;
2. a concurrency sweep (throughput and TPOT vs concurrency);
3. a shared-prefix sweep (TTFT vs prefix length), then restarts the server with prefix caching
   off and repeats it, so the plot shows both.

Everything lands in --out: one JSON per step and the PNG plots. Extra server flags go after
`--server-args` (e.g. `--server-args --dtype bfloat16`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.serve import free_port  # noqa: E402
from server.cli import main as kvserve  # noqa: E402


@contextlib.contextmanager
def running_server(extra: list[str], log_path: Path, timeout: float = 900) -> Iterator[str]:
    """`kvserve serve` on 127.0.0.1; yields its URL; SIGTERM on exit."""
    port = free_port()
    with serving_process([sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                          *extra], port, log_path, timeout) as url:
        yield url


@contextlib.contextmanager
def serving_process(cmd: list[str], port: int, log_path: Path,
                    timeout: float = 900) -> Iterator[str]:
    """Any OpenAI-compatible server command listening on 127.0.0.1:``port`` (kvserve, or
    llama-server for a side-by-side run): yields its URL once ``/health`` answers 200; SIGTERM
    on exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout:.0f}s; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str, int]:
    """A ``redis-server`` on a free loopback port (no persistence, ``allkeys-lru``, 1 GB), its
    files in ``tmp``: (process, host, port), once it accepts connections."""
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server not found (Debian: apt-get install redis-server), or give --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp), "--maxmemory", "1gb",
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, "127.0.0.1", port
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("redis-server did not start")
            time.sleep(0.05)


def find_llama_server() -> Path | None:
    """The llama-server that benchmarks/vs_llamacpp.sh builds (in $KVSERVE_LLAMACPP_DIR, default
    ~/.cache/kvserve/llamacpp), or None."""
    cache = Path(os.environ.get("KVSERVE_LLAMACPP_DIR",
                                Path.home() / ".cache" / "kvserve" / "llamacpp"))
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server"))
    return found[-1] if found else None


def side_by_side(binary: Path | None, out: Path | None, name: str
                 ) -> tuple[Path, str, str, Path] | None:
    """What a benchmark against llama-server starts from: the llama-server binary (``binary``,
    else ``find_llama_server()``), the embedded model's GGUF, the thread count and the results
    folder (``out``, else docs/perf/<date>_<ISA>_<name>, made). None, after saying why, when no
    llama-server is found."""
    from benchmarks.startup_time import isa
    from engine.loading.embedded import embedded_gguf_path

    binary = binary or find_llama_server()
    if binary is None or not binary.exists():
        print("llama-server not found: run `bash benchmarks/vs_llamacpp.sh` once to build it, "
              "or pass --llama-server PATH", file=sys.stderr)
        return None
    out = out or ROOT / "docs" / "perf" / (
        f"{time.strftime('%Y-%m-%d')}_{isa().replace(' ', '').lower()}_{name}")
    out.mkdir(parents=True, exist_ok=True)
    return binary, str(embedded_gguf_path()), str(os.cpu_count() or 1), out


def bench(url: str, out: Path, name: str, *args: str) -> int:
    argv = ["bench", "serve", "--base-url", url, "--json", str(out / f"{name}.json"), *args]
    print(f"\n$ kvserve {' '.join(argv)}", flush=True)
    return kvserve(argv)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=280)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--prefix-lens", default="64,256,1024")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    a = p.parse_args()
    if a.quick:
        a.num_requests, a.input_len, a.output_len = 8, 32, 8
        a.concurrency, a.prefix_lens = "1,4", "32,128"
    a.out.mkdir(parents=True, exist_ok=True)
    sizes = ["--num-requests", str(a.num_requests), "--input-len", str(a.input_len),
             "--output-len", str(a.output_len)]
    prefix = ["--workload", "shared-prefix", "--prefix-len", a.prefix_lens, "--num-groups", "4",
              "--num-requests", "16", "--input-len", "64", "--output-len", "8",
              "--concurrency", "1", "--no-yardstick"]
    rc = 0
    with running_server(a.server_args, a.out / "server-prefix-on.log") as url:
        rc |= bench(url, a.out, "target", *sizes, "--concurrency", "16", "--label", "kvserve")
        rc |= bench(url, a.out, "concurrency", *sizes, "--concurrency", a.concurrency,
                    "--label", "kvserve", "--no-yardstick", "--plot", str(a.out))
        rc |= bench(url, a.out, "prefix-on", *prefix, "--label", "prefix caching on")
    with running_server(a.server_args + ["--no-enable-prefix-caching"],
                        a.out / "server-prefix-off.log") as url:
        rc |= bench(url, a.out, "prefix-off", *prefix, "--label", "prefix caching off",
                    "--plot", str(a.out), "--compare", str(a.out / "prefix-on.json"))
    print(f"\nresults in {a.out}/ (exit status {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
