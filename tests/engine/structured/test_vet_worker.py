"""Vetting in a child process that a deadline kills (engine.structured.vet_worker), issue 64
items 1, 2 and 4: a constraint whose compile runs past the deadline stops costing anything the
moment it is refused (the child is killed and replaced; the next constraint is vetted by the
new one), a grammar that admits nothing is refused by name, a library that finished its probe
before the deadline still serves, and ``close`` leaves no process behind. The slow constraint is
a 38-byte schema whose pattern xgrammar expands for tens of seconds; the child is the real one
(``python -m engine.structured.vet_worker``) over the byte-level test tokenizer."""

from __future__ import annotations

import time

import pytest

from engine.loading.tiny import VOCAB
from engine.params.structured import StructuredSpec as S
from engine.structured.backend import GrammarError
from engine.structured.cache import GrammarCache
from engine.structured.compile_queue import CompileQueue, CompileQueueFullError
from engine.structured.vet_worker import VetWorker
from tests.support.byte_grammar import EOS

SLOW = S.json_schema({"type": "string", "pattern": "a{40000}"})  # minutes of xgrammar's time


@pytest.fixture(scope="module")
def worker(tok):
    w = VetWorker(tok, VOCAB, [EOS], "auto", timeout=3.0)
    yield w
    w.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_plain_constraint_gets_a_verdict(worker):
    verdict = worker.vet(S.json_schema({"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"]}))
    assert verdict.library in ("xgrammar", "llguidance") and verdict.jump_forward
    assert {p.library for p in verdict.probes} == {"xgrammar", "llguidance"}


def test_a_grammar_that_admits_nothing_is_refused_by_name(worker):
    with pytest.raises(GrammarError, match="admits no complete output"):
        worker.vet(S.json_schema({"$ref": "#/$defs/a", "$defs": {"a": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}}}))


def test_a_compile_past_the_deadline_is_killed_and_the_child_replaced(worker):
    worker.vet(S.choice(["warm"]))
    pid, kills = worker.pid, worker.kills
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within 3 s"):
        worker.vet(SLOW)
    assert time.monotonic() - t0 < 60  # the compile alone runs for minutes
    assert worker.kills == kills + 1 and not _alive(pid)
    assert worker.pid != pid
    assert worker.vet(S.choice(["yes", "no"])).library  # the replacement serves


def test_close_leaves_no_process(tok):
    w = VetWorker(tok, VOCAB, [EOS], "xgrammar", timeout=5.0)
    w.vet(S.choice(["a"]))
    pid = w.pid
    w.close()
    assert not _alive(pid)
    with pytest.raises(GrammarError, match="shut down"):
        w.vet(S.choice(["a"]))


def test_the_cache_refuses_at_once_what_it_refused_and_bounds_its_queue():
    import threading

    release = threading.Event()

    def compile_fn(spec):
        if spec.kind == "regex":
            raise GrammarError(f"refused {spec.value}")
        release.wait(30)
        return spec.value

    cache = GrammarCache(compile_fn, max_pending=8, refusal_ttl=60)  # 2 per client
    try:
        with pytest.raises(GrammarError, match="refused x"):
            cache.compile(S.text("regex", "x"))
        with pytest.raises(GrammarError, match="refused x"):  # from memory
            cache.compile(S.text("regex", "x"))
        futures = [cache.submit(S.choice([str(i)])) for i in range(2)]
        with pytest.raises(CompileQueueFullError, match="waiting"):
            cache.submit(S.choice(["third"]))
        assert cache.submit(S.choice(["third"]), bounded=False) is not None  # the engine's own
        assert cache.submit(S.choice(["0"])) is futures[0]  # a hit is never turned away
        release.set()
        assert [f.result(30) for f in futures] == ['["0"]', '["1"]']
        cache.refuse(S.choice(["0"]), "its mask ran past the deadline")
        with pytest.raises(GrammarError, match="deadline"):
            cache.compile(S.choice(["0"]))
        s = cache.stats()
        assert (s.refusal_hits, s.queue_full) == (2, 1)
    finally:
        release.set()
        cache.close()




def test_the_compile_queue_serves_clients_in_turn_and_bounds_each():
    q = CompileQueue(max_items=8, max_per_client=2)
    for k in range(2):
        q.put("attacker", f"a{k}")
    with pytest.raises(CompileQueueFullError, match="this client"):
        q.put("attacker", "a2")
    q.put("user", "u0")
    q.put("attacker", "a2", bounded=False)  # the engine's own: never turned away
    order = [q.get() for _ in range(4)]
    assert order == [("attacker", "a0"), ("user", "u0"), ("attacker", "a1"),
                     ("attacker", "a2")]
    for client, _ in order:
        q.done(client)
    q.put("attacker", "a3")  # its places are free again
    assert q.get() == ("attacker", "a3")
    q.put("attacker", "a4")
    q.put("user", "u1")  # served less recently than the attacker: first, though later
    assert q.get() == ("user", "u1")
    assert q.drain() == ["a4"] and q.get() is None
