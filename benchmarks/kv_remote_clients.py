"""redis-py (with hiredis) vs valkey-glide on the remote KV tier's own records, one run.

The records are what ``engine/kv_cache/remote`` stores (the disk tier's checksummed record
behind its fingerprint header) for one prompt's prefix chain: ``--blocks`` (63: a 1,000-token
prefix in 16-token blocks) of ``--block-bytes`` (368,640: the embedded SmolLM2-135M's block,
30 layers x 2 (K, V) x 3 KV heads x 64 x 2 bytes x 16 tokens). Per client and round, the
store's operations:

* ``write``: the chain SET in pipelined batches of 16 (the writer thread's);
* ``lookup``: pipelined EXISTS over the chain, one round trip (the engine thread's look-up);
* ``read``: MGET in batches of 16, every value verified (the reader thread's load);
* ``get-loop``: one GET per block (the issue's baseline).

Rounds alternate the clients' order (ABBA), on one ``redis-server`` started here on a free
loopback port (or ``--url``), so both see the same server state and machine load. The store's
threads are synchronous; glide's Python client is asyncio-only, so it is timed the way a
thread would call it (a coroutine handed to an event loop on its own thread and waited for)
and, for reference, inside the loop (``glide-async``: the await alone). Prints the median of
each operation per client and the ratio glide / redis-py (> 1: redis-py faster).

    pip install valkey-glide   # not a kvserve dependency: it lost
    PYTHONPATH=. python benchmarks/kv_remote_clients.py [--rounds 30] [--url redis://H:P/0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.kv_cache.remote.record import decode_value, encode_value  # noqa: E402

try:  # the loser: not a dependency of kvserve (pip install valkey-glide to run this)
    from glide import Batch, GlideClient, GlideClientConfiguration, NodeAddress
except ImportError:
    GlideClient = None

BATCH = 16


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=63)
    ap.add_argument("--block-bytes", type=int, default=368_640)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--url", default=None, help="an existing server (default: start one)")
    return ap.parse_args(argv)


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str, int]:
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


class RedisPy:
    name = "redis-py"

    def __init__(self, host: str, port: int, db: int) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.hiredis = redis.utils.HIREDIS_AVAILABLE
        self.r = redis.Redis(host=host, port=port, db=db, socket_timeout=5,
                             socket_connect_timeout=5, retry=Retry(NoBackoff(), 0))

    def write(self, items):
        for k in range(0, len(items), BATCH):
            pipe = self.r.pipeline(transaction=False)
            for key, value in items[k:k + BATCH]:
                pipe.set(key, value)
            pipe.execute()

    def lookup(self, keys):
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(x) for x in pipe.execute()]

    def read(self, keys):
        out = []
        for k in range(0, len(keys), BATCH):
            out += self.r.mget(keys[k:k + BATCH])
        return out

    def get_loop(self, keys):
        return [self.r.get(key) for key in keys]

    def close(self):
        self.r.close()


class Glide:
    """valkey-glide's asyncio client; ``sync``: each call handed to the loop's thread and
    waited for (how the store's threads would use it), else timed inside the loop."""

    def __init__(self, host: str, port: int, db: int, sync: bool = True) -> None:
        self.name = "glide" if sync else "glide-async"
        self.sync = sync
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = GlideClientConfiguration([NodeAddress(host, port)], database_id=db,
                                       request_timeout=5000)
        self.c = self._run(GlideClient.create(cfg))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def timed(self, op: str, arg) -> tuple[float, object]:
        """(seconds, result) of one operation."""
        fn = getattr(self, f"_{op}")
        if self.sync:
            t0 = time.perf_counter()
            out = self._run(fn(arg))
            return time.perf_counter() - t0, out

        async def inside():
            t0 = time.perf_counter()
            out = await fn(arg)
            return time.perf_counter() - t0, out
        return self._run(inside())

    async def _write(self, items):
        for k in range(0, len(items), BATCH):
            batch = Batch(is_atomic=False)
            for key, value in items[k:k + BATCH]:
                batch.set(key, value)
            await self.c.exec(batch, raise_on_error=True)

    async def _lookup(self, keys):
        batch = Batch(is_atomic=False)
        for key in keys:
            batch.exists([key])
        return [bool(x) for x in await self.c.exec(batch, raise_on_error=True)]

    async def _read(self, keys):
        out = []
        for k in range(0, len(keys), BATCH):
            out += await self.c.mget(keys[k:k + BATCH])
        return out

    async def _get_loop(self, keys):
        return [await self.c.get(key) for key in keys]

    def close(self):
        self._run(self.c.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


OPS = ("write", "lookup", "read", "get_loop")


def run_op(client, op: str, data: dict) -> float:
    arg = data["items"] if op == "write" else data["keys"]
    if isinstance(client, Glide):
        dt, out = client.timed(op, arg)
    else:
        t0 = time.perf_counter()
        out = getattr(client, op)(arg)
        dt = time.perf_counter() - t0
    if op == "lookup":
        assert all(out), "a written block was not found"
    elif op in ("read", "get_loop"):  # the same verified bytes from every client
        for value, h in zip(out, data["hashes"]):
            decode_value(value, data["fp"], h, data["block_bytes"])
    return dt


def main(argv=None) -> None:
    args = parse_args(argv)
    if GlideClient is None:
        sys.exit("valkey-glide is not installed (pip install valkey-glide): nothing to compare")
    tmp = Path(tempfile.mkdtemp(prefix="kv-remote-bench-"))
    proc = None
    try:
        if args.url:
            from urllib.parse import urlsplit

            u = urlsplit(args.url)
            host, port, db = u.hostname, u.port or 6379, int((u.path or "/0")[1:] or 0)
        else:
            proc, host, port = start_redis(tmp)
            db = 0
        fp = secrets.token_bytes(32)
        hashes = [secrets.token_bytes(32) for _ in range(args.blocks)]
        payload = os.urandom(args.block_bytes)
        keys = [f"kvserve-bench:{fp.hex()[:24]}:{h.hex()}".encode() for h in hashes]
        items = [(k, encode_value(fp, h, payload)) for k, h in zip(keys, hashes)]
        data = {"keys": keys, "items": items, "hashes": hashes, "fp": fp,
                "block_bytes": args.block_bytes}
        clients = [RedisPy(host, port, db), Glide(host, port, db), Glide(host, port, db, False)]
        print(f"redis-py {__import__('redis').__version__} (hiredis: {clients[0].hiredis}), "
              f"valkey-glide {_version('valkey-glide')}; {args.blocks} blocks of "
              f"{args.block_bytes:,} bytes ({args.blocks * len(items[0][1]) / 2**20:.1f} MiB "
              f"per chain), {args.rounds} rounds, server {host}:{port}")
        clients[0].write(items)  # every client reads what is there from round 1
        times = {(c.name, op): [] for c in clients for op in OPS}
        for r in range(args.rounds + 2):
            order = clients if r % 2 == 0 else clients[::-1]
            for op in OPS:
                for c in order:
                    dt = run_op(c, op, data)
                    if r >= 2:  # two warm-up rounds
                        times[(c.name, op)].append(dt)
        print(f"\n{'operation':<10}" + "".join(f"{c.name:>14}" for c in clients)
              + f"{'glide/redis-py':>16}{'async/redis-py':>16}   (median ms)")
        for op in OPS:
            med = [statistics.median(times[(c.name, op)]) * 1e3 for c in clients]
            print(f"{op:<10}" + "".join(f"{m:>14.2f}" for m in med)
                  + f"{med[1] / med[0]:>16.2f}{med[2] / med[0]:>16.2f}")
        for c in clients:
            c.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    main()
