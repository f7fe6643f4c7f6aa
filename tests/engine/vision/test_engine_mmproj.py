"""``--mmproj``: a Gemma 3 text model given its images from llama.cpp's image-encoder GGUF.

The text model's directory here has a text-only config (``Gemma3ForCausalLM``: no vision
config, no image token ids, as a GGUF's converted config has none), so the image markers come
from the tokenizer's spellings and the encoder from the mmproj GGUF (written as llama.cpp's
converter writes it: tests/engine/vision/mmproj_writer.py). The truth is HF's
``Gemma3ForConditionalGeneration`` with the projection rounded to float16 (the converter
stores it so even in an F32 file)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loading.tiny_vision import make_tiny_gemma3_vision_dir
from tests.engine.vision.hf_vision_reference import hf_greedy, load_hf_vision
from tests.engine.vision.mmproj_writer import write_mmproj
from tests.engine.vision.test_engine_images import _picture, _prompt


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mmproj")
    full = make_tiny_gemma3_vision_dir(tmp / "full")
    hf = load_hf_vision(full)
    with torch.no_grad():  # what the mmproj holds: the projection in float16
        proj = hf.model.multi_modal_projector.mm_input_projection_weight
        proj.copy_(proj.half().float())
    truth = tmp / "truth"
    hf.save_pretrained(truth, safe_serialization=True)
    for f in full.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special")):
            shutil.copy(f, truth / f.name)
    mmproj = write_mmproj(hf, tmp / "mmproj-f32.gguf", outtype="f32")
    text = tmp / "text"
    shutil.copytree(truth, text)
    config = json.loads((truth / "config.json").read_text())
    text_config = {**config["text_config"], "architectures": ["Gemma3ForCausalLM"],
                   "model_type": "gemma3_text"}
    (text / "config.json").write_text(json.dumps(text_config))
    return truth, text, mmproj


def test_a_text_model_with_an_mmproj_answers_as_hf(dirs):
    truth, text, mmproj = dirs
    llm = LLM(str(text), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              quantization="none", enable_prefix_caching=True, max_num_batched_tokens=24,
              mmproj=str(mmproj))
    try:
        assert llm.engine.image_format is not None
        hf = load_hf_vision(truth)
        prompts = [_prompt(llm, ["What is in", None, "the picture?"], [_picture(1)]),
                   _prompt(llm, [None, "and", None, "?"], [_picture(2), _picture(3)])]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([p[0] for p in prompts], params, images=[p[1] for p in prompts])
        assert [o.outputs[0].token_ids for o in outs] == \
            [hf_greedy(hf, ids, px, 8) for ids, _, px in prompts]
    finally:
        llm.close()


def test_without_the_mmproj_the_text_model_takes_no_images(dirs):
    _, text, _ = dirs
    llm = LLM(str(text), dtype="float32", block_size=4, kv_cache_memory="8MiB",
              quantization="none")
    try:
        assert llm.engine.image_format is None
        with pytest.raises(ValueError, match="does not take images"):
            llm.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=1),
                                   images=(object(),))
    finally:
        llm.close()


def test_an_mmproj_for_another_width_or_model_is_refused(dirs, tmp_path):
    from engine.loading.tiny import make_tiny_model_dir

    _, _, mmproj = dirs
    llama = make_tiny_model_dir(tmp_path / "llama")
    with pytest.raises(ValueError, match="Gemma 3 model"):
        LLM(str(llama), dtype="float32", kv_cache_memory="8MiB", quantization="none",
            mmproj=str(mmproj))
    other = make_tiny_model_dir(tmp_path / "g3", "gemma3_text", hidden_size=96)
    with pytest.raises(ValueError, match="width"):
        LLM(str(other), dtype="float32", kv_cache_memory="8MiB", quantization="none",
            mmproj=str(mmproj))
