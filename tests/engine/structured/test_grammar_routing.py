"""llguidance behind the engine's grammar interface, and the per-constraint choice between it and
xgrammar: on the byte-level vocabulary both libraries allow exactly the same tokens along every
path of a regex, a choice and a JSON schema; llguidance's matcher keeps the interface's
contract (a refused token leaves the state as it was, rollback undoes an accepted stop token);
the router gives each constraint to the library its measurement favours, keeps the kinds only
xgrammar writes, fills one bitmask from both libraries' matchers, and reads vLLM's
``structured_outputs_config``."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config.engine import EngineConfig
from engine.config.structured import StructuredOutputsConfig
from engine.loading.tiny import VOCAB
from engine.params.structured import StructuredSpec
from engine.structured.backend import GrammarError
from engine.structured.llguidance_backend import LLGuidanceBackend
from engine.structured.routing import RoutingBackend
from engine.structured.vetting import LibraryProbe, Verdict, Vetter, candidates, decide
from tests.support.byte_grammar import EOS, allowed

SPECS = {
    "regex": (StructuredSpec.text("regex", "[a-c]{1,3}x(yz)?"), ["abx", "ax", "cbaxyz"]),
    "choice": (StructuredSpec.choice(["yes", "yet", "no"]), ["yes", "yet", "no"]),
    "json": (StructuredSpec.json_schema({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "t": {"enum": ["a", "bc"]}}, "required": ["n", "t"], "additionalProperties": False}),
        ['{"n": 7, "t": "bc"}', '{"n": 42, "t": "a"}']),
}


@pytest.fixture(scope="module")
def llg(tok):
    return LLGuidanceBackend(tok, VOCAB, [EOS])


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_both_libraries_allow_the_same_tokens_along_every_path(tok, backend, llg, kind):
    spec, texts = SPECS[kind]
    for text in texts:
        mx, ml = backend.matcher(backend.compile(spec)), llg.matcher(llg.compile(spec))
        for token in [*_ids(tok, text), EOS]:
            assert allowed(llg, ml) == allowed(backend, mx), (text, token)
            assert mx.accept(token) and ml.accept(token)
        assert mx.is_terminated() and ml.is_terminated()


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_a_refused_token_leaves_the_llguidance_matcher_as_it_was(tok, llg):
    m = llg.matcher(llg.compile(SPECS["regex"][0]))
    before = allowed(llg, m)
    x, y = _ids(tok, "xy")
    assert not m.accept(x) and not m.accept(EOS)  # x needs a letter first; EOS too
    assert allowed(llg, m) == before
    for token in _ids(tok, "ax"):
        assert m.accept(token)
    assert m.accept(EOS) and m.is_terminated() and not m.accept(y)
    m.rollback(1)  # the stop token undone: the grammar goes on
    assert not m.is_terminated() and m.accept(y)
    m.rollback(3)
    assert allowed(llg, m) == before


def test_llguidance_refuses_a_bad_regex_by_name(llg):
    with pytest.raises(GrammarError, match="regex"):
        llg.compile(StructuredSpec.text("regex", "[a-"))


def test_the_verdict_follows_the_measurement_and_keeps_xgrammar_only_kinds():
    regex = SPECS["regex"][0]
    fast_llg = [LibraryProbe("llguidance", 1e-3), LibraryProbe("xgrammar", 2e-3)]
    assert decide(regex, None, fast_llg).library == "llguidance"
    fast_xgr = [LibraryProbe("llguidance", 2e-3), LibraryProbe("xgrammar", 1e-3)]
    assert decide(regex, None, fast_xgr).library == "xgrammar"
    # a library that failed its probe never serves, however fast the other was measured
    slow = [LibraryProbe("llguidance", error="too slow"), LibraryProbe("xgrammar", 9.0)]
    assert decide(regex, None, slow).library == "xgrammar"
    with pytest.raises(GrammarError, match="does not compile"):
        decide(regex, None, [LibraryProbe("llguidance", error="llguidance: bad"),
                             LibraryProbe("xgrammar", error="does not compile: bad")])
    assert candidates("grammar", "auto", True) == ["xgrammar"]
    assert candidates("structural_tag", "llguidance", True) == ["xgrammar"]
    assert candidates("regex", "auto", True) == ["llguidance", "xgrammar"]
    assert candidates("regex", "auto", False) == ["xgrammar"]
    assert candidates("json", "xgrammar", True) == ["xgrammar"]
    assert candidates("choice", "llguidance", True) == ["llguidance"]


def test_the_router_compiles_with_the_verdicts_library(tok):
    router = RoutingBackend(tok, VOCAB, [EOS])
    for lib in ("llguidance", "xgrammar"):
        assert router.compile(SPECS["choice"][0], Verdict(lib, True)).backend.name == lib
    assert router.chosen == {"llguidance": 1, "xgrammar": 1}


def test_the_measurement_times_both_on_one_walk(tok, backend, llg):
    spec = StructuredSpec.text("regex", "([a-z]{1,8} ){20}")
    vetter = Vetter({"xgrammar": backend, "llguidance": llg}, [EOS])
    items = list(vetter.run(spec))
    probes = [p for p in items if isinstance(p, LibraryProbe)]
    assert [p.library for p in probes] == ["llguidance", "xgrammar"]
    assert all(p.error is None and p.fill_seconds >= 0 for p in probes)
    assert vetter.vet(spec).library in ("llguidance", "xgrammar")


def test_one_bitmask_holds_rows_of_both_libraries(tok):
    router = RoutingBackend(tok, VOCAB, [EOS])
    specs = [SPECS["regex"][0], SPECS["choice"][0], SPECS["json"][0]]
    compiled = []
    for i, spec in enumerate(specs):
        compiled.append(router.compile(spec, Verdict("llguidance" if i % 2 else "xgrammar",
                                                      True)))
    assert [c.backend.name for c in compiled] == ["xgrammar", "llguidance", "xgrammar"]
    matchers = [router.matcher(c) for c in compiled]
    bitmask = router.allocate_bitmask(4)
    router.fill_bitmasks(matchers, bitmask, [0, 2, 3])
    logits = torch.zeros(4, VOCAB)
    router.apply_bitmask(logits, bitmask, [0, 2, 3])
    for row, m in zip([0, 2, 3], matchers):
        assert set(torch.isfinite(logits[row]).nonzero().flatten().tolist()) == \
            allowed(router, m)
    assert torch.isfinite(logits[1]).all()  # a row not filled is not masked


def test_structured_outputs_config_reads_vllms_forms():
    assert EngineConfig().structured_outputs_config.backend == "auto"
    cfg = EngineConfig(structured_outputs_config='{"backend": "guidance"}')
    assert cfg.structured_outputs_config == StructuredOutputsConfig("llguidance")
    assert StructuredOutputsConfig.from_value({"backend": "xgrammar"}).backend == "xgrammar"
    for bad, match in (('{"backend": "outlines"}', "one of"), ("{", "JSON"),
                       (json.dumps({"backend": "auto", "x": 1}), "unknown"), ("[1]", "object")):
        with pytest.raises(ValueError, match=match):
            StructuredOutputsConfig.from_value(bad)
