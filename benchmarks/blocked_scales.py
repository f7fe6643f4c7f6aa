"""Blocked 4-bit weights with the GGUF's own scales (float16; Q4_0 without its mins) against
float32 scales, in one process, on the same weights: decode-step and layer-stack times.

engine/quantization/blocked.py stores a blocked weight's scales in the smallest exact format
(``compact_scales``); this widens them back to float32 (``expand_scales``: the layout before)
for the baseline, builds one C++ decode stack over each and generates the same greedy tokens
with each in turn, ``--repeats`` times. Tokens must be identical (the kernel widens either to
the same float32 values). Prints the median per-step figures and the ratio.

    PYTHONPATH=. python benchmarks/blocked_scales.py [--model F.gguf] [--repeats 5]

(the model defaults to the embedded SmolLM2 Q4_1 GGUF; the Gemma 3 270M-shaped Q4_0 file of
benchmarks/gemma3_gguf.py is the case it was built for).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from engine.llm import LLM  # noqa: E402
from engine.loading.embedded import embedded_gguf_path  # noqa: E402
from engine.models.cpu_decode_stack import CpuDecodeStack, build_decode_stack  # noqa: E402
from engine.quantization.blocked import expand_scales  # noqa: E402
from engine.quantization.linear import QuantLinear  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    llm = LLM(args.model or str(embedded_gguf_path()), kv_cache_memory="256MiB",
              kv_cache_dtype="float16")
    model = llm.engine.runner.model
    mods = [m for m in model.modules() if isinstance(m, QuantLinear) and m.blocked]
    if not mods:
        sys.exit("no blocked 4-bit weights (the start-up probe chose the rows layout)")
    formats = {"float32 scales": {id(m): expand_scales(m.d, m.m) for m in mods},
               "file's scales": {id(m): (m.d, m.m) for m in mods}}
    print(f"{len(mods)} blocked linears; stored as",
          dict(Counter(f"{m.d.dtype} d, m {'not stored' if m.m.shape[-1] == 0 else 'stored'}"
                       for m in mods)))
    stacks, nbytes = {}, {}
    for name, table in formats.items():
        for m in mods:
            m.d, m.m = table[id(m)]
        stacks[name], why = build_decode_stack(model)
        if stacks[name] is None:
            sys.exit(f"no C++ decode stack: {why}")
        nbytes[name] = sum(t.numel() * t.element_size() for m in mods for t in (m.qs, m.d, m.m))
    stack_s: list[float] = []
    call = CpuDecodeStack.__call__

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        out = call(self, *a, **k)
        stack_s.append(time.perf_counter() - t0)
        return out

    CpuDecodeStack.__call__ = timed
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prompt = list(range(1000, 1000 + args.input_len))
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in formats}
    tokens: dict[str, list[int]] = {}
    for _ in tqdm(range(args.repeats), desc="rounds (both formats in turn)"):
        for name, table in formats.items():
            for m in mods:
                m.d, m.m = table[id(m)]
            model.decode_stack = stacks[name]
            stack_s.clear()
            t0 = time.perf_counter()
            out = llm.generate([prompt], params)[0].outputs[0].token_ids
            steps = len(stack_s)
            runs[name].append((statistics.median(stack_s), (time.perf_counter() - t0) / steps))
            tokens.setdefault(name, out)
            if out != tokens["float32 scales"]:
                sys.exit("tokens differ between the scale formats")
    med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for name, rs in runs.items()}
    for name, (stack, step) in med.items():
        print(f"{name:15s} blocked weights {nbytes[name] / 1e6:7.1f} MB   layer stack "
              f"{stack * 1e3:6.3f} ms/step   whole step {step * 1e3:6.3f} ms")
    old, new = "float32 scales", "file's scales"
    print(f"ratio (float32 / file's): bytes {nbytes[old] / nbytes[new]:.2f}x, layer stack "
          f"{med[old][0] / med[new][0]:.2f}x, whole step {med[old][1] / med[new][1]:.2f}x; "
          "tokens identical")


if __name__ == "__main__":
    main()
