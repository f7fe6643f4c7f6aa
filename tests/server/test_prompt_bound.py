"""The prompt length bound (server/prompt_bound.py): proven where the tokenizer keeps every
character (a text of N characters has at least N / L tokens, L the longest token), withheld
where a normalizer, pre-tokenizer, added token or model may drop or merge text, and a 400
naming the parameter only above ``max_model_len * L`` characters."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from server.errors import APIError
from server.prompt_bound import PromptBound, longest_token_chars, prompt_bound
from tests.engine.postprocess.test_detokenizer import _load_smollm2


@pytest.fixture(scope="module")
def smol(request):
    cache = getattr(request.config, "cache", None)
    return _load_smollm2(cache.mkdir("kvserve-smollm2-tokenizer") if cache else None)


def _bpe(normalizer=None, pre_tokenizer=None, **model_kw) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "a": 1, "b": 2, " ": 3, "ab": 4, "abab": 5}
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "ab")], unk_token="<unk>",
                               **model_kw))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.BPEDecoder()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_the_smollm2_bound_holds_for_texts_tokens_can_spell_longest(smol):
    longest = longest_token_chars(smol)
    assert longest is not None and longest >= 12  # "<|im_start|>" at least
    rnd = random.Random(0)
    pieces = ["#" * 80, "\n" + " " * 80, " " + "=" * 65, "the", " and", "é", "日本", "<|im_start|>",
              "<|im_end|>", "\n", " ", "12345", "\t\t"]
    for _ in range(200):
        text = "".join(rnd.choice(pieces) for _ in range(rnd.randint(1, 40)))
        n = len(smol.encode(text, add_special_tokens=False))
        assert n * longest >= len(text), (text, n)


def test_a_prompt_above_the_bound_is_a_400_naming_the_param_and_one_at_it_is_not():
    bound = PromptBound(longest_token_chars=10, max_model_len=100)
    bound.check(1000, "prompt")
    with pytest.raises(APIError) as info:
        bound.check(1001, "messages")
    err = info.value
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert "101 tokens" in err.message and "1001 characters" in err.message


def test_a_plain_bpe_tokenizer_is_bounded_by_its_longest_token():
    assert longest_token_chars(_bpe()) == len("<unk>")
    assert prompt_bound(_bpe(), 64) == PromptBound(5, 64)
    assert longest_token_chars(_bpe(pre_tokenizer=pre_tokenizers.ByteLevel())) == 5
    assert longest_token_chars(_bpe(normalizer=normalizers.Sequence(
        [normalizers.NFD(), normalizers.Lowercase()]))) == 5


@pytest.mark.parametrize("kw", [
    {"normalizer": normalizers.Strip()},  # "   a   " -> "a"
    {"normalizer": normalizers.BertNormalizer()},  # control characters removed
    {"normalizer": normalizers.NFKC()},  # compositions merge characters
    {"normalizer": normalizers.Sequence([normalizers.Lowercase(), normalizers.Strip()])},
    {"normalizer": normalizers.Replace("ab", "")},
    {"pre_tokenizer": pre_tokenizers.Whitespace()},  # whitespace dropped
    {"pre_tokenizer": pre_tokenizers.Split(" ", "removed")},
    {"fuse_unk": True},  # a run of unknown characters is one token
], ids=["strip", "bert", "nfkc", "sequence", "replace", "whitespace", "split-removed",
        "fuse-unk"])
def test_tokenizers_that_may_drop_or_merge_text_get_no_bound(kw):
    tok = _bpe(**kw)
    assert longest_token_chars(tok) is None
    assert prompt_bound(tok, 64) is None


def test_an_added_token_that_strips_whitespace_withholds_the_bound():
    from tokenizers import AddedToken

    tok = _bpe()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<x>", rstrip=True)]})
    assert len(tok.encode("<x>" + " " * 50, add_special_tokens=False)) == 1  # why
    assert longest_token_chars(tok) is None


def test_a_slow_or_broken_tokenizer_gets_no_bound():
    class Slow:
        pass

    class Broken:
        backend_tokenizer = object()  # no to_str()

    assert prompt_bound(Slow(), 64) is None
    assert prompt_bound(Broken(), 64) is None
