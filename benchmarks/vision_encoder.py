"""Images through Gemma 3's vision tower, and what the encoder cache saves a request's TTFT.

No model is downloaded: the checkpoint is written here with random weights at Gemma 3's real
image-side shapes (SigLIP: 896x896 pixels in 14x14 patches, 27 layers of width 1152, pooled to
256 soft tokens; the timing depends on the shapes only) in front of a text model of Gemma 3
270M's shapes (18 layers, width 640; a byte-level vocabulary, so the timing leaves out a
262k-row head that one prompt token per request reads). Then, in one engine (float32, the
torch attention backend):

1. the encoder alone: images/s at batch 1 and ``--batch``;
2. TTFT (``max_tokens=1``), alternated: a request whose image the encoder cache lacks
   ("miss"), then one with an image it holds ("hit"). Every request's text before the image is
   new, so the prefix cache never serves the image's blocks: the difference is the encoder.

    python benchmarks/vision_encoder.py [--rounds 3] [--batch 2] [--vision-layers 27]

Prints each measurement, then the medians and the miss/hit ratio, with the ISA."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from startup_time import isa  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.loading.tiny_vision import (  # noqa: E402
    SPECIAL_IDS,
    VOCAB,
    tiny_gemma3_vision_tokenizer,
)
from engine.params.prompt_image import PromptImage  # noqa: E402
from engine.vision.images import hash_image, preprocess  # noqa: E402

# Gemma 3 4B/12B/27B's vision_config and Gemma 3 270M's text shapes.
VISION = dict(image_size=896, patch_size=14, hidden_size=1152, intermediate_size=4304,
              num_hidden_layers=27, num_attention_heads=16, vision_use_head=False)
TEXT = dict(vocab_size=VOCAB, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256,
            query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)


def build(path: Path, vision_layers: int) -> Path:
    """The random checkpoint (kept in ``path`` for the next run)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    if (path / "config.json").is_file():
        return path
    config = Gemma3Config(
        text_config=TEXT, vision_config={**VISION, "num_hidden_layers": vision_layers},
        mm_tokens_per_image=256, image_token_index=SPECIAL_IDS["<image_soft_token>"],
        boi_token_index=SPECIAL_IDS["<start_of_image>"],
        eoi_token_index=SPECIAL_IDS["<end_of_image>"], bos_token_id=SPECIAL_IDS["<s>"],
        eos_token_id=SPECIAL_IDS["</s>"], pad_token_id=SPECIAL_IDS["</s>"])
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tiny_gemma3_vision_tokenizer().save_pretrained(path)
    return path


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))


def request(llm: LLM, text: str, image: Image.Image) -> tuple[list[int], PromptImage]:
    tok, fmt = llm.tokenizer, llm.engine.image_format
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image"},
                                      {"type": "text", "text": "Describe it."}]}],
        tokenize=False, add_generation_prompt=True)
    ids = tok.encode(fmt.expand(rendered), add_special_tokens=False)
    (offset, length), = fmt.spans(ids)
    pixels = preprocess([image], llm.engine.runner.vision.encoder.config)[0]
    return ids, PromptImage(hash_image(image), offset, length, pixels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="miss/hit pairs")
    ap.add_argument("--batch", type=int, default=2, help="images per encoder call (2nd figure)")
    ap.add_argument("--vision-layers", type=int, default=VISION["num_hidden_layers"])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "kvserve-bench")
    args = ap.parse_args()
    path = build(args.dir / f"gemma3-vision-{args.vision_layers}l", args.vision_layers)
    print(f"ISA {isa()}, {torch.get_num_threads()} threads; checkpoint {path}", flush=True)
    llm = LLM(str(path), dtype="float32", quantization="none", attention_backend="torch",
              enable_prefix_caching=True, max_model_len=2048)
    vision = llm.engine.runner.vision
    config = vision.encoder.config
    pixels = preprocess([picture(1000 + i) for i in range(args.batch)], config)
    vision.encoder.encode(pixels[:1])  # warm-up
    rates = {}
    for batch in sorted({1, args.batch}):
        start = time.perf_counter()
        vision.encoder.encode(pixels[:batch])
        rates[batch] = batch / (time.perf_counter() - start)
        print(f"encoder, batch {batch}: {rates[batch]:.3f} images/s", flush=True)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seen = picture(1)
    prompts, images = _one(llm, "Warm-up:", seen)
    llm.generate(prompts, params, images=images)  # the seen image enters the encoder cache
    ttft: dict[str, list[float]] = {"miss": [], "hit": []}
    for r in range(args.rounds):
        for kind, image in (("miss", picture(2000 + r)), ("hit", seen)):
            prompts, images = _one(llm, f"Round {r}, {kind}: what is this?", image)
            encoded = vision.images_encoded
            start = time.perf_counter()
            llm.generate(prompts, params, images=images)
            ttft[kind].append(time.perf_counter() - start)
            print(f"round {r} {kind}: TTFT {ttft[kind][-1]:.3f} s, encoder ran "
                  f"{vision.images_encoded - encoded}x", flush=True)
    miss, hit = statistics.median(ttft["miss"]), statistics.median(ttft["hit"])
    print(f"\nISA {isa()}: encoder {rates[1]:.3f} images/s (batch 1), "
          f"{rates[args.batch]:.3f} images/s (batch {args.batch}); TTFT median miss "
          f"{miss:.3f} s, hit {hit:.3f} s: {miss / hit:.1f}x (prompt {len(prompts[0])} tokens, "
          f"{config.tokens_per_image} of them the image's)")
    llm.close()


def _one(llm: LLM, text: str, image: Image.Image
         ) -> tuple[list[list[int]], list[list[PromptImage]]]:
    ids, placed = request(llm, text, image)
    return [ids], [[placed]]


if __name__ == "__main__":
    main()
