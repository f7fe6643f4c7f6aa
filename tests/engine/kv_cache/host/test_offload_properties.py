"""Stateful property test of the two-tier KV cache: random admit (device and host hits),
advance, share, free/abort, swap out, swap in, lookups and resets, with evictions, spills,
load-backs and host LRU evictions happening as they fall.

Operations between two ``run_step`` rules form one engine step: copies are only recorded, and
``run_step`` executes them (reference ``copy_blocks`` on real tiny pools) before the "model"
writes the scheduled tokens, as EngineCore does. The truth is content: after every flush, each
live sequence's blocks must hold the KV of its own computed tokens, and each hashed block of
either pool the KV its hash names. check_integrity() must pass after every single operation.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache import KVCacheManager, PrefixHit
from tests.engine.kv_cache.host.test_offload_harness import Pools

SALTS = ((), ("tenant-a",))
token_lists = st.lists(st.integers(0, 2), max_size=12)  # tiny alphabet: many shared prefixes
MAX_LIVE = 3  # few live sequences at a time, so that the tiny pools keep turning over


class TwoTierMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 10), host_blocks=st.integers(1, 16),
                block_size=st.sampled_from([1, 2, 4]), caching=st.sampled_from([True, True, False]))
    def setup(self, num_blocks, host_blocks, block_size, caching):
        self.m = KVCacheManager(num_blocks, block_size, caching, num_host_blocks=host_blocks)
        self.p = Pools(self.m)
        self.bs = block_size
        self.live: dict[str, dict] = {}  # seq -> {tokens, salt, computed}
        self.swapped: dict[str, dict] = {}
        self.scheduled: dict[str, int] = {}  # seq -> tokens computed once the step runs
        self.next_id = 0
        self.swaps = 0
        self.history: list[tuple[list[int], tuple]] = []

    def new_seq(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    # ------------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data(), suffix=token_lists, salt=st.sampled_from(SALTS), chunk=st.integers(1, 9))
    def admit(self, data, suffix, salt, chunk):
        """A new request, often starting like an earlier one (which may have left the device)."""
        base = []
        if self.history:
            toks, salt = data.draw(st.sampled_from(self.history))
            base = toks[: data.draw(st.one_of(st.just(len(toks)), st.integers(0, len(toks))))]
        if base + suffix:
            self._admit(base + suffix, salt, chunk)

    def _admit(self, prompt, salt, chunk):
        """Device and host prefix lookup, then the first chunk on top of the hit."""
        seq = self.new_seq()
        hit = self.m.find_prefix(seq, prompt, salt)
        assert hit.num_tokens <= len(prompt) - 1
        upto = min(len(prompt), hit.num_tokens + chunk)
        if self.m.allocate(seq, upto, hit) is None:
            self.m.free(seq)
            return
        self.live[seq] = {"tokens": prompt, "salt": salt, "computed": hit.num_tokens}
        self.scheduled[seq] = upto
        self.history.append((prompt, salt))

    @precondition(lambda self: self.history and len(self.live) < MAX_LIVE)
    @rule(data=st.data(), chunk=st.integers(1, 9), pushed_out=st.booleans())
    def revisit(self, data, chunk, pushed_out):
        """A request repeats an earlier prompt and goes on (a chat's next turn), maybe after
        other traffic pushed every free block out of the device."""
        toks, salt = data.draw(st.sampled_from(self.history))
        if pushed_out:
            self.flood(1, False)
        self._admit(toks + [0], salt, chunk)

    @precondition(lambda self: any(s not in self.scheduled for s in self.live))
    @rule(data=st.data(), chunk=st.integers(1, 5), token=st.integers(0, 2))
    def advance(self, data, chunk, token):
        seq = data.draw(st.sampled_from(sorted(s for s in self.live if s not in self.scheduled)))
        st_ = self.live[seq]
        if st_["computed"] >= len(st_["tokens"]):
            st_["tokens"].append(token)
        upto = min(len(st_["tokens"]), st_["computed"] + chunk)
        if self.m.allocate(seq, upto) is not None:
            self.scheduled[seq] = upto

    @precondition(lambda self: self.live and len(self.live) < MAX_LIVE)
    @rule(data=st.data(), suffix=token_lists)
    def share(self, data, suffix):
        """An n>1 sibling starts from a live sequence's computed full blocks."""
        src = data.draw(st.sampled_from(sorted(self.live)))
        k_max = self.live[src]["computed"] // self.bs
        if k_max == 0:
            return
        k = data.draw(st.integers(1, k_max))
        seq = self.new_seq()
        tokens = self.live[src]["tokens"][: k * self.bs] + suffix
        upto = min(len(tokens), k * self.bs + 1)
        prefix = PrefixHit(self.m.block_table(src)[:k], k * self.bs)
        if self.m.allocate(seq, upto, prefix) is None:
            self.m.free(seq)
            return
        self.live[seq] = {"tokens": tokens, "salt": self.live[src]["salt"],
                          "computed": k * self.bs}
        self.scheduled[seq] = upto

    @precondition(lambda self: self.live or self.swapped)
    @rule(data=st.data(), twice=st.booleans())
    def abort(self, data, twice):
        """Finish or abort a sequence, live or swapped, at any moment of the step."""
        seq = data.draw(st.sampled_from(sorted({**self.live, **self.swapped})))
        self.m.free(seq)
        if twice:
            self.m.free(seq)
        self.live.pop(seq, None)
        self.swapped.pop(seq, None)
        self.scheduled.pop(seq, None)
        assert not self.m.is_swapped(seq) and self.m.block_table(seq) == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        """A live sequence ends (more often than aborts: the pools must turn over)."""
        seq = data.draw(st.sampled_from(sorted(self.live)))
        self.m.free(seq)
        del self.live[seq]
        self.scheduled.pop(seq, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(sorted(self.live)))
        if self.m.swap_out(seq, self.live[seq]["computed"]):
            self.swaps += 1
            self.swapped[seq] = self.live.pop(seq)
            self.scheduled.pop(seq, None)
            assert self.m.block_table(seq) == []
        else:
            assert not self.m.is_swapped(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), chunk=st.integers(1, 4), token=st.integers(0, 2), bounce=st.booleans())
    def swap_in(self, data, chunk, token, bounce):
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        st_ = self.swapped[seq]
        if st_["computed"] >= len(st_["tokens"]):
            st_["tokens"].append(token)
        upto = min(len(st_["tokens"]), st_["computed"] + chunk)
        table = self.m.swap_in(seq, upto)
        if table is None:
            assert self.m.is_swapped(seq)
            return
        assert len(table) == -(-upto // self.bs)
        self.live[seq] = self.swapped.pop(seq)
        self.scheduled[seq] = upto
        if bounce:  # preempted again within the same step, before its loads have run
            assert self.m.swap_out(seq, self.live[seq]["computed"]), "its host blocks are held"
            self.swapped[seq] = self.live.pop(seq)
            del self.scheduled[seq]

    @rule(share=st.integers(1, 4), cached=st.booleans())
    def flood(self, share, cached):
        """Other traffic takes a share of the free blocks (evicting, so spilling, cached ones)
        and leaves, after running a step (its blocks become cached too) or at once."""
        n = -(-self.m.num_free_blocks // share)
        if n == 0:
            return
        seq = self.new_seq()
        tokens = [3 + self.next_id] * (n * self.bs)  # unlike any other sequence's tokens
        self.m.allocate(seq, len(tokens))
        self.live[seq] = {"tokens": tokens, "salt": (), "computed": 0}
        self.scheduled[seq] = len(tokens)
        if cached:
            self._run_step()
        self.m.free(seq)
        del self.live[seq]
        self.scheduled.pop(seq, None)

    @rule(roll=st.integers(0, 9))
    def reset(self, roll):
        if roll == 9:  # rarely: a reset wipes both caches, and the other rules need them
            self.m.reset_prefix_cache()

    @rule()
    def run_step(self):
        """Execute the step: copies first, then the model writes the scheduled tokens."""
        self._run_step()

    @precondition(lambda self: self.scheduled)
    @rule()
    def run_scheduled_step(self):  # a second rule: steps with work come more often
        self._run_step()

    def _run_step(self):
        p = self.p
        p.flush()
        for seq, st_ in self.live.items():
            p.expect_table(seq, st_["tokens"], st_["computed"], st_["salt"])
        for seq, upto in self.scheduled.items():
            st_ = self.live[seq]
            p.compute(seq, st_["tokens"], st_["computed"], upto, st_["salt"])
            st_["computed"] = upto
        self.scheduled = {}
        p.check_named()

    # ------------------------------------------------------------------- invariants
    @invariant()
    def integrity(self):
        if not hasattr(self, "m"):
            return
        self.m.check_integrity()
        assert set(self.m._swapped) == set(self.swapped)
        for seq in self.live:
            assert len(self.m.block_table(seq)) * self.bs >= self.scheduled.get(
                seq, self.live[seq]["computed"])
        s = self.m.offload_stats()
        assert s.host_blocks_free + s.host_blocks_used == s.num_host_blocks


TwoTierMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestTwoTierMachine = TwoTierMachine.TestCase
