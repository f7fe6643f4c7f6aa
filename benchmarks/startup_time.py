"""How long a newcomer waits, and how much memory the server holds: ``kvserve serve`` with the
embedded model, timed from the command to ``/health`` 200 and to the first token of the
README's first question, with the server's resident memory (RSS) after it answered.

    python benchmarks/startup_time.py            # two starts in this environment
    python benchmarks/startup_time.py --fresh    # a copy of the checkout, a new venv and an
                                                 # empty kvserve cache: `make install` timed too

``--fresh`` is the first ``make run`` on a new machine (pip's own download cache is the one
thing kept: it is network time, not ours). ``--load N`` runs N busy processes beside it all
(a user's machine is busy too). Prints one line per stage, then the timeline (pip, kernel
build, conversion, load, ready, first answer, the background probe's verdict) and the CPU's
instruction sets. The timings are wall-clock: say which load they ran under.

    python benchmarks/startup_time.py --fresh --load 2   # busy: two spinning processes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "ignore_eos": True}  # 16 tokens every time: comparable requests
# Asked again after the first answer, one at a time, each with its own cache_salt (no prefix
# hit, the same prompt and length): what the same request costs once the server is warm.
LATER = [f"later-{i}" for i in range(8)]


def isa() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    for name in ("amx_int8", "avx512_vnni", "avx512f", "avx2"):
        if name in flags:
            return {"amx_int8": "AMX + AVX-512", "avx512_vnni": "AVX-512 VNNI",
                    "avx512f": "AVX-512", "avx2": "AVX2"}[name]
    return "x86-64 baseline"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _get(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read() or b"{}")


PROBE_DONE = re.compile(r"start-up probe \(background\): (done in|.*the default kernels stay)")


@contextlib.contextmanager
def serving(kvserve: list[str], env: dict[str, str], log: Path, limit_s: float):
    """``kvserve serve`` on a free port, its output in ``log``: yields ``(base URL, process,
    t0)`` once /health answers 200 (``t0``: the monotonic time of the command), stops it after."""
    port = free_port()
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([*kvserve, "serve", "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
            if time.monotonic() - t0 > limit_s:
                raise RuntimeError(f"no /health within {limit_s:.0f} s; see {log}")
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        yield base, proc, t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def one_start(kvserve: list[str], env: dict[str, str], log: Path, limit_s: float) -> dict:
    """Start the server, wait for /health, ask the question, read RSS, wait for the background
    probe's verdict (when one runs), stop it."""
    with serving(kvserve, env, log, limit_s) as (base, proc, t0):
        health = time.monotonic() - t0
        _, answer = _get(base + "/v1/chat/completions", QUESTION, timeout=600)
        first = time.monotonic() - t0
        later = []
        for salt in LATER:
            t1 = time.monotonic()
            _get(base + "/v1/chat/completions", {**QUESTION, "cache_salt": salt}, timeout=600)
            later.append(time.monotonic() - t1)
        rss = rss_bytes(proc.pid)
        probe = None
        if "not yet measured on this machine" in log.read_text():  # a background probe
            while time.monotonic() - t0 < limit_s and not PROBE_DONE.search(log.read_text()):
                time.sleep(0.5)
            probe = time.monotonic() - t0 if PROBE_DONE.search(log.read_text()) else None
        return {"health_s": health, "first_answer_s": first, "rss_bytes": rss,
                "first_request_s": first - health, "later_request_s": sorted(later)[len(later) // 2],
                "probe_done_s": probe, "phases": _phases(log.read_text()),
                "answer": answer["choices"][0]["message"]["content"]}


def _phases(log: str) -> str:
    """The server's own start-up line (conversion, probe, load) without its prefix."""
    m = re.search(r"start-up: (model loaded in .*)", log)
    return m.group(1) if m else "?"


def _busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on a core each (the background load)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def fresh_env(work: Path) -> tuple[list[str], dict[str, str], float]:
    """A copy of the checkout, a venv and an empty cache; returns the kvserve command, the
    environment and the seconds `make install` took."""
    clone = work / "clone"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for rel in files:
        if (ROOT / rel).is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, clone / rel)
    venv = work / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(KVSERVE_CACHE_DIR=str(work / "cache"), PIP_DISABLE_PIP_VERSION_CHECK="1",
               PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}")
    t0 = time.monotonic()
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)],
                   check=True)
    make = subprocess.run(["make", "install", f"PYTHON={venv / 'bin' / 'python'}"], cwd=clone,
                          env=env, check=True, capture_output=True, text=True)
    print(make.stdout, end="", flush=True)
    steps = dict(re.findall(r"^(install|CPU kernels): (?:done|checked) in (\d+) s", make.stdout,
                            re.M))
    print(f"  pip installs {steps.get('install', '?')} s, CPU kernel build "
          f"{steps.get('CPU kernels', '?')} s", flush=True)
    return [str(venv / "bin" / "kvserve")], env, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fresh", action="store_true", help="new checkout copy, venv and cache")
    ap.add_argument("--limit", type=float, default=900.0, help="seconds allowed per start")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="N busy processes beside the whole run (0: quiet)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvserve-startup-"))
    busy = _busy(args.load)
    try:
        install_s = None
        if args.fresh:
            kvserve, env, install_s = fresh_env(work)
            print(f"make install (fresh venv, empty cache): {install_s:.1f} s", flush=True)
        else:
            exe = shutil.which("kvserve")
            kvserve = [exe] if exe else [sys.executable, "-m", "server.cli"]
            env = dict(os.environ)
        runs = []
        for i in (1, 2):
            r = one_start(kvserve, env, work / f"serve-{i}.log", args.limit)
            runs.append(r)
            probe = ("no background probe (a cached verdict)" if r["probe_done_s"] is None
                     else f"background probe's verdict after {r['probe_done_s']:.1f} s")
            print(f"start {i}: /health after {r['health_s']:.1f} s, first answer after "
                  f"{r['first_answer_s']:.1f} s (that request {r['first_request_s']:.2f} s; "
                  f"the same request later, salted: {r['later_request_s']:.2f} s, median of "
                  f"{len(LATER)}), {probe}, RSS {r['rss_bytes'] / 2**30:.2f} GiB "
                  f"({r['answer']!r}); server: {r['phases']}", flush=True)
    finally:
        for p in busy:
            p.kill()
    print(f"\nISA: {isa()}, {os.cpu_count()} CPUs, {args.load} busy processes beside; "
          f"logs in {work}")
    if install_s is not None:
        print(f"first `make run` on a fresh clone to the first answer: "
              f"{install_s + runs[0]['first_answer_s']:.1f} s (target <= 240 s)")
    print(f"second start to /health: {runs[1]['health_s']:.1f} s, to the first answer "
          f"{runs[1]['first_answer_s']:.1f} s (target <= 15 s); RSS after one answer: "
          f"{runs[1]['rss_bytes'] / 2**30:.2f} GiB (target <= 1.5 GiB)")


if __name__ == "__main__":
    main()
