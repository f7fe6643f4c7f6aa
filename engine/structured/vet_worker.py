"""``VetWorker``: constraint vetting (engine.structured.vetting) in a child process that a
deadline kills.

A grammar library's compile or mask fill is one uninterruptible C++ call, and a hostile
constraint can run for minutes or exhaust memory, so vetting runs in a child process: a fresh
interpreter (``python -c``, importing only this package) talking pickled messages over a socket
pair, started with the first constraint, niced once ready, its address space capped at
``memory_limit`` bytes above what it holds then (an allocation past it fails in the child).

One constraint at a time: ``vet`` sends it and reads the results as they come (the grammar's
shape, then each library's probe). After ``timeout`` CPU seconds on it, or ``WALL_FACTOR`` times
that of wall time, the child is killed, a new one started, and the verdict made on what arrived;
a child that dies refuses its constraint and is replaced the same way. ``vet`` is thread-safe
and blocking (the grammar cache's compile thread calls it); ``close`` kills the child without
waiting."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarError
from engine.structured.grammar_shape import GrammarShape
from engine.structured.vetting import LibraryProbe, Verdict, Vetter, decide

logger = logging.getLogger("kvserve.engine")

STARTUP_TIMEOUT_S = 300.0  # the child's imports and tokenizer tables, on a busy machine
# The deadline counts the child's CPU seconds (a busy machine slows a niced child but does not
# make a plain constraint run out of time), capped at this many times it of wall time.
WALL_FACTOR = 4.0
POLL_S = 0.25
CHILD_NICENESS = 5
DEFAULT_MEMORY_LIMIT = 2 << 30


class VetWorker:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Any, policy: str,
                 timeout: float, memory_limit: int = DEFAULT_MEMORY_LIMIT) -> None:
        self._args = (tokenizer, vocab_size, sorted(stop_token_ids), policy, memory_limit)
        self.timeout = timeout
        self._lock = threading.Lock()  # one constraint at a time
        self._proc: Any = None
        self._conn: Connection | None = None
        self._ready = False
        self._closed = False
        self.kills = 0  # children killed at the deadline or found dead

    # ---- the child's lifetime ------------------------------------------------------------

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        # The parent's import path, so that the child finds this package (and whatever the
        # pickled tokenizer's classes live in) however the parent found them.
        boot = (f"import sys; sys.path[:0] = {[p for p in sys.path if p]!r}; "
                f"from engine.structured.vet_worker import child_main; "
                f"from multiprocessing.connection import Connection; "
                f"child_main(Connection({theirs.fileno()}))")
        try:
            proc = subprocess.Popen([sys.executable, "-c", boot], pass_fds=(theirs.fileno(),),
                                    stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        # The child reads it once its interpreter is up (seconds): not on the caller's time.
        # Nothing else is sent before the child answers "ready", so nothing interleaves.
        args = pickle.dumps(self._args)
        threading.Thread(target=_send_quietly, args=(conn, args), daemon=True,
                         name="kvserve-grammar-vet-start").start()
        self._proc, self._conn, self._ready = proc, conn, False

    def _ensure_ready(self) -> Connection:
        if self._closed:
            raise GrammarError("the grammar worker is shut down")
        if self._proc is None or self._proc.poll() is not None:
            self._discard()
            self._spawn()
        conn = self._conn
        assert conn is not None
        if not self._ready:
            try:
                if not conn.poll(STARTUP_TIMEOUT_S):
                    raise EOFError("no answer")
                msg = conn.recv()
            except (EOFError, OSError) as exc:
                self._discard()
                if self._closed:
                    raise GrammarError("the grammar worker is shut down") from None
                raise GrammarError(f"the grammar worker did not start ({exc or 'it exited'}); "
                                   f"see the server log") from None
            if msg[0] != "ready":
                self._discard()
                logger.error("the grammar worker could not start: %s", msg[1])
                raise GrammarError(f"the grammar worker could not start: {msg[1]}")
            self._ready = True
        return conn

    def _discard(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc, self._conn, self._ready = None, None, False
        if conn is not None:
            conn.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def close(self) -> None:
        """Kill the child (a vet in flight then refuses its constraint). Never waits."""
        self._closed = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.wait(1)  # reaped, not left a zombie
            except subprocess.TimeoutExpired:
                pass

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- vetting ---------------------------------------------------------------------------

    def vet(self, spec: StructuredSpec) -> Verdict:
        """The verdict on ``spec`` within ``timeout`` seconds of the child's CPU (or
        ``WALL_FACTOR`` times that of wall time) from the moment it starts on it; raises
        ``GrammarError`` (the reason) when no library may serve it."""
        with self._lock:
            conn = self._ensure_ready()
            clock = _CpuClock(self._proc.pid)
            conn.send(("vet", spec.kind, spec.value))
            wall_end = time.monotonic() + self.timeout * WALL_FACTOR
            shape: GrammarShape | None = None
            probes: list[LibraryProbe] = []
            unfinished: str | None = None
            while True:
                spent = clock.seconds()
                left = min(self.timeout - spent, wall_end - time.monotonic())
                try:
                    if left <= 0 or not conn.poll(min(left, POLL_S)):
                        if left > 0:
                            continue
                        unfinished = (f"the {spec.kind} constraint did not compile within "
                                      f"{self.timeout:g} s; simplify it")
                        self._replace("took longer than the deadline", spec)
                        break
                    msg = conn.recv()
                except (EOFError, OSError):
                    if self._closed:
                        raise GrammarError("the grammar worker is shut down") from None
                    unfinished = (f"the {spec.kind} constraint could not be compiled: the "
                                  f"grammar worker ran out of memory or crashed on it")
                    self._replace("died", spec)
                    break
                if msg[0] == "shape":
                    shape = msg[1]
                elif msg[0] == "probe":
                    probes.append(msg[1])
                elif msg[0] == "refused":
                    raise GrammarError(msg[1])
                else:  # "done"
                    break
            return decide(spec, shape, probes, unfinished)

    def _replace(self, why: str, spec: StructuredSpec) -> None:
        if self._closed:  # close() killed it: nothing to replace
            self._discard()
            return
        self.kills += 1
        logger.warning("grammar worker %s on a %s: replaced (%d so far)", why, spec.describe(),
                       self.kills)
        self._discard()
        self._spawn()  # starting now, ready by the next constraint


def child_main(conn: Connection) -> None:
    """The child: build the libraries, cap memory, then vet what the parent sends until the
    connection closes."""
    try:
        tokenizer, vocab_size, stop, policy, memory_limit = pickle.loads(conn.recv_bytes())
        vetter = Vetter.build(tokenizer, vocab_size, stop, policy)
        for warm in (StructuredSpec.choice(["a", "b"]), StructuredSpec("json_object")):
            list(vetter.run(warm))  # the libraries' first-use costs, before any deadline runs
        _cap_memory(memory_limit)
        # Niced once ready: its start-up (imports, tables: seconds of CPU) at full priority, or
        # a busy engine would starve it for a minute while a request waits for it.
        os.nice(CHILD_NICENESS)
        conn.send(("ready",))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which logs it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        spec = StructuredSpec(msg[1], msg[2])
        try:
            for item in vetter.run(spec):
                conn.send(("shape" if isinstance(item, GrammarShape) else "probe", item))
            conn.send(("done",))
        except GrammarError as exc:
            conn.send(("refused", str(exc)))
        except MemoryError:
            conn.send(("refused", f"the {spec.kind} constraint needs more memory to compile "
                                  f"than a constraint may use; simplify it"))
        except Exception as exc:  # noqa: BLE001 - a library's own failure on this input
            conn.send(("refused", f"the {spec.kind} constraint could not be compiled: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}"))


class _CpuClock:
    """CPU seconds (user + system, all threads) a process spent since this was made, read from
    /proc; where there is no /proc, wall seconds."""

    def __init__(self, pid: int) -> None:
        self._path = f"/proc/{pid}/stat"
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._wall0 = time.monotonic()
        self._cpu0 = self._read()

    def _read(self) -> float | None:
        try:
            with open(self._path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / self._tick
        except (OSError, IndexError, ValueError):
            return None

    def seconds(self) -> float:
        now = self._read()
        if now is None or self._cpu0 is None:
            return time.monotonic() - self._wall0
        return now - self._cpu0


def _send_quietly(conn: Connection, data: bytes) -> None:
    try:
        conn.send_bytes(data)
    except OSError:
        pass  # the child died before reading: the caller finds out when it waits for "ready"


def _cap_memory(limit: int) -> None:
    """Cap the address space at what the child maps now plus ``limit`` (Linux only)."""
    try:
        import resource

        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + limit, mapped + limit))
    except (OSError, ValueError, ImportError):
        pass

