"""SequenceTextState: stop tokens, stop strings, max_tokens and the held-back visible text.

A toy byte tokenizer keeps these tests about stopping (the detokenizer has its own tests):
every token is a byte string, some of them halves of a multi-byte character.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.params.sampling import SamplingParams
from engine.postprocess.stop import FinishInfo, SequenceTextState

EOS, STOP_TOKEN = 0, 1
VOCAB: list[bytes] = [b"<eos>", b"<1>", b"a", b"b", b"c", b" ", b"ab", b"ba", b"abc", b"cab",
                      b"\xe2", b"\x82\xac", b"\xc3", b"\xa9", b"xyz"]
SPECIAL = {EOS}
FIRST_HALF = {10: 11, 12: 13}  # "€" = [10, 11], "é" = [12, 13]
PLAIN = [i for i in range(2, len(VOCAB)) if i not in FIRST_HALF and i not in FIRST_HALF.values()]


class ByteTokenizer:
    """decode() like a HF tokenizer: bytes joined, invalid UTF-8 replaced, specials skippable."""

    def decode(self, ids, skip_special_tokens=False, **_):
        data = b"".join(VOCAB[i] for i in ids if not (skip_special_tokens and i in SPECIAL))
        return data.decode("utf-8", errors="replace")


TOK = ByteTokenizer()


def state(**kw) -> SequenceTextState:
    kw.setdefault("max_tokens", 100)
    return SequenceTextState(TOK, [2, 3], SamplingParams(**kw), frozenset({EOS}))


def feed(st_: SequenceTextState, tokens) -> tuple[FinishInfo | None, list[str]]:
    seen = []
    info = None
    for t in tokens:
        info = st_.append(t)
        seen.append(st_.text)
        if info is not None:
            break
    return info, seen


def ids(*pieces: bytes) -> list[int]:
    return [VOCAB.index(p) for p in pieces]


# ---- explicit cases ------------------------------------------------------------------------


def test_eos_stops_with_no_reason_and_no_text():
    s = state(skip_special_tokens=False)
    info, _ = feed(s, ids(b"ab", b"c") + [EOS, 4])
    assert info == FinishInfo("stop", None)
    assert (s.text, s.token_ids, s.finish_reason, s.stop_reason) == ("abc", [6, 4, EOS], "stop",
                                                                      None)
    assert len(s.token_ids) == 3 and s.finished


def test_ignore_eos_continues():
    s = state(ignore_eos=True, max_tokens=3)
    info, _ = feed(s, [2, EOS, 3])
    assert info == FinishInfo("length", None) and s.text == "ab"


def test_stop_token_ids():
    s = state(stop_token_ids=[STOP_TOKEN])
    assert feed(s, [2, STOP_TOKEN, 3])[0] == FinishInfo("stop", STOP_TOKEN)
    assert s.text == "a" and s.token_ids == [2, STOP_TOKEN]
    s = state(stop_token_ids=[STOP_TOKEN], include_stop_str_in_output=True)
    feed(s, [2, STOP_TOKEN])
    assert s.text == "a<1>"


def test_max_tokens_gives_length_and_flushes_incomplete_character():
    s = state(max_tokens=2)
    info, seen = feed(s, ids(b"a", b"\xe2"))
    assert info == FinishInfo("length", None)
    assert seen == ["a", "a\ufffd"]  # decode() of the same tokens gives U+FFFD too


def test_stop_string_on_the_last_allowed_token_wins_over_length():
    s = state(max_tokens=2, stop=["bc"])
    assert feed(s, ids(b"a", b"abc"))[0] == FinishInfo("stop", "bc")
    assert s.text == "aa"


def test_stop_string_held_back_then_released():
    s = state(stop=["abc"])
    _, seen = feed(s, ids(b"c", b"a", b"b", b"a", b"b", b" "))
    assert seen == ["c", "c", "c", "cab", "cab", "cabab "]
    assert s.finish("length") == FinishInfo("length", None)
    assert s.text == "cabab "


def test_held_back_text_is_visible_at_finish():
    s = state(stop=["abc"], max_tokens=2)
    feed(s, ids(b"c", b"ab"))
    assert s.text == "cab" and s.finish_reason == "length"


def test_stop_string_across_tokens_and_inside_one():
    s = state(stop=["b c"])
    assert feed(s, ids(b"ab", b" ", b"cab"))[0] == FinishInfo("stop", "b c")
    assert s.text == "a"
    s = state(stop=["bc"], include_stop_str_in_output=True)
    feed(s, ids(b"a", b"abcab"[:3]))
    assert s.text == "aabc"


def test_earliest_ending_stop_wins():
    s = state(stop=["cab", "ab", "bab"])
    feed(s, ids(b"c", b"ba", b"b"))  # text "cbab": "ab" ends at 4, as does "bab", which starts first
    assert s.text == "c" and s.stop_reason == "bab"
    s = state(stop=["abc", "ba"])
    feed(s, ids(b"cab", b"abc"))  # "cababc": "ba" ends at 4, "abc" at 6
    assert s.text == "ca" and s.stop_reason == "ba"
    for include, text in ((False, "a"), (True, "ab")):
        s = state(stop=["abc", "b"], include_stop_str_in_output=include)
        feed(s, ids(b"abc"))  # "abc" starts first, but "b" is complete first
        assert s.text == text and s.stop_reason == "b"


def test_eos_listed_as_stop_token_reports_eos():
    s = state(stop_token_ids=[EOS, STOP_TOKEN])
    assert feed(s, [2, EOS])[0] == FinishInfo("stop", None)
    s = state(stop_token_ids=[EOS], ignore_eos=True)
    assert feed(s, [2, EOS])[0] == FinishInfo("stop", EOS)


def test_unicode_stop_string_split_across_tokens():
    s = state(stop=["€"])
    _, seen = feed(s, ids(b"a", b"\xe2", b"\x82\xac", b"b"))
    assert seen == ["a", "a", "a"] and s.stop_reason == "€"


def test_min_tokens_defers_eos_stop_tokens_and_stop_strings():
    s = state(min_tokens=3, stop=["b"], stop_token_ids=[STOP_TOKEN])
    info, seen = feed(s, [3, EOS, STOP_TOKEN, 2, 3])
    # Tokens 1-3 cannot stop: their "b", EOS ("" skipped) and "<1>" are plain text.
    assert info == FinishInfo("stop", "b")
    assert s.text == "b<1>a" and len(s.token_ids) == 5


def test_append_or_finish_after_finish_raises():
    s = state(max_tokens=1)
    feed(s, [2])
    with pytest.raises(RuntimeError):
        s.append(2)
    with pytest.raises(RuntimeError):
        s.finish()


# ---- property: stop strings never leak, visible text only grows -----------------------------

PIECE = st.one_of(st.sampled_from(PLAIN).map(lambda i: [i]),
                  st.sampled_from(sorted(FIRST_HALF.items())).map(list),
                  st.sampled_from([EOS, STOP_TOKEN]).map(lambda i: [i]))
STOP_STR = st.text(alphabet="abc €é", min_size=1, max_size=4)


def _reference(tokens, stops, include, max_tokens, ignore_eos):
    """The finish by brute force: re-decode every prefix and look for any stop string."""
    kept: list[int] = []
    for t in tokens[:max_tokens]:
        if t == EOS and not ignore_eos:
            return TOK.decode(kept, True), "stop", None
        if t == STOP_TOKEN:
            return TOK.decode(kept + ([t] if include else []), True), "stop", STOP_TOKEN
        kept.append(t)
        complete = kept[:-1] if kept[-1] in FIRST_HALF else kept
        text = TOK.decode(complete, True)
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if hits:
            end, start, s = min(hits)
            return text[:end if include else start], "stop", s
    return TOK.decode(kept, True), "length", None


def _stop_strings(text: str):
    """Stop strings that often occur in (or overlap) the text: random ones and its substrings."""
    random = STOP_STR
    if len(text) < 2:
        return st.lists(random, min_size=1, max_size=3)
    sub = st.tuples(st.integers(0, len(text) - 2), st.integers(2, 5)).map(
        lambda p: text[p[0]:p[0] + p[1]])
    return st.lists(st.one_of(random, sub, sub), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), include=st.booleans(), max_tokens=st.integers(1, 40),
       ignore_eos=st.booleans())
def test_stop_strings_never_leak_and_text_only_grows(data, include, max_tokens, ignore_eos):
    tokens = [t for p in data.draw(st.lists(PIECE, max_size=25), label="pieces") for t in p]
    stops = data.draw(_stop_strings(TOK.decode(tokens, True).replace("\ufffd", "")),
                      label="stops")
    s = state(stop=stops, include_stop_str_in_output=include, max_tokens=max_tokens,
              ignore_eos=ignore_eos, stop_token_ids=[STOP_TOKEN])
    info, seen = feed(s, tokens)
    if info is None:  # ran out of tokens before any finish
        info = s.finish("length")
        seen.append(s.text)
    want_text, want_reason, want_stop = _reference(tokens, stops, include, max_tokens,
                                                   ignore_eos)
    assert (s.text, info.reason, info.stop_reason) == (want_text, want_reason, want_stop)
    for before, after in zip(seen, seen[1:], strict=False):
        assert after.startswith(before)
    assert all(s.text.startswith(v) for v in seen)
    if not include:
        assert not any(stop in v for v in seen for stop in stops)


class _CountingStop(str):
    calls = 0

    def startswith(self, *args):
        _CountingStop.calls += 1
        return str.startswith(self, *args)


def test_held_back_scan_is_incremental_not_quadratic():
    """Each token scans only what can extend a stop string's partial match: near-misses such
    as "aaac" against "a"*50 + "b" used to cost a check per candidate start, every token."""
    stop = _CountingStop("a" * 50 + "b")
    s = state(stop=[stop], max_tokens=1000)
    tokens = ids(b"a", b"a", b"a", b"c") * 60
    _CountingStop.calls = 0
    info, seen = feed(s, tokens)
    assert info is None and seen[-1] == "aaac" * 60
    assert _CountingStop.calls <= 2 * len(tokens)
    # Still exact: a partial match is held back, then released.
    s = state(stop=["xyzab"], max_tokens=100)
    _, seen = feed(s, ids(b"c", b"xyz", b"a", b"c"))
    assert seen == ["c", "c", "c", "cxyzac"]
