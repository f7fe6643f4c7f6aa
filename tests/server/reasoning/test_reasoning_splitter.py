"""The reasoning splitter (server/reasoning): every output cut the same whole or streamed in
any pieces, a marker split across pieces never leaking into either field; the thought's start
read off the prompt; the format chosen from a chat template."""

from __future__ import annotations

import random

import pytest

from server.reasoning.fields import reasoning_tokens
from server.reasoning.formats import FORMATS, choose_reasoning
from server.reasoning.splitter import ReasoningSplitter

THINK = FORMATS["qwen3"]
CASES = [  # (output, starts inside the thought, reasoning or None, content)
    ("<think>Let me see.</think>\n\nParis.", False, "Let me see.", "Paris."),
    ("\n<think>\nhm\n</think>Paris", False, "\nhm\n", "Paris"),
    ("Paris, no thought.", False, None, "Paris, no thought."),
    ("Let me see.</think>Paris.", True, "Let me see.", "Paris."),  # DeepSeek-R1: the prompt
    ("Cut off while thinking", True, "Cut off while thinking", ""),  # opened it
    ("<think>never closed", False, "never closed", ""),
    ("<think></think>\n\nJust the answer.", False, "", "Just the answer."),
    ("Use <think> later? no.", False, None, "Use <think> later? no."),
    ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("<thi", False, None, "<thi"),
]


@pytest.mark.parametrize("text,thinking,reasoning,content", CASES)
def test_whole_and_streamed_outputs_split_alike(text, thinking, reasoning, content):
    assert ReasoningSplitter(THINK, thinking).split(text) == (reasoning, content)
    rng = random.Random(len(text))
    for _ in range(30):  # random pieces, single characters included
        s = ReasoningSplitter(THINK, thinking)
        got_r, got_c, i = [], [], 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            r, c = s.feed(text[i:j])
            assert "<think>" not in r + c or "<think>" in content
            got_r.append(r)
            got_c.append(c)
            i = j
        r, c = s.finish()
        assert "".join(got_r) + r == (reasoning or "")
        assert "".join(got_c) + c == content


def test_the_prompt_says_whether_the_output_starts_thinking():
    assert THINK.starts_thinking("<|im_start|>assistant\n<think>\n")
    assert not THINK.starts_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.starts_thinking("<|im_start|>assistant\n")
    assert not THINK.starts_thinking("<think>x</think> user: <think> what? assistant:")


def test_the_format_is_chosen_from_the_template():
    assert choose_reasoning("{% if enable_thinking %}<think>{% endif %}</think>")[0].name == \
        "qwen3"
    assert choose_reasoning("{{ '<think>\\n' }} ... </think>")[0].name == "deepseek_r1"
    assert choose_reasoning("{{ messages }}")[0] is None
    assert choose_reasoning(None, "kimi_k2")[0].name == "kimi_k2"
    assert choose_reasoning("<think></think>", "none")[0] is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        choose_reasoning(None, "bogus")


class _Chars:
    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]


def test_reasoning_tokens_count_up_to_the_closing_marker():
    text = "<think>abc</think>Paris"
    ids = [ord(ch) for ch in text]
    assert reasoning_tokens(_Chars(), THINK, ids, "abc", True) == len("<think>abc</think>")
    assert reasoning_tokens(_Chars(), THINK, ids, "abc", False) == len(ids)
    assert reasoning_tokens(_Chars(), THINK, ids, None, False) == 0
