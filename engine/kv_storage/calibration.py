"""fp8 KV scale calibration (``calculate_kv_scales``): per layer and KV head, the scale that
maps the largest |K| (and |V|) seen on a built-in text onto the fp8 format's largest number.

With scale 1.0 an fp8 pool saturates keys above the format's maximum (e4m3: 448) and keeps
small ones in its subnormal range, where its 3 mantissa bits thin out; a calibrated scale puts
each head's range where the format is densest. One prefill of :data:`CALIBRATION_TEXT` runs at
start-up with an observer on every decoder layer (``DecoderLayer.kv_observer``) before any
request is admitted; the blocks it writes are free again afterwards (their contents are never
read: a request's blocks are written before they are read).
"""

from __future__ import annotations

import torch

# Varied on purpose: prose, dialogue, numbers, code and a list, so that the heads see more than
# one kind of text. About 300 tokens with a Llama-family tokenizer.
CALIBRATION_TEXT = """\
The lighthouse stood at the edge of the world, or so the keeper liked to say. Every evening he
climbed the one hundred and twelve steps, trimmed the wick, and watched the beam sweep across
the water. "Ships don't need me anymore," he told the inspector in 1987. "They have satellites
now." The inspector wrote something in her notebook and said nothing.

def moving_average(values, window=3):
    out = []
    for i in range(len(values) - window + 1):
        out.append(sum(values[i:i + window]) / window)
    return out

Ingredients: 2 cups of flour, 1 teaspoon of salt, 3/4 cup of warm water, 2 tablespoons of
olive oil. Mix, knead for ten minutes, rest for an hour, then bake at 220 C for 25 minutes.

Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight.
In 2023 the company reported revenue of $4.2 billion, up 12% from the previous year, while
operating costs fell to 61% of sales. Analysts expect growth to slow in the second half.
"""

# A scale below this would map a head's (near-zero) range into fp8's overflow: keep it sane.
_MIN_SCALE = 1e-8


class KVAbsMax:
    """Collects, per layer, the per-KV-head max |K| and |V| of everything it observes."""

    def __init__(self, num_layers: int, num_kv_heads: int, device: torch.device) -> None:
        self.k = torch.zeros(num_layers, num_kv_heads, device=device)
        self.v = torch.zeros(num_layers, num_kv_heads, device=device)

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``k``/``v``: ``[T, KVH, D]``, the layer's new keys and values of this step."""
        torch.maximum(self.k[layer], k.detach().abs().float().amax(dim=(0, 2)), out=self.k[layer])
        torch.maximum(self.v[layer], v.detach().abs().float().amax(dim=(0, 2)), out=self.v[layer])

    def scales(self, fp8_max: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(k_scale, v_scale)``, each ``[KVH]`` float32: absmax / fp8_max."""
        ks = (self.k / fp8_max).clamp_(min=_MIN_SCALE)
        vs = (self.v / fp8_max).clamp_(min=_MIN_SCALE)
        return [(ks[i].contiguous(), vs[i].contiguous()) for i in range(ks.shape[0])]
