"""Property and stateful tests: random admit / step / share / free / reset sequences.

An independent model tracks each sequence's block table, the blocks in use, and what KV each
block physically holds (which tokens, after which history, under which salt). After every
operation the manager must agree with the model, pass check_integrity(), never hand out a block
that is in use, never let a sequence write into a shared block, and every prefix hit must return
blocks whose content is exactly the queried prefix.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache import KVCacheManager, PrefixHit, compute_block_hashes

SALTS = ((), ("tenant-a",))
token_lists = st.lists(st.integers(0, 2), max_size=12)  # tiny alphabet: many shared prefixes


@given(tokens=st.lists(st.integers(0, 60000), max_size=40), bs=st.sampled_from([1, 2, 4, 16]))
def test_hash_of_a_prefix_is_a_prefix_of_the_hashes(tokens, bs):
    full = compute_block_hashes(tokens, bs)
    assert len(full) == len(tokens) // bs
    for k in range(len(full) + 1):
        assert compute_block_hashes(tokens[: k * bs], bs) == full[:k]
    assert len(set(full)) == len(full)  # the chain makes every position distinct


class KVManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(1, 10),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, caching):
        self.m = KVCacheManager(num_blocks, block_size, caching, on_evict=self.on_evict)
        self.bs = block_size
        self.n = num_blocks
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.salt: dict[str, tuple] = {}
        self.content: dict[int, tuple | None] = {}  # block -> (salt, prefix tokens) it holds
        self.next_id = 0

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        # Called before the block reaches its new owner: it is out of the free queue, in no
        # table yet, and its hash is gone from the map.
        block = self.m.pool.blocks[block_id]
        assert block.block_hash is None and block_hash not in self.m.pool.cached
        assert all(b is not block for b in self.m.pool.free_queue)
        assert block_id not in self.used()
        assert self.m.enable_prefix_caching

    # ------------------------------------------------------------------ model helpers
    def used(self) -> set[int]:
        return {b for t in self.tables.values() for b in t}

    def refs(self, block_id: int) -> int:
        return sum(t.count(block_id) for t in self.tables.values())

    def new_seq_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def check_hit(self, hit: PrefixHit, tokens: list[int], salt: tuple) -> None:
        bs = self.bs
        assert hit.num_tokens == len(hit.block_ids) * bs
        assert hit.num_tokens <= max(0, len(tokens) - 1), "a hit must leave the last token"
        for i, b in enumerate(hit.block_ids):
            assert self.content.get(b) == (salt, tuple(tokens[: (i + 1) * bs])), (
                f"hit block {b} at {i} does not hold the queried prefix"
            )

    def snapshot(self):
        m = self.m
        return (
            {s: m.block_table(s) for s in self.tables},
            [b.block_id for b in m.pool.free_queue],
            [(b.ref_count, b.block_hash) for b in m.pool.blocks],
            m.stats(),
        )

    def try_allocate(self, seq, num_tokens, prefix=None) -> bool:
        """allocate() checked against the model; on success the model table is updated."""
        have = self.tables.get(seq, [])
        pre = prefix.block_ids if prefix is not None and not have else []
        used = self.used()
        fresh = max(0, -(-num_tokens // self.bs) - len(have) - len(pre))
        needed = fresh + sum(1 for b in pre if b not in used)
        assert self.m.num_blocks_needed(seq, num_tokens, prefix) == needed
        before = self.snapshot()
        got = self.m.allocate(seq, num_tokens, prefix)
        if got is None:
            assert needed > self.n - len(used), "allocate refused although the model had room"
            assert self.snapshot() == before, "a failed allocate changed state"
            return False
        assert len(got) == fresh
        assert not set(got) & used, f"handed out blocks already in use: {set(got) & used}"
        for b in got:
            self.content[b] = None  # fresh blocks hold garbage until written
        self.tables[seq] = have + list(pre) + got
        return True

    def compute(self, seq, upto: int) -> None:
        """The forward pass writes positions [computed, upto), then the scheduler commits."""
        bs, table, toks = self.bs, self.tables[seq], self.tokens[seq]
        start = self.computed[seq]
        for i in range(start // bs, -(-upto // bs)):
            assert self.refs(table[i]) == 1, f"{seq} would write into shared block {table[i]}"
            full = (i + 1) * bs <= upto
            self.content[table[i]] = (self.salt[seq], tuple(toks[: (i + 1) * bs])) if full else None
        self.computed[seq] = upto
        self.m.commit(seq, toks, upto, self.salt[seq])

    # ------------------------------------------------------------------------ rules
    @rule(data=st.data(), suffix=token_lists, salt=st.sampled_from(SALTS), chunk=st.integers(1, 9))
    def admit(self, data, suffix, salt, chunk):
        """A new request: look up its prompt, allocate the first chunk on top of the hit."""
        base = []
        if self.tokens:
            src = data.draw(st.sampled_from(sorted(self.tokens)))
            base = self.tokens[src][: data.draw(st.integers(0, len(self.tokens[src])))]
        prompt = base + suffix
        if not prompt:
            return
        seq = self.new_seq_id()
        hit = self.m.find_prefix(seq, prompt, salt)
        self.check_hit(hit, prompt, salt)
        self.tokens[seq], self.salt[seq], self.computed[seq] = prompt, salt, hit.num_tokens
        upto = min(len(prompt), hit.num_tokens + chunk)
        if self.try_allocate(seq, upto, hit):
            self.compute(seq, upto)
        else:
            self.m.free(seq)  # gives up (the scheduler would keep it waiting)
            del self.tokens[seq], self.salt[seq], self.computed[seq]

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), chunk=st.integers(1, 5), new_token=st.integers(0, 2))
    def step(self, data, chunk, new_token):
        """Advance a running sequence: the next prefill chunk, or decode one token."""
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        toks = self.tokens[seq]
        if self.computed[seq] >= len(toks):
            toks.append(new_token)
        upto = min(len(toks), self.computed[seq] + chunk)
        if self.try_allocate(seq, upto):
            self.compute(seq, upto)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), suffix=token_lists, chunk=st.integers(1, 6))
    def share(self, data, suffix, chunk):
        """An n>1 sibling starts from a running sequence's computed full blocks."""
        src = data.draw(st.sampled_from(sorted(self.tables)))
        k_max = self.computed[src] // self.bs
        if k_max == 0:
            return
        k = data.draw(st.integers(1, k_max))
        prefix = PrefixHit(self.tables[src][:k], k * self.bs)
        seq = self.new_seq_id()
        self.tokens[seq] = self.tokens[src][: k * self.bs] + suffix
        self.salt[seq], self.computed[seq] = self.salt[src], k * self.bs
        upto = min(len(self.tokens[seq]), k * self.bs + chunk)
        if self.try_allocate(seq, upto, prefix):
            self.compute(seq, upto)
        else:
            self.m.free(seq)
            del self.tokens[seq], self.salt[seq], self.computed[seq]

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), twice=st.booleans())
    def free(self, data, twice):
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        self.m.free(seq)
        if twice:
            self.m.free(seq)
        del self.tables[seq], self.tokens[seq], self.salt[seq], self.computed[seq]
        assert self.m.block_table(seq) == []

    @rule(tokens=token_lists, salt=st.sampled_from(SALTS))
    def lookup(self, tokens, salt):
        """A lookup that is never followed by an allocation (the request is rejected)."""
        hit = self.m.find_prefix("probe", tokens, salt, record_stats=False)
        self.check_hit(hit, tokens, salt)
        self.m.free("probe")

    @rule()
    def reset(self):
        full = self.m.reset_prefix_cache()
        used = self.used()
        holders = {b.block_id for b in self.m.pool.blocks if b.block_hash is not None}
        assert holders <= used, "a free block kept its hash through a reset"
        assert full == (not holders)

    # ------------------------------------------------------------------- invariants
    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        for seq, table in self.tables.items():
            assert self.m.block_table(seq) == table
        used = self.used()
        assert self.m.num_free_blocks == self.n - len(used)
        for b in range(self.n):
            assert self.m.pool.blocks[b].ref_count == self.refs(b)


KVManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVManagerMachine = KVManagerMachine.TestCase
