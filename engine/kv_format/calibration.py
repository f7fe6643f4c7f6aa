"""KV scale calibration (``calculate_kv_scales``) on a built-in text, for the two formats whose
error a calibration measurably lowers (docs/decisions.md#weights-and-kv-together):

* fp8: per layer and KV head, the scale that maps the largest |K| (and |V|) seen onto the fp8
  format's largest number (with scale 1.0 keys saturate above the maximum and small ones sit in
  the sparse subnormal range);
* int4: per layer, KV head and channel, a smoothing of the keys, ``s_c = sqrt(max |K_c| / max
  |Q_c|)`` (SmoothQuant's migration with alpha 1/2): the pool stores ``K / s`` and attention
  multiplies the query by ``s``, so ``q.k`` is unchanged while a logit's error is balanced
  between channels. Values are left as they are (docs/decisions.md#kv-int4-key-smoothing).

One prefill of :data:`CALIBRATION_TEXT` runs at start-up with an observer on every decoder layer
(``DecoderLayer.kv_observer``) before any request is admitted; the blocks it writes are free
again afterwards (their contents are never read)."""

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

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor | None = None) -> None:
        """``k``/``v``: ``[T, KVH, D]``, the layer's new keys and values of this step."""
        torch.maximum(self.k[layer], k.detach().abs().float().amax(dim=(0, 2)), out=self.k[layer])
        torch.maximum(self.v[layer], v.detach().abs().float().amax(dim=(0, 2)), out=self.v[layer])

    def scales(self, fp8_max: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(k_scale, v_scale)``, each ``[KVH]`` float32: absmax / fp8_max."""
        ks = (self.k / fp8_max).clamp_(min=_MIN_SCALE)
        vs = (self.v / fp8_max).clamp_(min=_MIN_SCALE)
        return [(ks[i].contiguous(), vs[i].contiguous()) for i in range(ks.shape[0])]


class KVChannelAbsMax:
    """Collects, per layer, the per-KV-head, per-channel max |K| of everything it observes."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:
        self.k = torch.zeros(num_layers, num_kv_heads, head_dim, device=device)
        self.q = torch.zeros(num_layers, num_kv_heads, head_dim, device=device)

    def __call__(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor | None = None) -> None:
        """``k``/``v``: ``[T, KVH, D]``, the layer's new keys and values of this step; ``q``
        ``[T, H, D]`` its queries (each KV head's group of query heads pooled)."""
        torch.maximum(self.k[layer], k.detach().abs().float().amax(dim=0), out=self.k[layer])
        if q is not None:
            qa = q.detach().abs().float().amax(dim=0)  # [H, D]
            qa = qa.view(k.shape[1], -1, qa.shape[-1]).amax(dim=1)
            torch.maximum(self.q[layer], qa, out=self.q[layer])

    def smoothing(self) -> list[tuple[torch.Tensor, None]]:
        """Per layer ``(k_smoothing, None)``: ``[KVH, D]`` float32 ``sqrt(max|K_c| / max|Q_c|)``
        (the query heads of the KV head pooled), floored at 1e-3 of the head's largest so no
        channel divides by 0, divided by its mean over the head (the 4-bit groups carry their
        own scales, so only the ratios between channels matter)."""
        s = (self.k / self.q.clamp(min=_MIN_SCALE)).sqrt()
        s = torch.maximum(s, s.amax(dim=-1, keepdim=True) * 1e-3).clamp_(min=_MIN_SCALE)
        s = s / s.mean(dim=-1, keepdim=True)
        return [(s[i].contiguous(), None) for i in range(s.shape[0])]
