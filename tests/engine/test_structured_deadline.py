"""A constraint whose token mask turns slow while it runs (issue 64 item 3: 46 bytes of EBNF
whose masks took 5-8 s each stalled every user of the engine): the step waits for that row at
most ``mask_timeout`` seconds, then the request alone ends (finish_reason "abort", an
``error_code`` naming its constraint, one log line), the other requests of the same steps
finish exactly as they would have alone, and the constraint is refused from then on. The slow
library call is simulated at the library boundary (the real matcher, its fill delayed once the
sequence is a few tokens in); everything else is the real engine on a tiny Llama."""

from __future__ import annotations

import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.loading.tiny import make_tiny_model_dir
from engine.params.structured import StructuredSpec
from engine.structured import xgrammar_backend

SLOW_AFTER = 3  # fills before the slow one
SLOW = StructuredSpec.text("regex", "[a-z]{4,40}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = make_tiny_model_dir(tmp_path_factory.mktemp("llama"), "llama", seed=3)
    llm = LLM(str(d), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              structured_outputs_config={"backend": "xgrammar", "mask_timeout": 0.3,
                                         "isolation": "thread"})
    yield llm
    llm.close()


@pytest.fixture
def slow_fills(monkeypatch):
    """Every xgrammar matcher of SLOW hangs in its fill after SLOW_AFTER fills, until released;
    the others are untouched."""
    release = threading.Event()
    real_fill, real_init = (xgrammar_backend.XGrammarMatcher.fill_bitmask,
                            xgrammar_backend.XGrammarMatcher.__init__)
    slow_ids: set[int] = set()
    counts: dict[int, int] = {}
    compiled_slow: list = []

    def init(self, compiled, jump_forward=True):
        real_init(self, compiled, jump_forward)
        if compiled_slow and compiled is compiled_slow[0]:
            slow_ids.add(id(self._m))

    def fill(self, bitmask, row):
        key = id(self._m)
        if key in slow_ids:
            counts[key] = counts.get(key, 0) + 1
            if counts[key] > SLOW_AFTER:
                release.wait(60)
        real_fill(self, bitmask, row)

    monkeypatch.setattr(xgrammar_backend.XGrammarMatcher, "__init__", init)
    monkeypatch.setattr(xgrammar_backend.XGrammarMatcher, "fill_bitmask", fill)
    yield compiled_slow
    release.set()


def test_a_mask_past_its_deadline_ends_its_request_only(llm, slow_fills, caplog):
    core = llm.engine
    compiled = core.structured.compile(SLOW)
    slow_fills.append(compiled.grammar)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate([list(b"The plain one: ")], params)[0]  # alone, for comparison
    t0 = time.monotonic()
    outs = llm.generate([list(b"The plain one: "), list(b"Letters: ")],
                        [params, SamplingParams(temperature=0, max_tokens=12,
                                                structured=SLOW)])
    waited = time.monotonic() - t0
    plain, hostile = outs
    assert plain.error is None and plain.outputs[0].token_ids == free.outputs[0].token_ids
    assert hostile.error_code == "constraint_failed"
    assert "longer than 0.3 s" in hostile.error and hostile.outputs[0].finish_reason == "abort"
    assert len(hostile.outputs[0].token_ids) == SLOW_AFTER
    assert waited < 30  # the stuck fill is released only at the end of the test
    assert "Traceback" not in caplog.text
    stats = core.stats().structured
    assert stats.mask_timeouts == 1 and stats.mask_failures == 1
    # the constraint is refused from now on, at once
    with pytest.raises(ValueError, match="longer than 0.3 s"):
        core.structured.compile(SLOW)
    core.kv.check_integrity()
    assert not core.has_unfinished_requests()
